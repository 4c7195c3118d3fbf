"""`torch-cuda`: 2:4 sparse INT8 inference on NVIDIA GPUs through PyTorch's cuSPARSELt ops.

For GPUs without TensorRT. Every sparse encoder Linear of a checkpoint runs as one 2:4
semi-structured INT8 GEMM (`torch._cslt_compress` / `torch._cslt_sparse_mm`, the ops behind
`torch.sparse.SparseSemiStructuredTensorCUSPARSELT`):

    codes_x = clamp(round_half_even(x / s_x), -128, 127)      s_x = amax["<layer>.input"] / 127
    y       = (codes_x @ codes_w^T) * (s_w[n] * s_x) + bias    int32 accumulation on the tensor cores

The per-output-channel factor `s_w[n] * s_x` is cuSPARSELt's alpha vector, so the dequantization
(and, where the library takes it, the bias) happens in the GEMM epilogue and the result comes out
in FP16. Everything else (embeddings, LayerNorm, attention, GELU, pooler, classifier) runs in FP16.
The activation quantizers are small Triton kernels fused with what precedes them (residual add +
LayerNorm, GELU) so that no FP16 intermediate is written just to be re-read and quantized; each
fused kernel is compared with the plain torch ops on the device at load time and used only if it
agrees. One CUDA graph is captured per (batch, sequence) bucket, so a request costs a few launches.

The encoder is a small BERT written here rather than the transformers module: its forward has no
data-dependent branches (which CUDA graph capture forbids) and Q/K/V share one GEMM when their
activation ranges agree (they quantize the same tensor). The same code runs an exact CPU
reference of the quantized math (`kernel="reference"`: int8 codes, exact integer accumulation,
dequantization), which the tests compare with the checkpoint's fake-quant model on machines
without a GPU.

Numerics follow compress/quant.py (activations) and compress/project.py (weights): the saved
weights are exactly int8 codes x per-channel scale, so the codes are recovered without loss.
"""
from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from .. import HoloServeError
from holoserve.core.artifact import Artifact, act_key
from .base import BackendUnavailable

try:  # torch is optional for the server; every entry point checks `_torch_or_raise()` first.
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - exercised only where torch is absent
    torch = None  # type: ignore[assignment]
    F = None  # type: ignore[assignment]

NAME = "torch-cuda"
ACT_QMIN, ACT_QMAX, ACT_SCALE_DIV = -128, 127, 127.0
WEIGHT_QMAX = 127
# cuSPARSELt INT8 limits as PyTorch states them (SparseSemiStructuredTensorCUSPARSELT): the sparse
# operand needs rows and columns that are multiples of 32; the dense operand multiples of 16.
CSLT_SPARSE_MULTIPLE = 32
CSLT_DENSE_MULTIPLE = 16
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_SEQ_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512)
KERNELS = ("cslt", "int_mm", "reference", "fakequant", "dense")
SUPPORTED_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


def _torch_or_raise():
    if torch is None:
        raise BackendUnavailable(
            "backend 'torch-cuda' needs PyTorch with CUDA: install a CUDA build of torch "
            "(e.g. pip install 'holoserve[compress]' on a GPU machine), or use --backend onnxruntime"
        )
    return torch


# --------------------------------------------------------------------------- quantized math


def quantize_activation(x: "torch.Tensor", scale: "torch.Tensor") -> "torch.Tensor":
    """int8 codes of `x` for a per-tensor scale: x / s in float32, round half to even, saturate.

    Same arithmetic as compress.quant.fake_quant_act (and ONNX QuantizeLinear) on float32 input.
    """
    q = torch.round(x.float() / scale)
    return torch.clamp_(q, ACT_QMIN, ACT_QMAX).to(torch.int8)


# One fused kernel for the activation quantizer: read FP16, write int8 codes (3 bytes per element
# instead of ~35 for the five separate torch ops: float, div, round, clamp, cast), which matters
# because every encoder GEMM input passes through it. Same arithmetic: IEEE division by the
# scale, saturation, then round half to even via the 1.5 * 2**23 trick (exact for |q| <= 2**22,
# and saturating first gives the same codes as rounding first).
_TRITON: dict[str, Any] = {}
QUANT_BLOCK = 2048


