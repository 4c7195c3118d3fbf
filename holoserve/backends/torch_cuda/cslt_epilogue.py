"""2:4 INT8 GEMMs with their whole epilogue inside cuSPARSELt, called directly (nvmath-python's bindings).

`torch._cslt_sparse_mm` exposes the alpha vector and the bias of cuSPARSELt's epilogue, not its activation
or an INT8 result with a scale of our choosing. `FusedGemm` builds the cuSPARSELt objects itself:

    D[n, t] = convert( act( alpha[n] * sum_k A[n, k] * B[k, t] + bias[n] ) * post )      (fp32 epilogue)

with A the 2:4 weight codes (the sparse operand, compressed once at load), B the activation codes, alpha the
per-output-channel dequantization factor s_w[n] * s_x (CUSPARSELT_MATMUL_ALPHA_VECTOR_SCALING), bias through
CUSPARSELT_MATMUL_BIAS_POINTER, act the optional GELU (CUSPARSELT_MATMUL_ACTIVATION_GELU), and convert the
rounding to FP16, or to INT8 with the next layer's quantization folded in:
  - with GELU, post = 1 / s_next (CUSPARSELT_MATMUL_ACTIVATION_GELU_SCALING), so D holds the codes the FFN's
    second GEMM reads: the GELU and the quantizer kernels disappear;
  - without an activation, alpha and bias are divided by s_next instead (the map is linear).
INT8 conversion is modelled as round half to even, then saturation to [-128, 127] (the tensor-core epilogues'
float-to-int8 conversion).

Where this differs from the unfused torch path (int8 GEMM, FP16 output, GELU of the FP16 value, quantize by
division): the pre-activation is not rounded to FP16, the library's GELU may be the tanh approximation, and
1 / s_next is a multiplication. `epilogue_reference` computes what the fused epilogue is modelled to compute,
in torch on any device; the GPU test (tests/gpu/test_cslt_epilogue.py) compares the library with it and
with the unfused path, code for code, and reports which GELU and where its scaling apply.

Layouts are those of layers.QuantLinear's `torch._cslt_sparse_mm(packed, xq.t(), transpose_result=True)`:
A is the weight [N, K] row-major; B is the codes [T, K] row-major described as [T, K] with opB = transpose;
D is [N, T] column-major (ld = N), i.e. [T, N] row-major in memory, what the next op reads.

Every library call goes through `api`, an object with the function names of `nvmath.bindings.cusparseLt`
(the default); the unit tests pass a recorder that checks each call against cusparseLt.h's enums and the
documented attribute types, in a valid order, without a GPU.
"""
from __future__ import annotations

import contextlib
import copy
import enum
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ._torch import F, torch

# -- the cusparseLt.h / library_types.h / cusparse.h values passed to the library --------------------------
# Checked against the header (when present), nvmath-python's enums and the committed copy of the header's
# values (tests/unit/backends/test_cslt_epilogue.py).
CUDA_R_32F, CUDA_R_16F, CUDA_R_8I, CUDA_R_32I, CUDA_R_16BF = 0, 2, 3, 10, 14  # cudaDataType
ORDER_COL, ORDER_ROW = 1, 2  # cusparseOrder_t
OP_NON_TRANSPOSE, OP_TRANSPOSE = 0, 1  # cusparseOperation_t
COMPUTE_32I = 0  # cusparseComputeType: int32 accumulation, fp32 alpha/beta and epilogue
SPARSITY_50_PERCENT = 0  # cusparseLtSparsity_t: 2:4 for int8
MATMUL_ALG_DEFAULT = 0  # cusparseLtMatmulAlg_t
ALIGNMENT = 16  # bytes; torch's cuSPARSELt ops use the same
HANDLE_BYTES = 512  # sizeof of every opaque cusparseLt struct (alignas(16)); nvmath allocates them


