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
    _observe(model, batches, handles)
    out = {}
    for key, vals in seen.items():
        if not vals:
            raise ValueError("calibration saw no batches")
        # max over batches for 'max'; mean of per-batch percentiles is steadier for 'percentile'
        out[key] = max(vals) if percentile is None else sum(vals) / len(vals)
        out[key] = max(out[key], 1e-6)
    return out


# ------------------------------------------------------------------ residual Adds (TensorRT placement)
#
# TensorRT's QDQBERT placement also quantizes both inputs of every residual Add (the sub-layer's
# output dense + bias, and the skip connection), so its GEMMs can write INT8. BERT's residual
# stream has outlier channels that one per-tensor INT8 scale fits badly, so post-training ranges
# cost ~2 points on SST-2; QAT with those quantizers on lets the model adapt. The ranges are stored
# as "<dense>.output" and "<block>.residual" next to the "<linear>.input" ones. The ONNX Runtime
# placement leaves the Adds in float, so evaluation does not apply them.


def residual_blocks(model: nn.Module, layers: Iterable[str]) -> list[tuple[str, str]]:
    """(block, dense) for every sub-layer output block: dense -> dropout -> LayerNorm(x + residual)."""
    out = []
    for name in layers:
        if not name.endswith(".output.dense"):
            continue
        block = name[: -len(".dense")]
        if hasattr(model.get_submodule(block), "LayerNorm"):
            out.append((block, name))
    return out


def residual_keys(block: str, dense: str) -> tuple[str, str]:
    return f"{dense}.output", f"{block}.residual"


def _residual_arg(args, kwargs):
    if len(args) >= 2:
        return args[1], lambda v: ((args[0], v, *args[2:]), kwargs)
    if "input_tensor" in kwargs:
        return kwargs["input_tensor"], lambda v: (args, {**kwargs, "input_tensor": v})
    raise RuntimeError("residual block called without its residual input (expected (hidden_states, input_tensor))")


@contextmanager
def residual_quantizers(model: nn.Module, amax: Mapping[str, float], blocks: Iterable[tuple[str, str]]):
    """Fake-quantize both inputs of each residual Add with its per-tensor range (STE, for QAT)."""
    handles = []
    try:
        for block, dense in blocks:
            k_out, k_res = residual_keys(block, dense)
            if k_out not in amax or k_res not in amax:
                raise KeyError(f"no residual ranges for {block!r}; calibrate first")
            s_out, s_res = act_scale(amax[k_out]), act_scale(amax[k_res])
            handles.append(model.get_submodule(dense).register_forward_hook(
                lambda _m, _a, out, s=s_out: fake_quant_act(out, s)))

            def pre(_m, args, kwargs, s=s_res):
                x, rebuild = _residual_arg(args, kwargs)
                return rebuild(fake_quant_act(x, s))

            handles.append(model.get_submodule(block).register_forward_pre_hook(pre, with_kwargs=True))
        yield model
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def calibrate_residual_amax(model: nn.Module, blocks: Iterable[tuple[str, str]],
                            batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    """max |x| of both residual-Add inputs per block. A plain max: the outlier channels carry signal,
    and clipping them costs more than the coarser grid (measured on SST-2)."""
    seen: dict[str, float] = {}
    handles = []

    def note(key, t):
        seen[key] = max(seen.get(key, 0.0), float(t.detach().abs().max()))

    for block, dense in blocks:
        k_out, k_res = residual_keys(block, dense)
        handles.append(model.get_submodule(dense).register_forward_hook(lambda _m, _a, out, k=k_out: note(k, out)))
        handles.append(model.get_submodule(block).register_forward_pre_hook(
            lambda _m, args, kwargs, k=k_res: note(k, _residual_arg(args, kwargs)[0]), with_kwargs=True))
    _observe(model, batches, handles)
    return {k: max(v, 1e-6) for k, v in seen.items()}


def _observe(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], handles: list) -> None:
    """Run `batches` in eval mode so the observing hooks see them; then remove the hooks."""
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            model(**batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
