"""The classifier service: backend, tokenizer, dynamic batcher, metrics, readiness and warm-up.

It knows nothing of HTTP: the routes hand it a parsed `PredictRequest` and get a `PredictResponse`
back, or an `ApiError` that the app turns into the error body.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from typing import Any, Callable

import numpy as np

from .. import HoloServeError
from holoserve.core.artifact import MANIFEST, Artifact
from holoserve.core.machine import CpuBudget, cpu_budget, usable_cores
from ..backends.base import Backend, load_backend
from holoserve.core.tokenizer import Encoded, TextEncoder
from .batcher import BatchPolicy, DynamicBatcher, InferenceFailed, QueueFull, Result, ShuttingDown
from .config import ServerConfig
from .metrics import ServerMetrics
from .tokenize import TokenizeQueue, TokenizeQueueFull
from .protocol import ApiError, InputLimits, Inputs, ModelInfo, ModelRef, PredictRequest, PredictResponse, Status

log = logging.getLogger("holoserve.server")

# A request with at most this many bytes of text is tokenized on the event loop when the tokenizer's worker is
# idle: handing it to the thread would cost more than encoding it (tokenize.py).
_INLINE_TOKENIZE_BYTES = 1024
_READY = Status(status="ready")


def threads_plan(config: ServerConfig) -> CpuBudget:
    """The intra-op threads each worker's backend gets, and why: `--threads` when set; else, where a CPU quota
    or cpuset limits the process (a container), the CPUs it may use (holoserve.core.machine.cpu_budget);
    else the runtime's own default."""
    if config.threads:
        return CpuBudget(config.threads, f"{config.threads}, set by --threads (HOLOSERVE_THREADS)")
    if os.environ.get("HOLOSERVE_ORT_THREADS"):  # the loaders read it themselves
        return CpuBudget(None, f"{os.environ['HOLOSERVE_ORT_THREADS']} (HOLOSERVE_ORT_THREADS)")
    return cpu_budget(config.workers)


AUTO_INSTANCES = 2  # batches at once where a worker has this many cores (docs/results/2026-11-29-instances.md)
# ... on ONNX Runtime. Wherever OpenVINO serves (alone, or routed with ONNX Runtime) one batch on all threads
# serves about as much, and a lone request faster (docs/results/2026-11-29-kernels-measured.md,
# docs/results/2026-11-30-routed-one-instance.md)
AUTO_OPENVINO_INSTANCES = 1


def instances_plan(config: ServerConfig, threads: int | None) -> int:
    """The batches each worker runs at once on a CPU backend: --instances when set; else AUTO_INSTANCES where
    the worker has at least that many cores (`threads`, its share of a CPU quota or cpuset, or else the physical
    cores it may use shared by the workers), else 1."""
    if config.instances != "auto":
        return int(config.instances)
    cores = threads or usable_cores() // max(1, config.workers)
    return AUTO_INSTANCES if cores >= AUTO_INSTANCES else 1


def backend_options(config: ServerConfig, artifact: Artifact) -> dict[str, Any]:
    """The options a backend's loader gets from the server's settings (`holoserve tune` loads with the same)."""
    # Loaders ignore options they do not use; torch-cuda sizes its CUDA graphs by max_batch.
    threads = threads_plan(config).threads
    opts: dict[str, Any] = {"max_batch": config.max_batch_size, "instances": instances_plan(config, threads)}
    if threads:
        opts["threads"] = threads
    if config.openvino_precision != "auto":
        opts["openvino_precision"] = config.openvino_precision
    if config.openvino_shapes:
        from ..backends.openvino import parse_shapes

        # a shape longer than any request can be would only cost its compile time and memory
        parse_shapes(config.openvino_shapes, effective_max_seq_length(config, artifact))
        opts["openvino_shapes"] = config.openvino_shapes
    if config.openvino_sparse_weights:
        opts["openvino_sparse_weights"] = True
    opts["openvino_kernels"] = config.openvino_kernels
    opts["torch_precision"] = config.torch_precision
    if config.torch_compile:
        opts["torch_compile"] = True
    opts["route"] = config.torch_cuda_route  # torch-cuda's TorchCudaOptions.route
    return opts


