"""Fake quantization with a straight-through estimator, matching ONNX QuantizeLinear numerics.

The scheme (weights per output channel, activations per tensor, both symmetric with zero-point 0)
is defined once in holoserve.core.numerics; these are its torch forms, with a straight-through
estimator for training. The exported ONNX model reproduces these numerics.

Activation ranges are keyed "<linear name>.input" in the manifest (holoserve.core.artifact.act_key).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Mapping

import torch
from torch import nn

from holoserve.core.artifact import act_key, output_key, residual_key
from holoserve.core.numerics import ACT_QMAX, ACT_QMIN, ACT_SCALE_DIV, WEIGHT_QMAX

from .data import to_device

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


def fake_quant_weight(w: torch.Tensor, scales: torch.Tensor, qmax: int = WEIGHT_QMAX) -> torch.Tensor:
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


@torch.no_grad()
def input_channel_norms(model: nn.Module, layers: Iterable[str], batches: Iterable[Mapping[str, torch.Tensor]]
                        ) -> dict[str, torch.Tensor]:
    """||x_j||_2 of each input channel j of the named Linears over the non-padding tokens of `batches`
    (float32, on the CPU): the per-input weights of the activation-aware 2:4 mask (compress.project.nm_mask)."""
    layers = list(layers)
    sums: dict[str, torch.Tensor] = {}
    keep: list[torch.Tensor | None] = [None]  # the current batch's attention mask [batch, seq] as bool, if any

    def hook(name):
        def fn(_m, args):
            x = args[0].detach().float()
            x = x[keep[0]] if keep[0] is not None else x.reshape(-1, x.shape[-1])  # [tokens, in]
            sq = (x * x).sum(0).cpu()
            sums[name] = sums[name] + sq if name in sums else sq
        return fn

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in layers]
    device = next(model.parameters()).device

    def with_mask(batches):
        for b in batches:
            am = b.get("attention_mask")
            keep[0] = am.to(device).bool() if am is not None else None
            yield b

    _observe(model, with_mask(batches), handles)
    missing = [n for n in layers if n not in sums]
    if missing:
        raise ValueError(f"input norms saw no batches for {missing[:3]}")
    return {n: sums[n].sqrt() for n in layers}


# ------------------------------------------------------- the TensorRT placement's extra tensors
#
# TensorRT's QDQBERT placement also quantizes both inputs of every residual Add (the sub-layer's
# dense + bias output, and the skip connection) and both inputs of the two attention MatMuls
# (Q, K, V projections and the softmax), so its GEMMs can read and write INT8. Ranges calibrated
# only at export cost ~3 points on SST-2: BERT's residual stream has outlier channels that one
# per-tensor INT8 scale fits badly. With `tensorrt_qat`, QAT fake-quantizes these tensors too, so
# the model adapts; the ranges go in the manifest as "<linear>.output" and "<block>.residual"
# next to the "<linear>.input" ones. The softmax output keeps a range calibrated at export (it
# lies in [0, 1]). The ONNX Runtime placement keeps all of them in float, and so does evaluation.

_QKV = (".attention.self.query", ".attention.self.key", ".attention.self.value")


def tensorrt_sites(model: nn.Module, layers: Iterable[str]) -> tuple[list[str], list[str]]:
    """(Linears whose output TensorRT quantizes, residual blocks whose skip input it quantizes).

    A residual block is a sub-layer output module: dense -> dropout -> LayerNorm(x + input_tensor).
    """
    outputs, blocks = [], []
    for name in layers:
        if name.endswith(_QKV):
            outputs.append(name)
        elif name.endswith(".output.dense") and hasattr(model.get_submodule(name[: -len(".dense")]), "LayerNorm"):
            outputs.append(name)
            blocks.append(name[: -len(".dense")])
    return outputs, blocks


def _residual_arg(args, kwargs):
    if len(args) >= 2:
        return args[1], lambda v: ((args[0], v, *args[2:]), kwargs)
    if "input_tensor" in kwargs:
        return kwargs["input_tensor"], lambda v: (args, {**kwargs, "input_tensor": v})
    raise RuntimeError("residual block called without its residual input (expected (hidden_states, input_tensor))")


@contextmanager
def tensorrt_quantizers(model: nn.Module, amax: Mapping[str, float], layers: Iterable[str]):
    """Fake-quantize the TensorRT placement's extra tensors with their per-tensor ranges (STE, for QAT)."""
    outputs, blocks = tensorrt_sites(model, layers)
    handles = []
    try:
        for key in [output_key(n) for n in outputs] + [residual_key(b) for b in blocks]:
            if key not in amax:
                raise KeyError(f"no activation range {key!r}; calibrate first")
        for n in outputs:
            handles.append(model.get_submodule(n).register_forward_hook(
                lambda _m, _a, out, s=act_scale(amax[output_key(n)]): fake_quant_act(out, s)))
        for b in blocks:
            def pre(_m, args, kwargs, s=act_scale(amax[residual_key(b)])):
                x, rebuild = _residual_arg(args, kwargs)
                return rebuild(fake_quant_act(x, s))

            handles.append(model.get_submodule(b).register_forward_pre_hook(pre, with_kwargs=True))
        yield model
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def calibrate_tensorrt_amax(model: nn.Module, layers: Iterable[str],
                            batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    """max |x| of each extra TensorRT tensor. A plain max: the residual stream's outlier channels
    carry signal, and clipping them costs more than the coarser grid (measured on SST-2)."""
    outputs, blocks = tensorrt_sites(model, layers)
    seen: dict[str, float] = {}
    handles = []

    def note(key, t):
        seen[key] = max(seen.get(key, 0.0), float(t.detach().abs().max()))

    for n in outputs:
        handles.append(model.get_submodule(n).register_forward_hook(lambda _m, _a, out, k=output_key(n): note(k, out)))
    for b in blocks:
        handles.append(model.get_submodule(b).register_forward_pre_hook(
            lambda _m, args, kwargs, k=residual_key(b): note(k, _residual_arg(args, kwargs)[0]), with_kwargs=True))
    _observe(model, batches, handles)
    return {k: max(v, 1e-6) for k, v in seen.items()}


def _observe(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], handles: list) -> None:
    """Run `batches` in eval mode so the observing hooks see them; then remove the hooks."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for batch in batches:
            model(**to_device(batch, device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
