"""The torch-cuda backend: `load(artifact)` as the backend registry (holoserve.backends.base) calls it.

Checks the device, probes the cuSPARSELt epilogue and the fused quantizers (probe.py), builds the
encoder from the checkpoint (encoder.py) and serves it through per-bucket CUDA graphs (graphs.py). With
`route="auto"` it also builds the dense INT8 GEMMs of the same weights and serves each bucket on whichever
GEMMs the device ran faster at load (routing.py); info() reports the table, which `/v1/models` shows.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

import numpy as np

from holoserve import HoloServeError
from holoserve.backends.base import BackendUnavailable
from holoserve.core.artifact import Artifact

from ._torch import torch
from .encoder import Encoder, Fusion, LinearOptions
from .graphs import GraphRunner
from .layers import DenseLinear, QuantLinear, Tuning
from .probe import choose_epilogue, choose_quantizer, require_cuda
from .routing import (DENSE, ROUTE_MARGIN, ROUTE_MAX_TOKENS, SPARSE, apply_routes, bucket_name, build_variants,
                      check_route, cuda_event_timer, measure_routes, route_table, timing_plan)

NAME = "torch-cuda"
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_SEQ_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512)
PRECISIONS = ("fp16", "fp32")
ACTIVATION_TABLE = ("auto", "on", "off")


@dataclass
class TorchCudaBackend:
    artifact: Artifact
    runner: GraphRunner
    info_extra: dict[str, Any] = field(default_factory=dict)
    name: str = NAME
    whole_batches: bool = True  # one padded CUDA-graph replay beats several smaller ones

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(input_ids)
        if ids.ndim != 2:
            raise HoloServeError(f"input_ids must be [batch, seq], got shape {ids.shape}")
        b, n = ids.shape
        max_seq = self.runner.seq_buckets[-1]
        if n > max_seq:
            raise HoloServeError(f"sequence length {n} exceeds this backend's maximum {max_seq}")
        dev = self.runner.device
        t = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)).to(dev, non_blocking=True)
             for k, v in (("ids", input_ids), ("mask", attention_mask), ("tt", token_type_ids))}
        outs = []
        step = self.runner.max_batch
        for i in range(0, b, step):
            outs.append(self.runner.run_bucket(t["ids"][i:i + step], t["mask"][i:i + step], t["tt"][i:i + step]))
        return torch.cat(outs).float().cpu().numpy()

    def warmup(self, batches: Iterable[int] = (1,), seqs: Iterable[int] | None = None) -> None:
        for b in batches:
            for n in seqs or (self.runner.seq_buckets[-1],):
                ids = np.ones((b, n), dtype=np.int64)
                self.infer(ids, np.ones_like(ids), np.zeros_like(ids))

    def info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "checkpoint": str(self.artifact.path),
            "graphs": self.runner.graphs,
            "graph_error": self.runner.graph_error,
            "capture_seconds": dict(self.runner.capture_seconds),
            "captured_buckets": sorted(f"{b}x{n}" for b, n in self.runner._graphs),
            "batch_buckets": list(self.runner.batch_buckets),
            "seq_buckets": list(self.runner.seq_buckets),
            **self.info_extra,
        }


# cuSPARSELt's algorithm search up to this many tokens (batch x padded length): it pays at small token
# counts and not from 4,096 on; why: docs/results/2026-11-25-gpu-h100.md
ALG_SEARCH_MAX_TOKENS = 2048


@dataclass(frozen=True)
class TorchCudaOptions:
    """The torch-cuda backend's settings; `load` takes them as keyword options and ignores other backends' ones."""

    device: str = "cuda"
    graphs: bool = True  # one CUDA graph per (batch, sequence) bucket
    kernel: str = "cslt"  # the quantized layers' kernel (layers.KERNELS)
    batch_buckets: Iterable[int] = DEFAULT_BATCH_BUCKETS
    seq_buckets: Iterable[int] | None = None  # None: DEFAULT_SEQ_BUCKETS
    max_batch: int | None = None  # drops the batch buckets above it
    quantizer: str = "auto"  # "torch", "triton", or "auto": the Triton kernels where the device probe agrees
    # where cuSPARSELt's own search picks each GEMM's algorithm (once per token count, at warm-up, before the
    # CUDA graphs are captured): True for every token count, an int N up to N tokens, False never (algorithm 0)
    alg_search: bool | int = ALG_SEARCH_MAX_TOKENS
    # "fp16": everything outside the INT8 GEMMs in FP16, fused Triton kernels; "fp32": INT32 GEMM output and FP32
    # torch ops elsewhere, closest to the checkpoint's fake-quant model (FP16 rounding alone moves some logits), slower
    precision: str = "fp16"
    # how the FFN activation meets the next quantizer in FP16 (Encoder.use_code_tables): "on" a lookup of each FP16
    # value's code; "off" the fused erf kernel for exact GELU, torch ops otherwise; "auto" the table where no fused
    # kernel exists (ReLU, tanh GELU), the erf kernel for exact GELU (measured; the table for GELU is not yet)
    activation_table: str = "auto"
    # which INT8 GEMMs serve each (batch, seq) bucket (routing.py): "sparse" the 2:4 ones (cuSPARSELt);
    # "dense-int8" dense ones of the same INT8 codes (torch._int_mm); "auto" times both per token count at
    # load (holding both weight copies while it does; the dense ones are freed if no bucket takes them) and
    # serves each bucket on the faster, where the 2:4 GEMMs can lose at small token counts (opt-in until its GPU
    # test, tests/gpu/test_torch_cuda_routing.py, has passed on a GPU); None (not set): `kernel` for every bucket
    route: str | None = None
    route_max_tokens: int = ROUTE_MAX_TOKENS  # "auto" times token counts up to this; above, 2:4 untimed

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "TorchCudaOptions":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in names})


def _code_tables(models: list, wanted: bool, fused: bool) -> str:
    """Quantize the FFN activation by code table in every model where wanted and the probe allowed it;
    the note info() reports."""
    if not wanted:
        return "off"
    if not fused:
        return "off: the table kernel did not give the reference's codes on this device (see quantizer_probe)"
    try:
        for model in models:
            model.use_code_tables()
    except ValueError as e:
        return f"off: {e}"
    return "on"


def _kernel_counts(model) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, (QuantLinear, DenseLinear)):
            kinds[mod.kernel] = kinds.get(mod.kernel, 0) + 1
    return kinds


def _weight_mib(model) -> float:
    """The quantized Linears' weight memory (2:4 packed or dense INT8 codes), MiB."""
    total = sum(b.numel() * b.element_size() for mod in model.modules() if isinstance(mod, QuantLinear)
                for name, b in mod.named_buffers() if name in ("packed", "w_nk"))
    return round(total / 2**20, 3)