def open_backend(config: ServerConfig, artifact: Artifact) -> tuple[Backend, dict[str, Any]]:
    """Load the configured backend; 'auto' picks the best this machine can run and says why. With --instances
    auto, wherever OpenVINO serves (alone, or routed with ONNX Runtime) AUTO_OPENVINO_INSTANCES batch runs at a
    time (`tune` and the start-up timing still time each backend as the plan's instances run it)."""
    opts = backend_options(config, artifact)
    if config.instances == "auto":
        opts["openvino_instances"] = min(opts["instances"], AUTO_OPENVINO_INSTANCES)
    from ..backends.auto import options_served, select_backend

    if config.backend == "auto":
        return select_backend(artifact, **opts)
    backend = load_backend(config.backend, artifact, **options_served([config.backend], opts))
    return backend, {"picked": config.backend, "reason": "requested with --backend", "skipped": {}}


# config.json is a few kB; anything much larger is not a model config and is not read whole.
_MAX_CONFIG_BYTES = 1 << 20
# Models whose position ids start after the padding index: the table holds pad_token_id + 1 fewer tokens.
_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "longformer", "bart"})


def position_table(artifact: Artifact) -> int | None:
    """Tokens the model's position-embedding table can index (config.json, read as JSON only), or None
    when config.json does not say."""
    path = artifact.path / "config.json"
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
        cfg = json.loads(raw) if len(raw) <= _MAX_CONFIG_BYTES else None
    except (OSError, ValueError):
        return None  # the artifact loader owns the checks of config.json itself
    if not isinstance(cfg, dict):
        return None
    n = cfg.get("max_position_embeddings")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return None
    if cfg.get("model_type") in _OFFSET_POSITIONS:
        pad = cfg.get("pad_token_id")
        n -= (pad if isinstance(pad, int) and pad >= 0 else 1) + 1
    return n


