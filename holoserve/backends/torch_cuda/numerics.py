"""The quantized math of the torch-cuda backend, as torch ops on any device.

The scheme and its constants are holoserve.core.numerics (the project's one numerics contract);
this module is its torch form for inference:

    codes_x = clamp(round_half_even(x / s_x), ACT_QMIN, ACT_QMAX)      s_x = amax / ACT_SCALE_DIV
    codes_w = round_codes(w, s_w)   (holoserve.core.numerics)           exact: w is codes x scale
    y       = (codes_x @ codes_w^T) * (s_w[n] * s_x) + bias

The exact INT8 Linear is `int8_linear_codes` (integer accumulation, then `dequantize`);
`int8_linear_reference` quantizes its input first. QuantLinear's `reference` kernel and the GPU
epilogue probe both use them, and the INT8 GEMM kernels share `dequantize`.
"""
from __future__ import annotations

from holoserve.core.numerics import ACT_QMAX, ACT_QMIN, round_codes

from ._torch import torch


def quantize_activation(x: "torch.Tensor", scale: "torch.Tensor") -> "torch.Tensor":
    """int8 codes of `x` for a per-tensor scale: x / s in float32, round half to even, saturate.

    Same arithmetic as compress.quant.fake_quant_act (and ONNX QuantizeLinear) on float32 input.
    """
    q = torch.round(x.float() / scale)
    return torch.clamp_(q, ACT_QMIN, ACT_QMAX).to(torch.int8)


def weight_codes(w: "torch.Tensor", scales: "torch.Tensor") -> "torch.Tensor":
    """Recover the int8 codes of a weight stored as codes x per-channel scale (exact by contract), on the
    CPU with the contract's own rounding (holoserve.core.numerics.round_codes); loading runs once."""
    codes = round_codes(w.detach().float().cpu().numpy(), scales.detach().float().cpu().numpy())
    return torch.from_numpy(codes)


def dequantize(acc: "torch.Tensor", alpha: "torch.Tensor", bias: "torch.Tensor | None" = None) -> "torch.Tensor":
    """The float32 epilogue of an INT8 GEMM: accumulator x per-channel factor (s_w[n] * s_x), then + bias."""
    y = acc.float() * alpha
    return y + bias if bias is not None else y


def int8_linear_codes(xq: "torch.Tensor", w_codes: "torch.Tensor", alpha: "torch.Tensor",
                      bias: "torch.Tensor | None" = None) -> "torch.Tensor":
    """The exact INT8 GEMM of codes [M, K] and [N, K], dequantized: float32 [M, N].

    Accumulation runs in float64, which is exact here (|sum| <= 128 * 127 * K < 2**53), so this is
    the integer result a tensor core produces; the epilogue (`dequantize`) is computed in float32.
    """
    return dequantize(xq.double() @ w_codes.double().t(), alpha, bias)


def int8_linear_reference(
    x: "torch.Tensor", w_codes: "torch.Tensor", w_scales: "torch.Tensor", act_scale: "torch.Tensor",
    bias: "torch.Tensor | None" = None,
) -> "torch.Tensor":
    """The exact quantized Linear: int8 codes, integer accumulation, per-channel dequantization."""
    shape = x.shape
    xq = quantize_activation(x.reshape(-1, shape[-1]), act_scale)
    y = int8_linear_codes(xq, w_codes, w_scales.float() * act_scale.float(), None if bias is None else bias.float())
    return y.reshape(*shape[:-1], -1)