def _route(runner: GraphRunner, opts: TorchCudaOptions, kernel: str, dense: Encoder | None) -> dict[str, Any]:
    """Time the variants per token count and route the runner's buckets; info() fields."""
    bb, seqs = runner.batch_buckets, runner.seq_buckets
    if dense is None:
        why = {"sparse": "the 2:4 GEMMs for every bucket, as requested", "dense-int8":
               "dense INT8 GEMMs for every bucket, as requested"}.get(opts.route, f"kernel={kernel!r} for every bucket")
        if opts.route == "auto":
            why = (f"off: kernel={kernel!r} has no alternative to route to" if kernel != SPARSE else
                   "off: no 2:4 layer in this checkpoint" if opts.route_max_tokens else
                   "off: route_max_tokens=0 times nothing")
        return {"route": opts.route, "routes": {bucket_name(b, n): kernel for b in bb for n in seqs}, "route_note": why}
    t0 = time.perf_counter()
    plan = timing_plan(bb, seqs, opts.route_max_tokens)
    timings = measure_routes(runner, plan, {SPARSE: "", DENSE: DENSE}, cuda_event_timer(runner.device))
    routes = route_table(bb, seqs, timings)
    freed = apply_routes(runner, routes, {SPARSE: "", DENSE: DENSE})
    return {"route": "auto", "routes": routes,
            "route_ms": {bucket_name(*plan[t]): {"tokens": t, **ms} for t, ms in timings.items()},
            "route_note": f"per token count (batch x padded length) up to {opts.route_max_tokens}, median ms per "
                          f"call with CUDA events; dense INT8 where it is faster by more than {ROUTE_MARGIN:.0%}, "
                          "2:4 otherwise and above the timed counts"
                          + (f"; timed {len(timings)} of {len(plan)} counts within the budget"
                             if len(timings) < len(plan) else "")
                          + ("; the dense INT8 weights were freed: no bucket takes them" if freed else ""),
            "route_seconds": round(time.perf_counter() - t0, 2)}