def effective_max_seq_length(config: ServerConfig, artifact: Artifact) -> int:
    """The sequence length the server truncates to; HoloServeError for one the model cannot honour.

    The manifest's max_seq_length is the checkpoint's contract: its activation ranges were calibrated,
    and its TensorRT profiles and CUDA graphs sized, for at most that many tokens, and the position
    table (config.json max_position_embeddings) bounds it absolutely. A longer setting would let a long
    text reach the model and fail there, taking its whole batch with it.
    """
    contract = artifact.max_seq_length
    table = position_table(artifact)
    requested = config.max_seq_length
    if requested == 0:
        if table is not None and contract > table:
            raise HoloServeError(
                f"{artifact.path}: manifest.json max_seq_length {contract} exceeds the model's position table "
                f"({table} tokens, config.json max_position_embeddings); the checkpoint is inconsistent: "
                f"re-create it, or serve it with --max-seq-length {table}")
        return contract
    if requested > contract or (table is not None and requested > table):
        where = f"its position table holds {table} tokens (config.json max_position_embeddings) and " \
            if table is not None and requested > table else ""
        raise HoloServeError(
            f"--max-seq-length {requested} is more than model {artifact.path.name} can take: {where}it was "
            f"calibrated and exported for {contract} tokens (manifest.json max_seq_length); use at most "
            f"{min(contract, table or contract)}, or 0 for the manifest's value (longer texts are truncated)")
    return requested


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class ClassifierService:
    """One served model. `start()`/`stop()` bracket its life (the app's lifespan calls them)."""

    def __init__(self, config: ServerConfig, artifact: Artifact, backend: Backend | None = None,
                 decision: dict[str, Any] | None = None, shutdown_flag: Callable[[], bool] | None = None):
        self.config = config
        self.artifact = artifact
        self.backend = backend
        self.decision = decision or {}
        self.shutdown_flag = shutdown_flag or (lambda: False)
        self.name = config.model_name or artifact.path.resolve().name
        self.version = hashlib.sha256((artifact.path / MANIFEST).read_bytes()).hexdigest()[:12]
        self.max_seq = effective_max_seq_length(config, artifact)
        self.encoder = TextEncoder(artifact.path / "tokenizer.json", self.max_seq, pair=artifact.is_pair)
        # texts waiting to be tokenized are bounded as the batcher's queue is
        self.tokenizer = TokenizeQueue(self.encoder.encode, config.max_queue_size, _INLINE_TOKENIZE_BYTES,
                                       busy=lambda: self.batcher is not None and self.batcher.busy,
                                       batch=config.max_batch_size)
        self.labels = artifact.labels or ["score"]
        self.regression = not artifact.labels
        self.limits = InputLimits(max_items=config.max_items, max_text_bytes=config.max_text_bytes,
                                  pair=artifact.is_pair, model=self.name, task=artifact.task_name)
        self.metrics = ServerMetrics(self.name, self.version)
        self.batcher: DynamicBatcher | None = None
        self.model_ref: ModelRef | None = None  # set once the backend is known
        self.status = "loading"
        self.detail: str | None = None
        self.warmup_task: asyncio.Task | None = None
        self.threads_why = threads_plan(config).why  # what backend_options gives the loaders, and why

    # ---- life cycle
    @property
    def ready(self) -> bool:
        return self.status == "ready" and not self.shutdown_flag()

    def load_backend(self) -> None:
        self.backend, decision = open_backend(self.config, self.artifact)
        self.decision = self.decision or decision  # a decision made for all workers (backend_choice.py) stands

    async def start(self) -> None:
        """Load the backend if none was given, start the batcher, and warm up in the background."""
        cfg = self.config
        if self.backend is None:
            await asyncio.to_thread(self.load_backend)
        log.info("serving %s (version %s) with backend %s (threads: %s; batches at once: %d)", self.name,
                 self.version, self.backend.name, self.threads_why, getattr(self.backend, "instances", 1),
                 extra={"backend": self.backend.info(), "selection": self.decision})
        self.model_ref = ModelRef(name=self.name, version=self.version, backend=self.backend.name)
        policy = BatchPolicy(max_batch_size=cfg.max_batch_size, max_queue_delay_ms=cfg.max_queue_delay_ms,
                             max_queue_size=cfg.max_queue_size, max_padding_waste=cfg.padding_waste_for(self.backend),
                             inline_single=cfg.inline_single, max_batch_tokens=cfg.max_batch_tokens,
                             instances=getattr(self.backend, "instances", 1))
        self.batcher = DynamicBatcher(self.backend.infer, policy, pad_id=self.encoder.pad_id, metrics=self.metrics)
        self.batcher.start()
        self.warmup_task = asyncio.get_running_loop().create_task(self._warm())

    async def _warm(self) -> None:
        try:
            if self.config.warmup:
                await asyncio.to_thread(self.warmup)
            self.status = "ready"
            self.metrics.set_ready(True)
            log.info("ready")
        except Exception as e:  # surfaced on /readyz; the process stays up for inspection
            self.status, self.detail = "failed", f"warm-up failed: {e}"
            log.error(self.detail, exc_info=not isinstance(e, HoloServeError))

    def warmup(self) -> None:
        """Run the backend at batch 1 and at the largest batch the batcher forms (max batch size x the longest
        sequence), so that the runtime's memory pools reach their working size before traffic and memory
        after a burst of long requests is what it was before; check the logits' shape."""
        n = len(self.labels)
        self.encoder.encode(["warm up", "the tokenizer"])
        for batch, seq in ((1, 8), (self.config.max_batch_size, self.max_seq)):
            ids = np.full((batch, seq), 1, dtype=np.int64)
            ids[:, 0] = 101 if self.encoder.pad_id == 0 else ids[:, 0]
            out = np.asarray(self.backend.infer(ids, np.ones_like(ids), np.zeros_like(ids)))
            if out.shape != (batch, n):
                raise HoloServeError(
                    f"the backend returned logits of shape {out.shape} for a batch of {batch}; the manifest has "
                    f"{n} label(s) ({self.labels}); the export does not match this checkpoint, re-export it")

    async def stop(self) -> None:
        """Report not ready, then let queued work finish (up to the graceful timeout)."""
        self.status = "shutting_down"
        self.metrics.set_ready(False)
        if self.warmup_task is not None:
            await self.warmup_task
        if self.batcher is not None:
            await self.batcher.stop(self.config.graceful_timeout_s)
        self.tokenizer.close()
        self.metrics.close()
        log.info("stopped")

    # ---- answers
    def readiness(self) -> Status:
        if self.ready:
            return _READY
        return Status(status="shutting_down" if self.shutdown_flag() else self.status, detail=self.detail)

    def model_info(self) -> ModelInfo:
        s = self.artifact.summary()
        info = self.backend.info() if self.backend is not None else {"backend": self.config.backend}
        cfg = self.config
        return ModelInfo(
            name=self.name,
            version=self.version,
            backend={**info, "selection": self.decision.get("reason"), "threads_why": self.threads_why},
            task=s["task"],
            labels=self.artifact.labels,
            max_seq_length=self.max_seq,
            sparsity=s["sparsity"],
            precision=s["precision"],
            metrics=s["metrics"],
            base_model=s["base_model"],
            batching={"max_batch_size": cfg.max_batch_size, "max_queue_delay_ms": cfg.max_queue_delay_ms,
                      "max_queue_size": cfg.max_queue_size, "max_padding_waste": cfg.padding_waste_for(self.backend),
                      "max_batch_tokens": cfg.max_batch_tokens,
                      "inline_single": self.batcher.inline_single if self.batcher else cfg.inline_single,
                      "instances": getattr(self.backend, "instances", 1)},
            limits={"max_items": cfg.max_items, "max_text_bytes": cfg.max_text_bytes,
                    "max_body_bytes": cfg.max_body_bytes},
        )

    async def classify(self, items: Inputs, total_bytes: int, request_id: str,
                       t0: float) -> tuple[list[Encoded], list[Result], float]:
        """Tokenize checked texts (or pairs) and run them through the batcher: their encodings, their
        results and when tokenization ended. The path every inference protocol shares (/predict, /v2);
        ApiError for a server that is not ready, overloaded, shutting down or whose model failed."""
        # While the shutdown drain runs, the status is still "ready" and the batcher still runs: a request
        # already on its way (its body still arriving at the signal) is answered.
        if self.status != "ready":
            if self.status == "shutting_down":
                raise ApiError(503, "shutting_down", "the server is shutting down; retry on another instance",
                               {"Retry-After": "1"})
            raise ApiError(503, "not_ready", f"the model is {self.status.replace('_', ' ')}; retry shortly",
                           {"Retry-After": "1"})
        try:
            encs = await self.tokenizer.encode(items, total_bytes)
        except TokenizeQueueFull as e:
            raise ApiError(503, "overloaded", str(e), {"Retry-After": "1"}) from None
        t1 = time.perf_counter()
        self.metrics.input_duration_l.observe(t1 - t0)
        try:
            results = await self.batcher.submit(encs)
        except QueueFull as e:
            raise ApiError(503, "overloaded", str(e), {"Retry-After": str(e.retry_after_s)}) from None
        except ShuttingDown as e:
            raise ApiError(503, "shutting_down", str(e), {"Retry-After": "1"}) from None
        except InferenceFailed as e:
            # The batcher has already retried this request's sequences on their own, so the other
            # requests of its batch were answered; this one gets a JSON 500 (the connection stays open),
            # counted under reason="inference_failed".
            log.error("inference failed: %s", e, extra={"request_id": request_id})
            raise ApiError(500, "inference_failed", f"the model could not run on this input ({e.kind}); other "
                           f"requests are unaffected; the server log has the details under request id "
                           f"{request_id}") from None
        self.metrics.queue_duration_l.observe(max(r.queue_s for r in results))
        return encs, results, t1

    async def predict(self, req: PredictRequest, request_id: str) -> PredictResponse:
        """Classify the request's texts; every refusal is counted by its error type."""
        t0 = time.perf_counter()
        m = self.metrics
        try:
            return await self._predict(req, request_id, t0)
        except ApiError as e:
            m.fail(e.type)
            raise
        finally:
            m.request_duration_l.observe(time.perf_counter() - t0)

    async def _predict(self, req: PredictRequest, request_id: str, t0: float) -> PredictResponse:
        m = self.metrics
        items, total_bytes = req.inputs(self.limits)
        encs, results, t1 = await self.classify(items, total_bytes, request_id, t0)
        # Plain dicts, validated into `Prediction`s (and `Timing`) by the one PredictResponse call below:
        # a model constructor per prediction would cost a validation call each.
        preds: list[dict[str, Any]] = []
        labels = self.labels
        for enc, r in zip(encs, results):
            if self.regression:
                v = float(r.logits[0])
                preds.append({"label": "score", "score": v, "scores": {"score": v},
                              "num_tokens": enc.length, "truncated": enc.truncated})
                continue
            p = _softmax(r.logits.astype(np.float64))
            k = int(p.argmax())
            preds.append({"label": labels[k], "score": float(p[k]),
                          "scores": {lab: float(x) for lab, x in zip(labels, p)},
                          "num_tokens": enc.length, "truncated": enc.truncated})
        queue_s = max(r.queue_s for r in results)
        infer_s = sum({r.batch_id: r.infer_s for r in results}.values())
        m.success_l.inc()
        timing = {"tokenize": round((t1 - t0) * 1000, 3), "queue": round(queue_s * 1000, 3),
                  "inference": round(infer_s * 1000, 3), "total": round((time.perf_counter() - t0) * 1000, 3)}
        return PredictResponse(model=self.model_ref, predictions=preds, timing_ms=timing, request_id=request_id)
