"""The torch-cuda backend: `load(artifact)` as the backend registry (holoserve.backends.base) calls it.

Checks the device, probes the cuSPARSELt epilogue and the fused quantizers (probe.py), builds the
encoder from the checkpoint (encoder.py) and serves it through per-bucket CUDA graphs (graphs.py).
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
from .encoder import Fusion, LinearOptions, encoder_from_artifact
from .graphs import GraphRunner
from .layers import DenseLinear, QuantLinear, Tuning
from .probe import choose_epilogue, choose_quantizer, require_cuda

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

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "TorchCudaOptions":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in names})


def load(artifact: Artifact, **options: Any) -> TorchCudaBackend:
    """Load a checkpoint for 2:4 INT8 inference on the GPU (raises BackendUnavailable off-GPU);
    `options` are TorchCudaOptions' fields, others are ignored."""
    opts = TorchCudaOptions.from_options(options)
    precision, activation_table, quantizer, device = opts.precision, opts.activation_table, opts.quantizer, opts.device
    kernel = opts.kernel
    if precision not in PRECISIONS:
        raise HoloServeError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if activation_table not in ACTIVATION_TABLE:
        raise HoloServeError(f"activation_table must be one of {ACTIVATION_TABLE}, not {activation_table!r}")
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
                       if kernel == "cslt" else (None, []))
    quant_probe: dict[str, Any] = {"quantizer": quantizer}
    if quantizer == "auto":
        quantizer, quant_probe = choose_quantizer(device)
    fp16 = precision == "fp16"
    linear = LinearOptions(kernel=kernel, dtype=torch.float16 if fp16 else torch.float32, device=device,
                           tuning=Tuning(epilogue=epilogue, quantizer=quantizer, alg_search=opts.alg_search))
    fusion = Fusion(gelu_quant=fp16 and bool(quant_probe.get("gelu_fused")),
                    ln_quant=fp16 and bool(quant_probe.get("ln_fused")))
    model = encoder_from_artifact(artifact, linear=linear, fusion=fusion)
    table_note = "off"
    wants_table = activation_table == "on" or (activation_table == "auto" and model.shape.act != "gelu")
    if fp16 and quantizer == "triton" and wants_table:
        if quant_probe.get("table_fused"):
            try:
                model.use_code_tables()
                table_note = "on"
            except ValueError as e:
                table_note = f"off: {e}"
        else:
            table_note = "off: the table kernel did not give the reference's codes on this device (see quantizer_probe)"
    limit = artifact.max_seq_length
    seqs = sorted({s for s in (opts.seq_buckets or DEFAULT_SEQ_BUCKETS) if s < limit}
                  | {int(math.ceil(limit / 16) * 16)})
    bb = [b for b in opts.batch_buckets if opts.max_batch is None or b <= opts.max_batch] or [1]
    runner = GraphRunner(model, device=device, batch_buckets=bb, seq_buckets=seqs, graphs=opts.graphs)
    kinds: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, (QuantLinear, DenseLinear)):
            kinds[mod.kernel] = kinds.get(mod.kernel, 0) + 1
    extra = {"device": rep, "kernel": kernel, "precision": precision, "epilogue": epilogue.name if epilogue else None,
             "epilogue_probe": tried, "alg_search": opts.alg_search, "quantizer": quantizer, "gelu_quant_fused": model.gelu_quant,
             "activation_table": table_note,
             "ln_quant_fused": model.ln_quant, "quantizer_probe": quant_probe, "gemm_kernels": kinds, "load_seconds": round(time.perf_counter() - t0, 2)}
    return TorchCudaBackend(artifact, runner, extra)
