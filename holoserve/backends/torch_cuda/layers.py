"""The encoder's Linears: QuantLinear (INT8, five kernels) and DenseLinear, and the cuSPARSELt epilogues.

A sparse INT8 layer runs as one 2:4 semi-structured GEMM (`torch._cslt_compress` /
`torch._cslt_sparse_mm`, the ops behind `torch.sparse.SparseSemiStructuredTensorCUSPARSELT`). The
per-output-channel factor `s_w[n] * s_x` is cuSPARSELt's alpha vector, so the dequantization (and,
where the library takes it, the bias) happens in the GEMM epilogue and the result comes out in FP16.
"""
from __future__ import annotations

from dataclasses import dataclass

from ._torch import F, Module, torch
from .cslt_epilogue import FusedGemm, spec_for
from .kernels import quantize_activation_triton
from .numerics import dequantize, int8_linear_codes, quantize_activation

# cuSPARSELt INT8 limits as PyTorch states them (SparseSemiStructuredTensorCUSPARSELT): the sparse
# operand needs rows and columns that are multiples of 32; the dense operand multiples of 16.
CSLT_SPARSE_MULTIPLE = 32
CSLT_DENSE_MULTIPLE = 16
KERNELS = ("cslt", "int_mm", "reference", "fakequant", "dense", "cslt_fused")


def pad_rows(x: "torch.Tensor", multiple: int) -> "torch.Tensor":
    extra = (-x.shape[0]) % multiple
    return F.pad(x, (0, 0, 0, extra)) if extra else x


# The ways the 2:4 INT8 GEMM's epilogue can be driven through torch._cslt_sparse_mm, best first.
# Which ones a given torch/cuSPARSELt build accepts (bias type with int8 in / fp16 out, alpha
# vectors with a transposed result) is checked numerically on the device at load time
# (probe.choose_epilogue).
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


@dataclass(frozen=True)
class Tuning:
    """How a quantized Linear's GEMM runs on the device; the load-time probes choose these (probe.py)."""

    epilogue: Epilogue | None = None  # None: EPILOGUES[0]
    quantizer: str = "torch"  # "torch" ops or the fused "triton" kernels
    # cuSPARSELt's own algorithm search: True for every token count, an int N up to N tokens, False never
    alg_search: bool | int = False


