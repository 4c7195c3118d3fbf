"""Fake quantization with a straight-through estimator, matching ONNX QuantizeLinear numerics.

Weights: per-output-channel symmetric int8, codes in [-127, 127] (see project.py).
Activations: per-tensor symmetric, scale = amax / 127, zero-point 0, codes saturated to
[-128, 127] and rounded half-to-even — exactly what QuantizeLinear(int8) computes, and what a
uint8 QuantizeLinear with zero-point 128 computes after the shift, so the exported ONNX model
reproduces these numerics.

Activation ranges are keyed "<linear name>.input" in the manifest.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Mapping

import torch
from torch import nn

ACT_QMIN, ACT_QMAX = -128, 127
ACT_SCALE_DIV = 127.0


def act_key(layer: str) -> str:
    return f"{layer}.input"


def act_scale(amax: float | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(amax, dtype=torch.float32) / ACT_SCALE_DIV


class _RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


def fake_quant_act(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize with STE; gradients pass straight through inside the clamp range."""
    s = scale.to(x.dtype)
    q = torch.clamp(_RoundSTE.apply(x / s), ACT_QMIN, ACT_QMAX)
    return q * s


def fake_quant_weight(w: torch.Tensor, scales: torch.Tensor, qmax: int = 127) -> torch.Tensor:
    s = scales.to(w.dtype).reshape(-1, 1)
    return torch.clamp(_RoundSTE.apply(w / s), -qmax, qmax) * s


@contextmanager
def input_quantizers(model: nn.Module, amax: Mapping[str, float], layers: Iterable[str], *, exact: bool = False):
    """Fake-quantize the input of each named Linear with its calibrated per-tensor range.

    With `exact` (evaluation only: no gradients), each of those Linears also multiplies in float64:
    its input is int8 x scale and its weight int8 x per-channel scale, so every product is exact
    and the sum carries no float32 rounding, as with the int32 accumulators of the exported
    INT8 GEMMs. In float32, a K=1536 dot product of such values rounds differently from the integer
    kernel, the next quantizer amplifies it, and a few dev rows flip (2 of 872 on SST-2). With
    float64 the PyTorch model and ONNX Runtime agree on every one.
    """
    handles = []
    patched: list[nn.Module] = []
    try:
        for name in layers:
            key = act_key(name)
            if key not in amax:
                raise KeyError(f"no activation range {key!r}; calibrate first")
            scale = act_scale(amax[key])
            mod = model.get_submodule(name)
            if exact:
                mod.forward = _exact_forward(mod, scale)
                patched.append(mod)
            else:
                handles.append(mod.register_forward_pre_hook(lambda _m, args, s=scale: (fake_quant_act(args[0], s),)))
        yield model
    finally:
        for h in handles:
            h.remove()
        for mod in patched:
            del mod.forward  # back to the class's forward


def _exact_forward(mod: nn.Module, scale: torch.Tensor):
    def forward(x: torch.Tensor) -> torch.Tensor:
        xq = fake_quant_act(x, scale).double()
        bias = mod.bias.double() if mod.bias is not None else None
        return torch.nn.functional.linear(xq, mod.weight.double(), bias).to(x.dtype)

    return forward


@torch.no_grad()
def calibrate_amax(
    model: nn.Module, layers: Iterable[str], batches: Iterable[Mapping[str, torch.Tensor]],
    percentile: float | None = None,
) -> dict[str, float]:
    """Per-tensor input ranges of the named Linears over `batches` (max, or a high percentile of |x|).

    Padding positions are included: they flow through the same GEMMs at inference time.
    """
    layers = list(layers)
    seen: dict[str, list[float]] = {act_key(n): [] for n in layers}
    handles = []

    def hook(key):
        def fn(_m, args):
            a = args[0].detach().abs().float().flatten()
            if percentile is None:
                seen[key].append(float(a.max()))
            else:
                k = max(1, int(round(a.numel() * percentile / 100.0)))
                seen[key].append(float(a.kthvalue(min(k, a.numel())).values))
        return fn

    for n in layers:
        handles.append(model.get_submodule(n).register_forward_pre_hook(hook(act_key(n))))
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            model(**batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out = {}
    for key, vals in seen.items():
        if not vals:
            raise ValueError("calibration saw no batches")
        # max over batches for 'max'; mean of per-batch percentiles is steadier for 'percentile'
        out[key] = max(vals) if percentile is None else sum(vals) / len(vals)
        out[key] = max(out[key], 1e-6)
    return out