def _triton_quant_kernel():
    if "kernel" in _TRITON or "error" in _TRITON:
        return _TRITON.get("kernel")
    try:
        import triton
        import triton.language as tl

        # (a @triton.jit body sees module globals only, so tl.div_rn is named directly: IEEE division)
        @triton.jit
        def _quant(x_ptr, out_ptr, scale_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            q = tl.div_rn(x, tl.load(scale_ptr))
            q = tl.minimum(tl.maximum(q, -128.0), 127.0)
            q = (q + 12582912.0) - 12582912.0
            tl.store(out_ptr + offs, q.to(tl.int8), mask=m)

        @triton.jit
        def _gelu_quant(x_ptr, out_ptr, scale_ptr, n, BLOCK: tl.constexpr):
            # exact (erf) GELU of the FFN's first GEMM, quantized for the second: the FP16 GELU
            # output never goes to memory
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            g = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
            q = tl.div_rn(g, tl.load(scale_ptr))
            q = tl.minimum(tl.maximum(q, -128.0), 127.0)
            q = (q + 12582912.0) - 12582912.0
            tl.store(out_ptr + offs, q.to(tl.int8), mask=m)

        @triton.jit
        def _add_ln_quant(x_ptr, r_ptr, w_ptr, b_ptr, h_ptr, q_ptr, scale_ptr, H, eps,
                          HAS_RES: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
            # one row: h = LayerNorm(x + r) in FP16 (the residual stream) and, for the next GEMM,
            # the int8 codes of h; the same roundings as the separate torch ops (FP16 sum, FP16 h)
            row = tl.program_id(0).to(tl.int64)
            cols = tl.arange(0, BLOCK)
            m = cols < H
            x = tl.load(x_ptr + row * H + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_RES:
                x = (x + tl.load(r_ptr + row * H + cols, mask=m, other=0.0).to(tl.float32)).to(tl.float16).to(tl.float32)
            mean = tl.sum(x, axis=0) / H
            xc = tl.where(m, x - mean, 0.0)
            var = tl.sum(xc * xc, axis=0) / H
            rstd = 1.0 / tl.sqrt(var + eps)
            w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
            yh = (xc * rstd * w + b).to(tl.float16)
            tl.store(h_ptr + row * H + cols, yh, mask=m)
            if HAS_Q:
                q = tl.div_rn(yh.to(tl.float32), tl.load(scale_ptr))
                q = tl.minimum(tl.maximum(q, -128.0), 127.0)
                q = (q + 12582912.0) - 12582912.0
                tl.store(q_ptr + row * H + cols, q.to(tl.int8), mask=m)

        _TRITON["kernel"] = _quant
        _TRITON["gelu_kernel"] = _gelu_quant
        _TRITON["ln_kernel"] = _add_ln_quant
        _TRITON["next_pow2"] = triton.next_power_of_2
        _TRITON["cdiv"] = triton.cdiv
    except Exception as e:  # noqa: BLE001 - no triton (or an incompatible one): torch ops are used
        _TRITON["error"] = f"{type(e).__name__}: {e}"
    return _TRITON.get("kernel")


def quantize_activation_triton(x: "torch.Tensor", scale: "torch.Tensor", rows: int | None = None,
                               gelu: bool = False) -> "torch.Tensor":
    """quantize_activation (of GELU(x) with gelu=True) as one Triton kernel; `rows` >= x.shape[0]
    pads the result with zero rows."""
    if _triton_quant_kernel() is None:
        raise RuntimeError(f"triton is unavailable: {_TRITON.get('error')}")
    kernel = _TRITON["gelu_kernel" if gelu else "kernel"]
    x = x.contiguous()
    m, k = x.shape
    rows = rows or m
    out = torch.empty((rows, k), dtype=torch.int8, device=x.device)
    if rows > m:
        out[m:].zero_()
    n = m * k
    kernel[(_TRITON["cdiv"](n, QUANT_BLOCK),)](x, out, scale.reshape(1), n, BLOCK=QUANT_BLOCK)
    return out


def add_layer_norm_quant(x, res, weight, bias, eps: float, scale=None, rows: int | None = None):
    """(LayerNorm(x + res) as FP16 [T, H], its int8 codes [rows, H] or None) in one Triton kernel."""
    if _triton_quant_kernel() is None:
        raise RuntimeError(f"triton is unavailable: {_TRITON.get('error')}")
    hdim = x.shape[-1]
    x2 = x.reshape(-1, hdim).contiguous()
    r2 = res.reshape(-1, hdim).contiguous() if res is not None else x2
    t = x2.shape[0]
    h = torch.empty_like(x2)
    q = None
    if scale is not None:
        rows = rows or t
        q = torch.empty((rows, hdim), dtype=torch.int8, device=x.device)
        if rows > t:
            q[t:].zero_()
    _TRITON["ln_kernel"][(t,)](
        x2, r2, weight, bias, h, q if q is not None else h, scale.reshape(1) if scale is not None else weight,
        hdim, float(eps), HAS_RES=res is not None, HAS_Q=scale is not None, BLOCK=_TRITON["next_pow2"](hdim))
    return h, q


def choose_quantizer(device="cuda") -> tuple[str, dict[str, Any]]:
    """'triton' when its codes equal the torch reference on the device (ties included), else 'torch'."""
    g = torch.Generator(device="cpu").manual_seed(1)
    s = torch.tensor(0.05)
    ties = (torch.arange(-300, 300, dtype=torch.float32) + 0.5) * s  # exact .5 quotients and saturation
    x = torch.cat([ties, torch.randn(12296, generator=g) * 3]).reshape(-1, 32).to(device, torch.float16)
    want = quantize_activation(x, s.to(device))
    try:
        got = quantize_activation_triton(x, s.to(device))
        mism = int((got != want).sum())
        if mism:
            return "torch", {"quantizer": "torch", "triton_mismatches": mism}
        probe: dict[str, Any] = {"quantizer": "triton", "mismatches": 0}
    except Exception as e:  # noqa: BLE001
        return "torch", {"quantizer": "torch", "triton_error": f"{type(e).__name__}: {str(e)[:300]}"}
    # GELU + quantize: erf implementations may differ in the last bit, so allow rare +-1 codes
    try:
        want_g = quantize_activation(F.gelu(x.float()), s.to(device))
        got_g = quantize_activation_triton(x, s.to(device), gelu=True)
        diff = (got_g.int() - want_g.int()).abs()
        probe["gelu_mismatches"] = int((diff > 0).sum())
        probe["gelu_fused"] = bool(int(diff.max()) <= 1 and probe["gelu_mismatches"] <= max(1, diff.numel() // 1000))
    except Exception as e:  # noqa: BLE001
        probe["gelu_fused"] = False
        probe["gelu_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    # residual add + LayerNorm + quantize: FP16 output within a few FP16 ulps, codes within +-1, rarely
    try:
        hdim = 384
        xa = torch.randn(96, hdim, generator=g).to(device, torch.float16)
        xr = torch.randn(96, hdim, generator=g).to(device, torch.float16)
        w = (torch.rand(hdim, generator=g) + 0.5).to(device, torch.float16)
        bb = (torch.randn(hdim, generator=g) * 0.1).to(device, torch.float16)
        want_h = F.layer_norm(xa + xr, (hdim,), w, bb, 1e-12)
        want_q = quantize_activation(want_h, s.to(device))
        got_h, got_q = add_layer_norm_quant(xa, xr, w, bb, 1e-12, scale=s.to(device), rows=100)
        herr = float((got_h.float() - want_h.float()).abs().max())
        diff = (got_q[:96].int() - want_q.int()).abs()
        probe["ln_max_abs_err"] = herr
        probe["ln_code_mismatches"] = int((diff > 0).sum())
        probe["ln_fused"] = bool(herr <= 1e-2 and int(diff.max()) <= 1 and probe["ln_code_mismatches"] <= diff.numel() // 500
                                 and not got_q[96:].any())
    except Exception as e:  # noqa: BLE001
        probe["ln_fused"] = False
        probe["ln_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return "triton", probe


def weight_codes(w: "torch.Tensor", scales: "torch.Tensor") -> "torch.Tensor":
    """Recover the int8 codes of a weight stored as codes x per-channel scale (exact by contract)."""
    s = scales.float().reshape(-1, 1)
    return torch.clamp(torch.round(w.float() / s), -WEIGHT_QMAX, WEIGHT_QMAX).to(torch.int8)


def int8_linear_reference(
    x: "torch.Tensor", w_codes: "torch.Tensor", w_scales: "torch.Tensor", act_scale: "torch.Tensor",
    bias: "torch.Tensor | None" = None,
) -> "torch.Tensor":
    """The exact quantized Linear: int8 codes, integer accumulation, per-channel dequantization.

    Accumulation runs in float64, which is exact here (|sum| <= 128 * 127 * K < 2**53), so this is
    the integer result a tensor core produces; the epilogue is computed in float32.
    """
    shape = x.shape
    xq = quantize_activation(x.reshape(-1, shape[-1]), act_scale)
    acc = xq.double() @ w_codes.double().t()
    y = acc.float() * (w_scales.float() * act_scale.float())
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*shape[:-1], -1)


def pad_rows(x: "torch.Tensor", multiple: int) -> "torch.Tensor":
    extra = (-x.shape[0]) % multiple
    return F.pad(x, (0, 0, 0, extra)) if extra else x


# --------------------------------------------------------------------------- layers


# The ways the 2:4 INT8 GEMM's epilogue can be driven through torch._cslt_sparse_mm, best first.
# Which ones a given torch/cuSPARSELt build accepts (bias type with int8 in / fp16 out, alpha
# vectors with a transposed result) is checked numerically on the device at load time.
@dataclass(frozen=True)
class Epilogue:
    name: str
    alpha: bool  # per-channel dequant factor as cuSPARSELt's alpha vector (else int32 out, dequant after)
    bias: bool  # bias added inside the GEMM
    transpose: bool  # transpose_result=True: the result comes out [tokens, out_features] contiguous


EPILOGUES = (
    Epilogue("alpha+bias, fp16 out, transposed", True, True, True),
    Epilogue("alpha, fp16 out, transposed; bias after", True, False, True),
    Epilogue("alpha+bias, fp16 out", True, True, False),
    Epilogue("alpha, fp16 out; bias after", True, False, False),
    Epilogue("int32 out, transposed; dequant after", False, False, True),
    Epilogue("int32 out; dequant after", False, False, False),
)


class QuantLinear(torch.nn.Module if torch is not None else object):  # type: ignore[misc]
    """A Linear whose input is quantized per tensor and whose weight is int8 per output channel.

    kernel:  cslt       2:4 INT8 cuSPARSELt GEMM, dequant in the epilogue (CUDA)
             int_mm     dense INT8 torch._int_mm, dequant after (CUDA)
             reference  exact int math in float64 (any device; slow, for tests)
             fakequant  quantize-dequantize the input, float GEMM with the dequantized weight
             dense      plain float Linear with the dequantized weight, no activation quantization
    """

    def __init__(self, w_codes, w_scales, act_scale, bias, *, kernel: str, dtype, epilogue: Epilogue | None = None,
                 quantizer: str = "torch", alg_search: bool = False):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {KERNELS}")
        if quantizer not in ("torch", "triton"):
            raise ValueError(f"unknown quantizer {quantizer!r}")
        self.kernel = kernel
        self.quantizer = quantizer
        # cuSPARSELt algorithm per token count, found by its own search on the first call outside
        # a graph capture (the warm-up before each capture); 0 (the library default) otherwise
        self.alg_search = alg_search
        self.algs: dict[int, int] = {}
        self.out_features, self.in_features = w_codes.shape
        self.dtype = dtype
        self.epilogue = epilogue or EPILOGUES[0]
        dev = w_codes.device
        self.register_buffer("w_scales", w_scales.float().to(dev))
        self.register_buffer("act_scale", torch.as_tensor(act_scale, dtype=torch.float32, device=dev).reshape(()))
        self.register_buffer("alpha", (self.w_scales * self.act_scale).float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dev, dtype))
        # The bias handed to cuSPARSELt lives in a buffer twice as long as needed: if a library
        # build read it as float32 instead of the output type, the probe in choose_epilogue sees
        # wrong numbers instead of the GEMM reading past the end of an allocation.
        self.register_buffer("bias_gemm", None if bias is None else
                             torch.cat([self.bias, torch.zeros_like(self.bias)]))
        self.register_buffer("bias32", None if bias is None else bias.to(dev, torch.float32))
        if kernel == "cslt":
            self.register_buffer("packed", torch._cslt_compress(w_codes.contiguous()))
        elif kernel == "int_mm":
            self.register_buffer("w_t", w_codes.t().contiguous())  # _int_mm wants [K, N]
        elif kernel == "reference":
            self.register_buffer("w_codes", w_codes)
        else:
            self.register_buffer("weight", (w_codes.float() * self.w_scales.reshape(-1, 1)).to(dtype))

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kernel == "dense":
            return F.linear(x, self.weight, self.bias)
        if self.kernel == "fakequant":
            xq = quantize_activation(x2, self.act_scale).to(self.dtype) * self.act_scale.to(self.dtype)
            return F.linear(xq, self.weight, self.bias).reshape(*shape[:-1], -1)
        m = x2.shape[0]
        if self.quantizer == "triton":
            xq = quantize_activation_triton(x2, self.act_scale, rows=self.padded_rows(m))
        else:
            xq = pad_rows(quantize_activation(x2, self.act_scale), self.row_multiple)
        return self.from_codes(xq, m).reshape(*shape[:-1], -1)

    @property
    def row_multiple(self) -> int:
        # cuSPARSELt wants the dense operand's rows in multiples of 16; _int_mm wants more than 16 rows
        return {"cslt": CSLT_DENSE_MULTIPLE, "int_mm": 32}.get(self.kernel, 1)

    def padded_rows(self, m: int) -> int:
        return m + (-m) % self.row_multiple

    def from_codes(self, xq, m: int):
        """The GEMM and dequantization for int8 codes [padded rows, K]; returns [m, N] in self.dtype."""
        if self.kernel == "reference":  # exact integer accumulation (float64 is exact here), as int8_linear_reference
            acc = xq[:m].double() @ self.w_codes.double().t()
            y = acc.float() * self.alpha
            return (y + self.bias32 if self.bias32 is not None else y).to(self.dtype)
        if self.kernel == "int_mm":
            acc = torch._int_mm(xq, self.w_t)[:m]
            y = acc.float() * self.alpha
            y = (y + self.bias32 if self.bias32 is not None else y).to(self.dtype)
        else:
            y = self._cslt(xq)[:m]
        return y

    def _alg(self, xq, **kw) -> int:
        if not self.alg_search:
            return 0
        m = xq.shape[0]
        if m not in self.algs:
            if torch.cuda.is_current_stream_capturing():
                return 0
            self.algs[m] = int(torch._cslt_sparse_mm_search(self.packed, xq.t(), **kw))
        return self.algs[m]

    def _cslt(self, xq):
        e = self.epilogue
        if e.alpha and self.dtype != torch.float32:  # cuSPARSELt's INT8 GEMM writes FP16/BF16/INT32, not FP32
            kw = dict(bias=self.bias_gemm[: self.out_features] if (e.bias and self.bias is not None) else None,
                      alpha=self.alpha, out_dtype=self.dtype, transpose_result=e.transpose)
            y = torch._cslt_sparse_mm(self.packed, xq.t(), alg_id=self._alg(xq, **kw), **kw)
            y = y if e.transpose else y.t()
            if self.bias is not None and not e.bias:
                y = y + self.bias
            return y
        kw = dict(out_dtype=torch.int32, transpose_result=e.transpose)
        acc = torch._cslt_sparse_mm(self.packed, xq.t(), alg_id=self._alg(xq, **kw), **kw)
        acc = acc if e.transpose else acc.t()
        y = acc.float() * self.alpha
        return (y + self.bias32 if self.bias32 is not None else y).to(self.dtype)


# --------------------------------------------------------------------------- encoder


@dataclass
class BertShape:
    hidden: int
    heads: int
    layers: int
    intermediate: int
    act: str
    eps: float
    vocab: int
    max_positions: int
    type_vocab: int
    num_labels: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "BertShape":
        if cfg.get("model_type", "bert") != "bert":
            raise HoloServeError(
                f"backend 'torch-cuda' runs BERT models only; this checkpoint is {cfg.get('model_type')!r}: "
                "use --backend onnxruntime"
            )
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise HoloServeError("backend 'torch-cuda' supports absolute position embeddings only")
        act = cfg.get("hidden_act", "gelu")
        if act not in SUPPORTED_ACTS:
            raise HoloServeError(f"backend 'torch-cuda' does not implement hidden_act={act!r}")
        labels = cfg.get("id2label") or {}
        return cls(
            hidden=int(cfg["hidden_size"]), heads=int(cfg["num_attention_heads"]),
            layers=int(cfg["num_hidden_layers"]), intermediate=int(cfg["intermediate_size"]), act=act,
            eps=float(cfg.get("layer_norm_eps", 1e-12)), vocab=int(cfg["vocab_size"]),
            max_positions=int(cfg.get("max_position_embeddings", 512)), type_vocab=int(cfg.get("type_vocab_size", 2)),
            num_labels=int(cfg.get("num_labels", len(labels) or 2)),
        )


def _act(name: str):
    if name == "relu":
        return F.relu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    return F.gelu


class Encoder(torch.nn.Module if torch is not None else object):  # type: ignore[misc]
    """BertForSequenceClassification's inference forward with pluggable Linear kernels."""

    def __init__(self, shape: BertShape, state: Mapping[str, "torch.Tensor"], linears: Mapping[str, Any], *,
                 dtype, device, prefix: str = "bert."):
        super().__init__()
        self.shape = shape
        self.dtype = dtype
        self.act = _act(shape.act)
        self.gelu_quant = False  # fused GELU + quantize before the FFN's second GEMM (Triton quantizer only)
        self.ln_quant = False  # residual add + LayerNorm + next quantizer fused (Triton; see _forward_fused)
        p = prefix

        def t(name):
            return state[name].to(device=device, dtype=dtype)

        self.register_buffer("word_emb", t(f"{p}embeddings.word_embeddings.weight"))
        self.register_buffer("pos_emb", t(f"{p}embeddings.position_embeddings.weight"))
        self.register_buffer("type_emb", t(f"{p}embeddings.token_type_embeddings.weight"))
        self.emb_ln = (t(f"{p}embeddings.LayerNorm.weight"), t(f"{p}embeddings.LayerNorm.bias"))
        self.layers = torch.nn.ModuleList()
        self.lns: list[tuple] = []
        for i in range(shape.layers):
            lp = f"{p}encoder.layer.{i}."
            block = torch.nn.ModuleDict({
                "qkv": linears[f"{lp}attention.self.qkv"], "out": linears[f"{lp}attention.output.dense"],
                "ffn_in": linears[f"{lp}intermediate.dense"], "ffn_out": linears[f"{lp}output.dense"],
            })
            self.layers.append(block)
            self.lns.append(((t(f"{lp}attention.output.LayerNorm.weight"), t(f"{lp}attention.output.LayerNorm.bias")),
                             (t(f"{lp}output.LayerNorm.weight"), t(f"{lp}output.LayerNorm.bias"))))
        self.pooler = (t(f"{p}pooler.dense.weight"), t(f"{p}pooler.dense.bias")) if f"{p}pooler.dense.weight" in state else None
        self.classifier = (t("classifier.weight"), t("classifier.bias"))

    def _fusable(self) -> bool:
        def tq(mod):
            return isinstance(mod, QuantLinear) and mod.quantizer == "triton"

        return all(len(blk["qkv"].parts) == 1 and tq(blk["qkv"].parts[0]) and tq(blk["out"]) and tq(blk["ffn_in"])
                   and tq(blk["ffn_out"]) for blk in self.layers)

    def forward(self, input_ids, attention_mask, token_type_ids):
        if self.ln_quant:
            return self._forward_fused(input_ids, attention_mask, token_type_ids)
        s = self.shape
        b, n = input_ids.shape
        pos = torch.arange(n, device=input_ids.device)
        h = self.word_emb[input_ids] + self.pos_emb[pos].unsqueeze(0) + self.type_emb[token_type_ids]
        h = F.layer_norm(h, (s.hidden,), *self.emb_ln, s.eps)
        # additive mask: 0 where attended, the dtype's most negative value where padded
        mask = (1.0 - attention_mask[:, None, None, :].to(self.dtype)) * torch.finfo(self.dtype).min
        d = s.hidden // s.heads
        for block, (ln1, ln2) in zip(self.layers, self.lns):
            qkv = block["qkv"](h)
            q, k, v = qkv.view(b, n, 3, s.heads, d).permute(2, 0, 3, 1, 4).unbind(0)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            ctx = ctx.transpose(1, 2).reshape(b, n, s.hidden)
            h = F.layer_norm(block["out"](ctx) + h, (s.hidden,), *ln1, s.eps)
            ffn_out = block["ffn_out"]
            if self.gelu_quant and isinstance(ffn_out, QuantLinear) and ffn_out.quantizer == "triton":
                y = block["ffn_in"](h).reshape(b * n, -1)
                xq = quantize_activation_triton(y, ffn_out.act_scale, rows=ffn_out.padded_rows(b * n), gelu=True)
                out = ffn_out.from_codes(xq, b * n).reshape(b, n, -1)
            else:
                out = ffn_out(self.act(block["ffn_in"](h)))
            h = F.layer_norm(out + h, (s.hidden,), *ln2, s.eps)
        cls = h[:, 0]
        if self.pooler is not None:
            cls = torch.tanh(F.linear(cls, *self.pooler))
        return F.linear(cls, *self.classifier).float()


    def _forward_fused(self, input_ids, attention_mask, token_type_ids):
        """The same forward with every LayerNorm fused with the residual add and the next GEMM's
        quantizer, and GELU fused with the FFN's second quantizer (Triton kernels)."""
        s = self.shape
        b, n = input_ids.shape
        t = b * n
        pos = torch.arange(n, device=input_ids.device)
        emb = self.word_emb[input_ids] + self.pos_emb[pos].unsqueeze(0) + self.type_emb[token_type_ids]
        first = self.layers[0]["qkv"].parts[0]
        h, hq = add_layer_norm_quant(emb, None, *self.emb_ln, s.eps, scale=first.act_scale, rows=first.padded_rows(t))
        mask = (1.0 - attention_mask[:, None, None, :].to(self.dtype)) * torch.finfo(self.dtype).min
        d = s.hidden // s.heads
        for i, (block, (ln1, ln2)) in enumerate(zip(self.layers, self.lns)):
            qkv = block["qkv"].parts[0].from_codes(hq, t)
            q, k, v = qkv.view(b, n, 3, s.heads, d).permute(2, 0, 3, 1, 4).unbind(0)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            y = block["out"](ctx.transpose(1, 2).reshape(t, s.hidden))
            ffn_in, ffn_out = block["ffn_in"], block["ffn_out"]
            h, hq = add_layer_norm_quant(y, h, *ln1, s.eps, scale=ffn_in.act_scale, rows=ffn_in.padded_rows(t))
            inter = ffn_in.from_codes(hq, t)
            if self.gelu_quant:
                xq = quantize_activation_triton(inter, ffn_out.act_scale, rows=ffn_out.padded_rows(t), gelu=True)
            else:
                xq = quantize_activation_triton(self.act(inter), ffn_out.act_scale, rows=ffn_out.padded_rows(t))
            y = ffn_out.from_codes(xq, t)
            nxt = self.layers[i + 1]["qkv"].parts[0] if i + 1 < len(self.layers) else None
            h, hq = add_layer_norm_quant(y, h, *ln2, s.eps, scale=nxt.act_scale if nxt is not None else None,
                                         rows=nxt.padded_rows(t) if nxt is not None else None)
        cls = h.view(b, n, s.hidden)[:, 0]
        if self.pooler is not None:
            cls = torch.tanh(F.linear(cls, *self.pooler))
        return F.linear(cls, *self.classifier).float()


class _FusedQKV(torch.nn.Module if torch is not None else object):  # type: ignore[misc]
    """Three Linears of one input run as one GEMM when they share an activation scale, else three."""

    def __init__(self, parts):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x):
        if len(self.parts) == 1:
            return self.parts[0](x)
        return torch.cat([p(x) for p in self.parts], dim=-1)


class DenseLinear(torch.nn.Module if torch is not None else object):  # type: ignore[misc]
    """A float Linear (FP16 on the GPU): layers that stay dense, and the dense baselines."""

    kernel = "dense"

    def __init__(self, weight, bias, *, dtype):
        super().__init__()
        self.register_buffer("weight", weight.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(weight.device, dtype))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def make_linear(weight, bias, *, scales=None, act_amax: float | None = None, sparse: bool = False,
                kernel: str = "cslt", dtype=None, device="cpu", epilogue: Epilogue | None = None,
                quantizer: str = "torch", alg_search: bool = False):
    """One Linear of the encoder. Quantized layers (scales and an activation range) use `kernel`;
    with kernel="cslt" a quantized layer that is not 2:4 falls back to dense INT8 (`int_mm`)."""
    dtype = dtype or torch.float16
    if scales is not None:
        scales = torch.as_tensor(np.asarray(scales, dtype=np.float32))
        codes = weight_codes(weight, scales)
        if kernel != "dense" and act_amax is not None:
            k = "int_mm" if (kernel == "cslt" and not sparse) else kernel
            return QuantLinear(codes.to(device), scales.to(device), float(act_amax) / ACT_SCALE_DIV, bias,
                               kernel=k, dtype=dtype, epilogue=epilogue,
                               quantizer=quantizer if k in ("cslt", "int_mm", "reference") else "torch",
                               alg_search=alg_search)
        weight = codes.float() * scales.reshape(-1, 1)  # the exact dequantized weight
    return DenseLinear(weight.float().to(device), bias, dtype=dtype)


def build_encoder(
    config: Mapping[str, Any],
    state: Mapping[str, "torch.Tensor"],
    *,
    weight_scales: Mapping[str, Any] | None,
    act_amax: Mapping[str, float] | None,
    sparse_layers: Iterable[str] = (),
    kernel: str = "cslt",
    dtype=None,
    device="cpu",
    epilogue: Epilogue | None = None,
    fuse_qkv: bool = True,
    quantizer: str = "torch",
    alg_search: bool = False,
    gelu_quant: bool = False,
    ln_quant: bool = False,
) -> "Encoder":
    """An Encoder for a BERT state dict (transformers names) and the checkpoint's quantization.

    `kernel` is used for every quantized layer (see QuantLinear); layers without INT8 scales and an
    activation range, and every layer with kernel="dense", run as float Linears.
    """
    _torch_or_raise()
    dtype = dtype or torch.float16
    shape = BertShape.from_config(config)
    prefix = "bert." if any(k.startswith("bert.") for k in state) else ""
    weight_scales = dict(weight_scales or {})
    act_amax = dict(act_amax or {})
    sparse = set(sparse_layers)
    kw = dict(kernel=kernel, dtype=dtype, device=device, epilogue=epilogue, quantizer=quantizer, alg_search=alg_search)

    def single(name: str):
        return make_linear(state[f"{name}.weight"], state.get(f"{name}.bias"), scales=weight_scales.get(name),
                           act_amax=act_amax.get(act_key(name)), sparse=name in sparse, **kw)

    linears: dict[str, Any] = {}
    for i in range(shape.layers):
        lp = f"{prefix}encoder.layer.{i}."
        names = [f"{lp}attention.self.{x}" for x in ("query", "key", "value")]
        amaxes = {act_amax.get(act_key(n)) for n in names}
        quant = {n in weight_scales for n in names}
        sp = {n in sparse for n in names}
        if fuse_qkv and len(amaxes) == 1 and len(quant) == 1 and len(sp) == 1:
            # Q, K and V read the same tensor: with one activation scale they are one GEMM.
            w = torch.cat([state[f"{n}.weight"] for n in names])
            b = torch.cat([state[f"{n}.bias"] for n in names])
            scales = np.concatenate([np.asarray(weight_scales[n], dtype=np.float32) for n in names]) \
                if quant == {True} else None
            qkv = _FusedQKV([make_linear(w, b, scales=scales, act_amax=amaxes.pop(), sparse=sp == {True}, **kw)])
        else:
            qkv = _FusedQKV([single(n) for n in names])
        linears[f"{lp}attention.self.qkv"] = qkv
        for n in ("attention.output.dense", "intermediate.dense", "output.dense"):
            linears[lp + n] = single(lp + n)
    enc = Encoder(shape, state, linears, dtype=dtype, device=device, prefix=prefix).eval()
    enc.gelu_quant = bool(gelu_quant and quantizer == "triton" and shape.act == "gelu")
    enc.ln_quant = bool(ln_quant and quantizer == "triton" and enc._fusable())
    return enc


def checkpoint_tensors(art: Artifact) -> tuple[dict[str, Any], dict[str, "torch.Tensor"]]:
    """config.json and model.safetensors of a checkpoint, as (config dict, CPU tensors)."""
    from safetensors.torch import load_file

    config = json.loads((art.path / "config.json").read_text(encoding="utf-8"))
    return config, load_file(str(art.path / "model.safetensors"), device="cpu")


def encoder_from_artifact(art: Artifact, *, kernel: str = "cslt", dtype=None, device="cpu",
                          epilogue: Epilogue | None = None, quantizer: str = "torch",
                          alg_search: bool = False, gelu_quant: bool = False, ln_quant: bool = False) -> "Encoder":
    config, state = checkpoint_tensors(art)
    q = art.manifest.get("quantization") or {}
    scales = (q.get("weights") or {}).get("scales") or {}
    return build_encoder(config, state, weight_scales=scales, act_amax=art.activation_amax(),
                         sparse_layers=art.sparse_layers if art.nm == (2, 4) else (), kernel=kernel,
                         dtype=dtype, device=device, epilogue=epilogue, quantizer=quantizer, alg_search=alg_search,
                         gelu_quant=gelu_quant, ln_quant=ln_quant)


# --------------------------------------------------------------------------- device checks


def cuda_report() -> dict[str, Any]:
    """What this machine offers for the backend (no exceptions; strings where something is missing)."""
    if torch is None:
        return {"torch": None, "cuda": False, "reason": "PyTorch is not installed"}
    out: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda}
    try:
        import torch.backends.cusparselt as cslt

        out["cusparselt"] = cslt.version() if cslt.is_available() else None
    except Exception as e:  # noqa: BLE001 - report, never fail
        out["cusparselt"] = None
        out["cusparselt_error"] = str(e)
    out["cuda"] = bool(torch.cuda.is_available())
    if out["cuda"]:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
    return out


def require_cuda() -> dict[str, Any]:
    _torch_or_raise()
    rep = cuda_report()
    if not rep["cuda"]:
        build = "a CPU-only build" if not torch.version.cuda else f"a CUDA {torch.version.cuda} build"
        raise BackendUnavailable(
            f"backend 'torch-cuda' needs an NVIDIA GPU, but torch {torch.__version__} ({build}) sees no CUDA device "
            "here; use --backend onnxruntime (CPU) or run on a GPU machine"
        )
    major = int(rep["capability"].split(".")[0])
    if major < 8:
        raise BackendUnavailable(
            f"backend 'torch-cuda' needs sparse tensor cores (compute capability 8.0+, Ampere or newer); "
            f"{rep['gpu']} is {rep['capability']}"
        )
    if not rep.get("cusparselt"):
        raise BackendUnavailable(
            f"backend 'torch-cuda' needs cuSPARSELt, which torch {torch.__version__} does not provide here "
            "(torch.backends.cusparselt.is_available() is False); install a torch build with cuSPARSELt"
        )
    return rep


def choose_epilogue(device="cuda", dtype=None) -> tuple[Epilogue, list[dict[str, Any]]]:
    """Try each epilogue on a small 2:4 INT8 GEMM against the exact reference; first that matches wins."""
    dtype = dtype or torch.float16
    g = torch.Generator(device="cpu").manual_seed(0)
    n, k, m = 64, 128, 48
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int32)
    mask = torch.zeros(n, k // 4, 4, dtype=torch.bool)
    idx = torch.rand(n, k // 4, 4, generator=g).topk(2, dim=-1).indices
    mask.scatter_(-1, idx, True)
    codes = (codes * mask.reshape(n, k)).to(torch.int8)
    scales = torch.rand(n, generator=g) * 0.01 + 1e-3
    bias = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g) * 2
    act = torch.tensor(4.0 / 127)
    want = int8_linear_reference(x, codes, scales, act, bias)
    tried = []
    # FP32 output is not on cuSPARSELt's INT8 menu: that precision takes INT32 and dequantizes after
    for e in (EPILOGUES if dtype != torch.float32 else [e for e in EPILOGUES if not e.alpha]):
        try:
            lin = QuantLinear(codes.to(device), scales.to(device), act, bias, kernel="cslt", dtype=dtype, epilogue=e)
            got = lin(x.to(device, dtype)).float().cpu()
            torch.cuda.synchronize()
            err = float((got - want).abs().max() / want.abs().max())
            ok = bool(torch.isfinite(got).all()) and err < 2e-2
            tried.append({"epilogue": e.name, "ok": ok, "rel_err": err})
            if ok:
                return e, tried
        except Exception as exc:  # noqa: BLE001 - an unsupported combination raises; try the next
            tried.append({"epilogue": e.name, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    raise BackendUnavailable(f"no cuSPARSELt INT8 epilogue worked on this GPU: {tried}")


# --------------------------------------------------------------------------- CUDA graphs


def _bucket(value: int, buckets: Iterable[int]) -> int:
    for b in sorted(buckets):
        if value <= b:
            return b
    raise ValueError(value)


class GraphRunner:
    """Replays one captured CUDA graph per (batch, seq) bucket; inputs are padded into static buffers."""

    def __init__(self, model, *, device, batch_buckets, seq_buckets, vocab_pad_id: int = 0, graphs: bool = True):
        self.model = model
        self.device = device
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.seq_buckets = tuple(sorted(seq_buckets))
        self.pad_id = vocab_pad_id
        self.graphs = graphs
        self._graphs: dict[tuple[int, int], tuple[Any, dict[str, Any], Any]] = {}
        self._pool = None
        self._lock = threading.Lock()
        self.capture_seconds: dict[str, float] = {}
        self.graph_error: str | None = None

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    def buckets_for(self, batch: int, seq: int) -> tuple[int, int]:
        return _bucket(batch, self.batch_buckets), _bucket(seq, self.seq_buckets)

    def _static(self, b: int, n: int):
        ids = torch.full((b, n), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((b, n), dtype=torch.long, device=self.device)
        mask[:, 0] = 1
        tt = torch.zeros((b, n), dtype=torch.long, device=self.device)
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": tt}

    def _capture(self, b: int, n: int):
        t0 = time.perf_counter()
        static = self._static(b, n)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up outside capture (cuSPARSELt/cuBLAS workspaces, SDPA choice)
                self.model(**static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            out = self.model(**static)
        torch.cuda.synchronize(self.device)
        self.capture_seconds[f"{b}x{n}"] = round(time.perf_counter() - t0, 3)
        return graph, static, out

    def run_bucket(self, input_ids, attention_mask, token_type_ids):
        """Run torch int64 tensors (already on the device, shape [b, n] within the largest bucket)."""
        b, n = input_ids.shape
        bb, nb = self.buckets_for(b, n)
        if not self.graphs:
            static = self._static(bb, nb)
            self._fill(static, input_ids, attention_mask, token_type_ids)
            with torch.inference_mode():
                return self.model(**static)[:b]
        with self._lock:
            entry = self._graphs.get((bb, nb))
            if entry is None:
                try:
                    entry = self._graphs[(bb, nb)] = self._capture(bb, nb)
                except Exception as e:  # noqa: BLE001 - a capture failure must not take the backend down
                    self.graphs = False
                    self.graph_error = f"{type(e).__name__}: {e}"
                    torch.cuda.synchronize(self.device)
                    return self.run_bucket(input_ids, attention_mask, token_type_ids)
            graph, static, out = entry
            self._fill(static, input_ids, attention_mask, token_type_ids)
            graph.replay()
            return out[:b].clone()

    @staticmethod
    def _fill(static, input_ids, attention_mask, token_type_ids):
        b, n = input_ids.shape
        for key, src in (("input_ids", input_ids), ("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            dst = static[key]
            if dst.shape != src.shape:
                dst.zero_()
                if key == "attention_mask":
                    dst[:, 0] = 1  # padded rows attend to one position: finite, and discarded
            dst[:b, :n].copy_(src, non_blocking=True)


# --------------------------------------------------------------------------- backend


@dataclass
class TorchCudaBackend:
    artifact: Artifact
    runner: GraphRunner
    info_extra: dict[str, Any] = field(default_factory=dict)
    name: str = NAME

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


PRECISIONS = ("fp16", "fp32")


def load(artifact: Artifact, *, device: str = "cuda", graphs: bool = True, kernel: str = "cslt",
         batch_buckets: Iterable[int] = DEFAULT_BATCH_BUCKETS, seq_buckets: Iterable[int] | None = None,
         max_batch: int | None = None, quantizer: str = "auto", alg_search: bool = False,
         precision: str = "fp16", **_ignored: Any) -> TorchCudaBackend:
    """Load a checkpoint for 2:4 INT8 inference on the GPU (raises BackendUnavailable off-GPU).

    precision="fp16" (default): everything outside the INT8 GEMMs in FP16, fused Triton kernels.
    precision="fp32": the GEMMs write INT32 and everything else runs in FP32 with the torch ops,
    for numerics closest to the checkpoint's fake-quant model (a quantized network turns 1-ulp
    differences into whole-step code changes, so FP16 rounding alone moves some logits), slower.
    """
    if precision not in PRECISIONS:
        raise HoloServeError(f"precision must be one of {PRECISIONS}, not {precision!r}")
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
    model = encoder_from_artifact(artifact, kernel=kernel, dtype=torch.float16 if fp16 else torch.float32,
                                  device=device, epilogue=epilogue, quantizer=quantizer, alg_search=alg_search,
                                  gelu_quant=fp16 and bool(quant_probe.get("gelu_fused")),
                                  ln_quant=fp16 and bool(quant_probe.get("ln_fused")))
    limit = artifact.max_seq_length
    seqs = sorted({s for s in (seq_buckets or DEFAULT_SEQ_BUCKETS) if s < limit} | {int(math.ceil(limit / 16) * 16)})
    bb = [b for b in batch_buckets if max_batch is None or b <= max_batch] or [1]
    runner = GraphRunner(model, device=device, batch_buckets=bb, seq_buckets=seqs, graphs=graphs)
    kinds: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, (QuantLinear, DenseLinear)):
            kinds[mod.kernel] = kinds.get(mod.kernel, 0) + 1
    extra = {"device": rep, "kernel": kernel, "precision": precision, "epilogue": epilogue.name if epilogue else None,
             "epilogue_probe": tried, "alg_search": alg_search, "quantizer": quantizer, "gelu_quant_fused": model.gelu_quant,
             "ln_quant_fused": model.ln_quant, "quantizer_probe": quant_probe, "gemm_kernels": kinds, "load_seconds": round(time.perf_counter() - t0, 2)}
    return TorchCudaBackend(artifact, runner, extra)
