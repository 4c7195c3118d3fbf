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
def input_quantizers(model: nn.Module, amax: Mapping[str, float], layers: Iterable[str]):
    """Fake-quantize the input of each named Linear with its calibrated per-tensor range."""
    handles = []
    try:
        for name in layers:
            key = act_key(name)
            if key not in amax:
                raise KeyError(f"no activation range {key!r}; calibrate first")
            scale = act_scale(amax[key])
            mod = model.get_submodule(name)
            handles.append(mod.register_forward_pre_hook(lambda _m, args, s=scale: (fake_quant_act(args[0], s),)))
        yield model
    finally:
        for h in handles:
            h.remove()


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