class MatmulAttr(enum.IntEnum):
    """cusparseLtMatmulDescAttribute_t (the members this module sets)."""

    ACTIVATION_GELU = 3
    ACTIVATION_GELU_SCALING = 4
    ALPHA_VECTOR_SCALING = 5
    BIAS_POINTER = 8


class AlgAttr(enum.IntEnum):
    """cusparseLtMatmulAlgAttribute_t (the members this module sets or reads)."""

    CONFIG_ID = 0
    CONFIG_MAX_ID = 1


# The C type of each attribute's value, as cuSPARSELt documents it (and nvmath's get_*_attribute_dtype say)
ATTR_DTYPES = {MatmulAttr.ACTIVATION_GELU: np.int32, MatmulAttr.ACTIVATION_GELU_SCALING: np.float32,
               MatmulAttr.ALPHA_VECTOR_SCALING: np.int32, MatmulAttr.BIAS_POINTER: np.int64}
ALG_ATTR_DTYPES = {AlgAttr.CONFIG_ID: np.int32, AlgAttr.CONFIG_MAX_ID: np.int32}

OUT_TYPES = {"fp16": CUDA_R_16F, "bf16": CUDA_R_16BF, "int8": CUDA_R_8I}
# The bias vector's type: the output's for 16-bit outputs, fp32 for an INT8 output
BIAS_TYPES = {"fp16": CUDA_R_16F, "bf16": CUDA_R_16BF, "int8": CUDA_R_32F}
GELU_KINDS = ("erf", "tanh")  # what the library's GELU may be; the GPU test says which


@dataclass(frozen=True)
class EpilogueSpec:
    """What one GEMM's epilogue does: its output type, and for an INT8 output the next quantizer's scale
    (folded in) and whether GELU comes first."""

    out: str = "fp16"  # "fp16", "bf16" or "int8"
    gelu: bool = False
    next_scale: float | None = None  # s_next of the layer that reads the INT8 output

    def __post_init__(self):
        if self.out not in OUT_TYPES:
            raise ValueError(f"unknown output {self.out!r}; choose one of {tuple(OUT_TYPES)}")
        if (self.out == "int8") != (self.next_scale is not None):
            raise ValueError("an INT8 output needs next_scale (the next layer's activation scale), and only it")
        if self.next_scale is not None and not (math.isfinite(self.next_scale) and self.next_scale > 0):
            raise ValueError(f"next_scale must be a positive finite number, got {self.next_scale}")


# The BERT encoder's Linears: which epilogue each takes (the FFN's first Linear writes the codes of GELU(y)
# for the second; the others feed attention or residual + LayerNorm, which read FP16)
LINEAR_KINDS = ("qkv", "attn_out", "ffn_in", "ffn_out")


def spec_for(kind: str, *, dtype: str = "fp16", next_scale: float | None = None, gelu: bool = True) -> EpilogueSpec:
    """The epilogue of one Linear kind; `ffn_in` writes INT8 codes when the next scale is given."""
    if kind not in LINEAR_KINDS:
        raise ValueError(f"unknown Linear kind {kind!r}; choose one of {LINEAR_KINDS}")
    if kind == "ffn_in" and next_scale is not None:
        return EpilogueSpec(out="int8", gelu=gelu, next_scale=float(next_scale))
    return EpilogueSpec(out=dtype)


def epilogue_vectors(spec: EpilogueSpec, alpha: "torch.Tensor", bias: "torch.Tensor | None"):
    """(alpha fp32 [N], bias in the epilogue's bias type or None, post scale or None) as the library takes them.

    Without GELU an INT8 output folds 1 / s_next into alpha and bias (in float32); with GELU the scale stays
    for after the activation (GELU_SCALING)."""
    alpha = alpha.float()
    bias32 = None if bias is None else bias.float()
    post = None
    if spec.out == "int8":
        inv = float(np.float32(1.0) / np.float32(spec.next_scale))
        if spec.gelu:
            post = inv
        else:
            alpha = alpha * inv
            bias32 = None if bias32 is None else bias32 * inv
    bias_t = None
    if bias32 is not None:
        bias_t = bias32.to({CUDA_R_32F: torch.float32, CUDA_R_16F: torch.float16,
                            CUDA_R_16BF: torch.bfloat16}[BIAS_TYPES[spec.out]])
    return alpha.contiguous(), bias_t, post