class QuantLinear(Module):  # type: ignore[misc]
    """A Linear whose input is quantized per tensor and whose weight is int8 per output channel.

    kernel:  cslt       2:4 INT8 cuSPARSELt GEMM, dequant in the epilogue (CUDA)
             cslt_fused the same GEMM called through cuSPARSELt directly (cslt_epilogue.FusedGemm): dequant and
                        bias in its epilogue and, after `emit_codes`, GELU and the next layer's quantizer too,
                        writing INT8 codes (CUDA + nvmath-python; opt-in, checked by tests/gpu/test_cslt_epilogue.py)
             int_mm     dense INT8 torch._int_mm, dequant after (CUDA)
             reference  exact int math in float64 (any device; slow, for tests)
             fakequant  quantize-dequantize the input, float GEMM with the dequantized weight
             dense      plain float Linear with the dequantized weight, no activation quantization
    """

    def __init__(self, w_codes, w_scales, act_scale, bias, *, kernel: str, dtype, tuning: Tuning = Tuning()):
        super().__init__()
        quantizer = tuning.quantizer
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {KERNELS}")
        if quantizer not in ("torch", "triton"):
            raise ValueError(f"unknown quantizer {quantizer!r}")
        self.kernel = kernel
        self.quantizer = quantizer
        # cuSPARSELt algorithm per token count, found by its own search on the first call outside
        # a graph capture (the warm-up before each capture); 0 (the library default) otherwise
        self.alg_search = tuning.alg_search
        self.algs: dict[int, int] = {}
        self.out_features, self.in_features = w_codes.shape
        self.dtype = dtype
        self.epilogue = tuning.epilogue or EPILOGUES[0]
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
        self.emits_codes = False  # cslt_fused after emit_codes: the output is the next GEMM's INT8 codes
        if kernel == "cslt_fused":
            self.fused = FusedGemm(w_codes, self.alpha, self.bias32, spec_for("qkv", dtype=_spec_dtype(dtype)),
                                   alg_search=tuning.alg_search is True)
        elif kernel == "cslt":
            self.register_buffer("packed", torch._cslt_compress(w_codes.contiguous()))
        elif kernel == "int_mm":
            self.register_buffer("w_nk", w_codes.contiguous())  # [N, K]; passed as a column-major [K, N] view
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
        return self.from_codes(self.input_codes(x2), x2.shape[0]).reshape(*shape[:-1], -1)

    def input_codes(self, x2):
        """This layer's input codes of x2 [m, K], zero rows appended up to the GEMM's row multiple."""
        if self.quantizer == "triton":
            return quantize_activation_triton(x2, self.act_scale, rows=self.padded_rows(x2.shape[0]))
        return pad_rows(quantize_activation(x2, self.act_scale), self.row_multiple)

    @property
    def row_multiple(self) -> int:
        # cuSPARSELt wants the dense operand's rows in multiples of 16; _int_mm wants more than 16 rows
        return {"cslt": CSLT_DENSE_MULTIPLE, "cslt_fused": CSLT_DENSE_MULTIPLE, "int_mm": 32}.get(self.kernel, 1)

    def padded_rows(self, m: int) -> int:
        return m + (-m) % self.row_multiple

    def from_codes(self, xq, m: int):
        """The GEMM and dequantization for int8 codes [padded rows, K]; returns [m, N] in self.dtype."""
        if self.kernel == "reference":  # exact integer accumulation, as int8_linear_reference
            return int8_linear_codes(xq[:m], self.w_codes, self.alpha, self.bias32).to(self.dtype)
        if self.kernel == "cslt_fused":
            if self.emits_codes:
                raise RuntimeError("this Linear writes the next layer's codes: call codes_from_codes")
            return self.fused(xq)[:m]
        if self.kernel == "int_mm":
            acc = torch._int_mm(xq, self.w_nk.t())[:m]
            y = dequantize(acc, self.alpha, self.bias32).to(self.dtype)
        else:
            y = self._cslt(xq)[:m]
        return y

    def emit_codes(self, next_scale, gelu: bool = True) -> None:
        """cslt_fused only: from now on the GEMM's epilogue applies GELU (gelu=True) and the quantizer of the
        next layer (activation scale next_scale) and writes its INT8 codes (codes_from_codes)."""
        if self.kernel != "cslt_fused":
            raise ValueError(f"emit_codes needs kernel 'cslt_fused', not {self.kernel!r}")
        spec = spec_for("ffn_in", next_scale=float(next_scale), gelu=gelu)
        self.fused = self.fused.with_spec(spec, self.alpha, self.bias32)
        self.emits_codes = True

    def codes_from_codes(self, xq):
        """The next layer's INT8 codes [padded rows, N] from this layer's input codes (after emit_codes); the
        rows past the real tokens hold the codes of act(bias), which only reach padded output rows."""
        if not self.emits_codes:
            raise RuntimeError("codes_from_codes needs emit_codes first")
        return self.fused(xq)

    def _alg(self, xq, **kw) -> int:
        """cuSPARSELt's algorithm for this many token rows: its own search's pick where alg_search covers
        the row count (True: any; an int N: up to N rows; False or 0: none), else 0, the library default."""
        m = xq.shape[0]
        if self.alg_search is False or (self.alg_search is not True and m > int(self.alg_search)):
            return 0
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
        return dequantize(acc, self.alpha, self.bias32).to(self.dtype)


def _spec_dtype(dtype) -> str:
    """cslt_epilogue's name of a float output dtype (cuSPARSELt's INT8 GEMM writes FP16 or BF16, not FP32)."""
    names = {torch.float16: "fp16", torch.bfloat16: "bf16"}
    if dtype not in names:
        raise ValueError(f"kernel 'cslt_fused' writes float16 or bfloat16, not {dtype}")
    return names[dtype]


class DenseLinear(Module):  # type: ignore[misc]
    """A float Linear (FP16 on the GPU): layers that stay dense, and the dense baselines."""

    kernel = "dense"

    def __init__(self, weight, bias, *, dtype):
        super().__init__()
        self.register_buffer("weight", weight.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(weight.device, dtype))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)