def load(artifact: Artifact, **options: Any) -> TorchCudaBackend:
    """Load a checkpoint for 2:4 INT8 inference on the GPU (raises BackendUnavailable off-GPU);
    `options` are TorchCudaOptions' fields, others are ignored."""
    opts = TorchCudaOptions.from_options(options)
    precision, activation_table, quantizer, device = opts.precision, opts.activation_table, opts.quantizer, opts.device
    if precision not in PRECISIONS:
        raise HoloServeError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if activation_table not in ACTIVATION_TABLE:
        raise HoloServeError(f"activation_table must be one of {ACTIVATION_TABLE}, not {activation_table!r}")
    if opts.route is not None:
        check_route(opts.route, opts.kernel, opts.route_max_tokens)
    kernel = DENSE if opts.route == "dense-int8" else opts.kernel
    rep = require_cuda()
    if not artifact.quantized or not artifact.activation_amax():
        raise BackendUnavailable(
            f"{artifact.path}: backend 'torch-cuda' runs INT8 checkpoints with calibrated activation ranges; "
            "this one has none (compress it with quantization, or use --backend torch)"
        )
    if artifact.nm not in (None, (2, 4)):
        raise BackendUnavailable(f"{artifact.path}: cuSPARSELt runs 2:4 sparsity, not {artifact.nm}")
    t0 = time.perf_counter()
    epilogue, tried = (choose_epilogue(device, torch.float16 if precision == "fp16" else torch.float32)
                       if kernel == SPARSE else (None, []))
    quant_probe: dict[str, Any] = {"quantizer": quantizer}
    if quantizer == "auto":
        quantizer, quant_probe = choose_quantizer(device)
    fp16 = precision == "fp16"
    linear = LinearOptions(kernel=kernel, dtype=torch.float16 if fp16 else torch.float32, device=device,
                           tuning=Tuning(epilogue=epilogue, quantizer=quantizer, alg_search=opts.alg_search))
    fusion = Fusion(gelu_quant=fp16 and bool(quant_probe.get("gelu_fused")),
                    ln_quant=fp16 and bool(quant_probe.get("ln_fused")))
    # with route="auto", the same INT8 codes as dense GEMMs too (embeddings, LayerNorm, pooler, classifier held once)
    model, dense = build_variants(artifact, linear=linear, fusion=fusion,
                                  dense=opts.route == "auto" and kernel == SPARSE and opts.route_max_tokens > 0)
    kinds = _kernel_counts(model)
    wants_table = activation_table == "on" or (activation_table == "auto" and model.shape.act != "gelu")
    table_note = _code_tables([m for m in (model, dense) if m is not None],
                              fp16 and quantizer == "triton" and wants_table,
                              bool(quant_probe.get("table_fused")))
    limit = artifact.max_seq_length
    seqs = sorted({s for s in (opts.seq_buckets or DEFAULT_SEQ_BUCKETS) if s < limit}
                  | {int(math.ceil(limit / 16) * 16)})
    bb = [b for b in opts.batch_buckets if opts.max_batch is None or b <= opts.max_batch] or [1]
    runner = GraphRunner(model, device=device, batch_buckets=bb, seq_buckets=seqs, graphs=opts.graphs,
                         variants={DENSE: dense} if dense is not None else None)
    weights = {kernel: _weight_mib(model)} | ({DENSE: _weight_mib(dense)} if dense is not None else {})
    routing = _route(runner, opts, kernel, dense)
    extra = {"device": rep, "kernel": kernel, "precision": precision, "epilogue": epilogue.name if epilogue else None,
             "epilogue_probe": tried, "alg_search": opts.alg_search, "quantizer": quantizer,
             "gelu_quant_fused": model.gelu_quant,
             "activation_table": table_note,
             "ln_quant_fused": model.ln_quant, "quantizer_probe": quant_probe, "gemm_kernels": kinds,
             **routing, "weight_mib_at_load": weights, "load_seconds": round(time.perf_counter() - t0, 2)}
    return TorchCudaBackend(artifact, runner, extra)