def matmul_attributes(spec: EpilogueSpec, bias_ptr: int | None, post: float | None) -> list[tuple[MatmulAttr, Any]]:
    """The matmul-descriptor attributes to set, in order, as (attribute, value): alpha vector on, the bias
    pointer, GELU and its output scaling."""
    attrs: list[tuple[MatmulAttr, Any]] = [(MatmulAttr.ALPHA_VECTOR_SCALING, 1)]
    if bias_ptr is not None:
        attrs.append((MatmulAttr.BIAS_POINTER, int(bias_ptr)))
    if spec.gelu:
        attrs.append((MatmulAttr.ACTIVATION_GELU, 1))
        if post is not None:
            attrs.append((MatmulAttr.ACTIVATION_GELU_SCALING, float(post)))
    return attrs


def gelu(x: "torch.Tensor", kind: str) -> "torch.Tensor":
    if kind not in GELU_KINDS:
        raise ValueError(f"unknown GELU {kind!r}; choose one of {GELU_KINDS}")
    return F.gelu(x, approximate="tanh" if kind == "tanh" else "none")


def epilogue_reference(acc: "torch.Tensor", spec: EpilogueSpec, alpha: "torch.Tensor",
                       bias: "torch.Tensor | None" = None, *, gelu_kind: str = "erf",
                       scale_gelu_input: bool = False) -> "torch.Tensor":
    """What the fused epilogue computes from the int32 accumulators acc [T, N], in float32 on acc's device:
    alpha[n] * acc + bias[n] (alpha and bias as `epilogue_vectors` makes them), GELU, the post scale
    (on GELU's output; on its input with scale_gelu_input, the other reading of GELU_SCALING), then FP16
    (round to nearest) or INT8 (round half to even, saturate)."""
    a, b, post = epilogue_vectors(spec, alpha.to(acc.device), None if bias is None else bias.to(acc.device))
    v = acc.float() * a
    if b is not None:
        v = v + b.float()
    if spec.gelu:
        if post is not None and scale_gelu_input:
            v = gelu(v * post, gelu_kind)
        else:
            v = gelu(v, gelu_kind) * (post if post is not None else 1.0)
    if spec.out == "int8":
        return torch.clamp(torch.round(v), -128, 127).to(torch.int8)
    return v.to(torch.float16 if spec.out == "fp16" else torch.bfloat16)


def unfused_reference(acc: "torch.Tensor", spec: EpilogueSpec, alpha: "torch.Tensor",
                      bias: "torch.Tensor | None" = None) -> "torch.Tensor":
    """The unfused torch path from the same accumulators: float32 dequantization + bias, FP16 result; for an
    INT8 spec then the exact (erf) GELU of that FP16 value in float32 and the quantizer (division, round half
    to even, saturate), as the Triton GELU quantizer and its code table compute."""
    from .numerics import dequantize, quantize_activation

    y = dequantize(acc, alpha.float().to(acc.device), None if bias is None else bias.float().to(acc.device))
    if spec.out != "int8":
        return y.to(torch.float16 if spec.out == "fp16" else torch.bfloat16)
    y = y.to(torch.float16).float()
    if spec.gelu:
        y = F.gelu(y)
    return quantize_activation(y, torch.tensor(spec.next_scale, dtype=torch.float32, device=acc.device))


# -- the library calls ---------------------------------------------------------------------------------------

_API: dict[str, Any] = {}


def default_api():
    """nvmath-python's cuSPARSELt bindings (pip install 'holoserve[gpu]'), or the api `use_api` set."""
    if "api" not in _API:
        try:
            from nvmath.bindings import cusparseLt
        except ImportError as e:
            raise RuntimeError("kernel 'cslt_fused' needs nvmath-python (pip install 'holoserve[gpu]'): "
                               f"{type(e).__name__}: {e}") from e
        _API["api"] = cusparseLt
    return _API["api"]


@contextlib.contextmanager
def use_api(api):
    """Route every FusedGemm built inside the block through `api` (tests: a recorder instead of the GPU)."""
    old = _API.get("api")
    _API["api"] = api
    try:
        yield api
    finally:
        if old is None:
            _API.pop("api", None)
        else:
            _API["api"] = old


_HANDLES: "weakref.WeakKeyDictionary[Any, dict[str, int]]" = weakref.WeakKeyDictionary()


def _handle(api, device) -> int:
    """One cuSPARSELt handle per api and device, for as long as the api lives (the process, for nvmath's),
    as torch keeps its own."""
    per_device = _HANDLES.setdefault(api, {})
    if str(device) not in per_device:
        per_device[str(device)] = int(api.init())
    return per_device[str(device)]


def _current_stream(device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream) if torch.device(device).type == "cuda" else 0


def _host(value, dtype) -> np.ndarray:
    """A one-element host buffer holding value as the C type the attribute takes."""
    return np.array([value], dtype=dtype)


@dataclass
class _Plan:
    matmul: int
    alg_sel: int
    plan: int
    workspace: "torch.Tensor"
    alg: int
    descriptors: tuple = ()


class FusedGemm:
    """One 2:4 INT8 Linear as a cuSPARSELt GEMM with its epilogue fused (see the module docstring).

    w_codes [N, K] int8 (2:4 along K), alpha fp32 [N] (s_w[n] * s_x), bias [N] or None; call with the
    activation codes [T, K] int8 (T a multiple of 16), get [T, N] in the spec's output type. Plans are built
    per T on first use (outside a CUDA-graph capture: the warm-up call before each capture builds them)."""

    def __init__(self, w_codes, alpha, bias, spec: EpilogueSpec = EpilogueSpec(), *, api=None,
                 alg_search: bool = False, stream: Callable[[Any], int] | None = None):
        self.api = api if api is not None else default_api()
        self.alg_search = alg_search
        self.stream = stream or _current_stream
        self.n, self.k = (int(d) for d in w_codes.shape)
        self.device = w_codes.device
        if w_codes.dtype != torch.int8:
            raise ValueError(f"weight codes must be int8, got {w_codes.dtype}")
        self.handle = _handle(self.api, self.device)
        self._set_epilogue(spec, alpha, bias)
        self.beta = _host(0.0, np.float32)  # host scalar: no C operand (C is D, beta 0)
        api_ = self.api
        self.sparse = int(api_.structured_descriptor_init(self.handle, self.n, self.k, self.k, ALIGNMENT, CUDA_R_8I,
                                                          ORDER_ROW, SPARSITY_50_PERCENT))
        size, buf_size = api_.sp_mma_compressed_size2(self.handle, self.sparse)
        self.packed = torch.empty(int(size), dtype=torch.int8, device=self.device)
        scratch = torch.empty(max(int(buf_size), 1), dtype=torch.uint8, device=self.device)
        dense = w_codes.contiguous()
        api_.sp_mma_compress2(self.handle, self.sparse, 1, OP_NON_TRANSPOSE, dense.data_ptr(),
                              self.packed.data_ptr(), scratch.data_ptr(), self.stream(self.device))
        self._keep = (dense, scratch)  # alive until the compression has run on the stream

    def _set_epilogue(self, spec: EpilogueSpec, alpha, bias) -> None:
        """The epilogue's vectors and output type for `spec`; the plans built for another spec are dropped."""
        self.spec = spec
        self.alpha, bias_t, self.post = epilogue_vectors(spec, alpha.to(self.device), None if bias is None
                                                         else bias.to(self.device))
        # the bias lives in a buffer twice as long as read, zero-padded: a library reading a wider type than
        # documented gets wrong numbers (which the GPU test sees) rather than reading past an allocation
        self.bias = None if bias_t is None else torch.cat([bias_t, torch.zeros_like(bias_t)])
        self.out_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}[spec.out]
        self.plans: dict[int, _Plan] = {}

    def with_spec(self, spec: EpilogueSpec, alpha, bias) -> "FusedGemm":
        """The same compressed weight with another epilogue (alpha and bias as given to the constructor):
        the weight is not compressed again, and no dense copy of it is needed."""
        other = copy.copy(self)
        other._set_epilogue(spec, alpha, bias)
        return other

    def _plan(self, t: int, xq, out) -> _Plan:
        api, h = self.api, self.handle
        b = int(api.dense_descriptor_init(h, t, self.k, self.k, ALIGNMENT, CUDA_R_8I, ORDER_ROW))
        d = int(api.dense_descriptor_init(h, self.n, t, self.n, ALIGNMENT, OUT_TYPES[self.spec.out], ORDER_COL))
        mm = int(api.matmul_descriptor_init(h, OP_NON_TRANSPOSE, OP_TRANSPOSE, self.sparse, b, d, d, COMPUTE_32I))
        bias_ptr = None if self.bias is None else self.bias.data_ptr()
        keep = []
        for attr, value in matmul_attributes(self.spec, bias_ptr, self.post):
            buf = _host(value, ATTR_DTYPES[attr])
            keep.append(buf)
            api.matmul_desc_set_attribute(h, mm, int(attr), buf.ctypes.data, buf.nbytes)
        alg_sel = int(api.matmul_alg_selection_init(h, mm, MATMUL_ALG_DEFAULT))
        plan = int(api.matmul_plan_init(h, mm, alg_sel))
        ws = torch.empty(max(int(api.matmul_get_workspace(h, plan)), 1), dtype=torch.uint8, device=self.device)
        p = _Plan(mm, alg_sel, plan, ws, 0)
        if self.alg_search:
            self._run(api.matmul_search, p, xq, out)
            cfg = np.zeros(1, dtype=ALG_ATTR_DTYPES[AlgAttr.CONFIG_ID])
            api.matmul_alg_get_attribute(h, alg_sel, int(AlgAttr.CONFIG_ID), cfg.ctypes.data, cfg.nbytes)
            p.alg = int(cfg[0])
            # the search leaves its pick in the selection; the plan is rebuilt on it
            api.matmul_plan_destroy(plan)
            p.plan = int(api.matmul_plan_init(h, mm, alg_sel))
            p.workspace = torch.empty(max(int(api.matmul_get_workspace(h, p.plan)), 1), dtype=torch.uint8,
                                      device=self.device)
        p.descriptors = (b, d)  # kept for the plan's life: the matmul descriptor refers to them
        return p

    def _run(self, fn, p: _Plan, xq, out) -> None:
        streams = np.array([self.stream(self.device)], dtype=np.int64)  # cudaStream_t[1]
        fn(self.handle, p.plan, self.alpha.data_ptr(), self.packed.data_ptr(), xq.data_ptr(), self.beta.ctypes.data,
           out.data_ptr(), out.data_ptr(), p.workspace.data_ptr(), streams.ctypes.data, 1)

    def __call__(self, xq):
        if xq.dtype != torch.int8 or xq.dim() != 2 or xq.shape[1] != self.k:
            raise ValueError(f"expected int8 codes [T, {self.k}], got {xq.dtype} {tuple(xq.shape)}")
        xq = xq.contiguous()
        t = int(xq.shape[0])
        out = torch.empty((t, self.n), dtype=self.out_dtype, device=xq.device)
        if t not in self.plans:
            if xq.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"no cuSPARSELt plan for {t} rows: run once outside the graph capture first")
            self.plans[t] = self._plan(t, xq, out)
        self._run(self.api.matmul, self.plans[t], xq, out)
        return out
