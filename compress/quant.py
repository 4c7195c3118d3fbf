"""Fake quantization with a straight-through estimator, matching ONNX QuantizeLinear numerics.

The scheme (weights per output channel, activations per tensor, both symmetric with zero-point 0)
is defined once in holoserve.core.numerics; these are its torch forms, with a straight-through
estimator for training. The exported ONNX model reproduces these numerics.

Activation ranges are keyed "<linear name>.input" in the manifest (holoserve.core.artifact.act_key).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from holoserve.core.artifact import act_key, output_key, residual_key, softmax_key
from holoserve.core.numerics import (ACT_QMAX, ACT_QMIN, ACT_SCALE_DIV, RESIDUAL_MIN_SQNR_DB, SQNR_CAP_DB, WEIGHT_QMAX,
                                     int8_error, sqnr_db)

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
    kernel, the next quantizer amplifies it, and a few dev rows flip. With float64 the PyTorch model
    and ONNX Runtime agree on every one (docs/design.md, the numerics contract).
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


@contextmanager
def summing_inputs(model: nn.Module, layers: Iterable[str], stat, what: str):
    """Hooks that add stat(x) of each named Linear's input x [tokens, in] (non-padding tokens, float32) into
    `sums` on every forward. Yields (sums, keep): before each forward, set keep[0] to the batch's attention mask
    as bool (None: every token counts). The hooks come off on exit, and a Linear that saw no batch is an error."""
    layers = list(layers)
    sums: dict[str, torch.Tensor] = {}
    keep: list[torch.Tensor | None] = [None]

    def hook(name):
        def fn(_m, args):
            x = args[0].detach().float()
            x = x[keep[0]] if keep[0] is not None else x.reshape(-1, x.shape[-1])  # [tokens, in]
            s = stat(x).cpu()
            sums[name] = sums[name] + s if name in sums else s
        return fn

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in layers]
    try:
        yield sums, keep
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in layers if n not in sums]
    if missing:
        raise ValueError(f"{what} saw no batches for {missing[:3]}")


@torch.no_grad()
def _input_sums(model: nn.Module, layers: Iterable[str], batches: Iterable[Mapping[str, torch.Tensor]], stat, what: str
                ) -> dict[str, torch.Tensor]:
    """sum over `batches` of stat(x) for each named Linear's input x [tokens, in] (non-padding tokens, float32)."""
    with summing_inputs(model, layers, stat, what) as (sums, keep):
        _observe(model, _with_mask(batches, keep, model), [])
    return sums


def input_channel_norms(model: nn.Module, layers: Iterable[str], batches: Iterable[Mapping[str, torch.Tensor]]
                        ) -> dict[str, torch.Tensor]:
    """||x_j||_2 of each input channel j of the named Linears over the non-padding tokens of `batches`
    (float32, on the CPU): the per-input weights of the activation-aware 2:4 mask (compress.project.nm_mask)."""
    sums = _input_sums(model, layers, batches, lambda x: (x * x).sum(0), "input norms")
    return {n: v.sqrt() for n, v in sums.items()}


def input_hessians(model: nn.Module, layers: Iterable[str], batches: Iterable[Mapping[str, torch.Tensor]]
                   ) -> dict[str, torch.Tensor]:
    """X^T X [in, in] of each named Linear's inputs over the non-padding tokens of `batches` (float64, on
    the CPU): the Hessian of the layer's squared output error, for compress.project.obs_prune."""
    return _input_sums(model, layers, batches, xtx, "input Hessians")


def xtx(x: torch.Tensor) -> torch.Tensor:
    """X^T X in float64: a Linear's input Hessian over the tokens of x [tokens, in]."""
    return x.double().T @ x.double()


# ------------------------------------------------------- the TensorRT placement's extra tensors
#
# TensorRT's QDQBERT placement also quantizes both inputs of the two attention MatMuls (the Q, K, V
# projections and the softmax output P) and both inputs of every residual Add (the sub-layer's
# dense + bias output, and the skip connection), so its GEMMs can read and write INT8. With
# `tensorrt_qat`, QAT fake-quantizes these tensors too, so the model learns the numerics it is
# deployed with; the ranges go in the manifest as "<linear>.output", "<block>.residual" and
# "<attention>.softmax" next to the "<linear>.input" ones. BERT's residual stream has outlier
# channels that one per-tensor scale fits badly: a residual input whose INT8 SQNR on the calibration
# rows is under RESIDUAL_MIN_SQNR_DB gets no range, so QAT and the export (its "auto" mode) both keep
# it in float. The ONNX Runtime placement keeps all of them in float, and so does `holoserve eval`.

_QKV = (".attention.self.query", ".attention.self.key", ".attention.self.value")
ATTENTION_IMPL = "holoserve_tensorrt_qat"  # eager attention with a hook on the softmax output


@dataclass(frozen=True)
class TensorrtSites:
    outputs: list[str]    # Linears whose output TensorRT quantizes: Q/K/V, and the sub-layer dense before each Add
    blocks: list[str]     # residual blocks (dense -> dropout -> LayerNorm(x + input_tensor)): their skip input
    attention: list[str]  # self-attention modules: their softmax output

    def residual_keys(self) -> list[str]:
        """The keys of both inputs of every residual Add: the dense side, then the skip side."""
        return [output_key(f"{b}.dense") for b in self.blocks] + [residual_key(b) for b in self.blocks]

    def required_keys(self) -> list[str]:
        return [output_key(n) for n in self.outputs if n.endswith(_QKV)] + [softmax_key(a) for a in self.attention]


def tensorrt_sites(model: nn.Module, layers: Iterable[str]) -> TensorrtSites:
    outputs, blocks, attention = [], [], []
    for name in layers:
        if name.endswith(_QKV):
            outputs.append(name)
            if name.endswith(".query"):
                attention.append(name[: -len(".query")])
        elif name.endswith(".output.dense") and hasattr(model.get_submodule(name[: -len(".dense")]), "LayerNorm"):
            outputs.append(name)
            blocks.append(name[: -len(".dense")])
    return TensorrtSites(outputs, blocks, attention)


def _residual_arg(args, kwargs):
    if len(args) >= 2:
        return args[1], lambda v: ((args[0], v, *args[2:]), kwargs)
    if "input_tensor" in kwargs:
        return kwargs["input_tensor"], lambda v: (args, {**kwargs, "input_tensor": v})
    raise RuntimeError("residual block called without its residual input (expected (hidden_states, input_tensor))")


def _attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **_kw):
    """Eager scaled dot-product attention (as the exported graph computes it), with the softmax output
    passed through the module's `_holoserve_softmax` hook when one is set."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1)
    hook = getattr(module, "_holoserve_softmax", None)
    if hook is not None:
        probs = hook(probs)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


@contextmanager
def _softmax_hooks(model: nn.Module, hooks: Mapping[str, object]):
    """Run attention through `_attention`, calling hooks[name] on the softmax output of each named module."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_IMPL, _attention)  # idempotent
    AttentionMaskInterface.register(ATTENTION_IMPL, eager_mask)  # else the encoder passes no padding mask
    config = model.config
    before = config._attn_implementation
    mods = [model.get_submodule(n) for n in hooks]
    try:
        config._attn_implementation = ATTENTION_IMPL
        for mod, fn in zip(mods, hooks.values()):
            mod._holoserve_softmax = fn
        yield model
    finally:
        for mod in mods:
            mod.__dict__.pop("_holoserve_softmax", None)
        config._attn_implementation = before


@contextmanager
def tensorrt_quantizers(model: nn.Module, amax: Mapping[str, float], layers: Iterable[str]):
    """Fake-quantize the TensorRT placement's extra tensors with their per-tensor ranges (STE, for QAT):
    Q/K/V and the softmax output always; each residual-Add input that has a range (see above)."""
    sites = tensorrt_sites(model, layers)
    missing = [k for k in sites.required_keys() if k not in amax]
    if missing:
        raise KeyError(f"no activation range {missing[0]!r}; calibrate first")
    handles = []
    try:
        for n in sites.outputs:
            if output_key(n) in amax:
                handles.append(model.get_submodule(n).register_forward_hook(
                    lambda _m, _a, out, s=act_scale(amax[output_key(n)]): fake_quant_act(out, s)))
        for b in sites.blocks:
            if residual_key(b) not in amax:
                continue

            def pre(_m, args, kwargs, s=act_scale(amax[residual_key(b)])):
                x, rebuild = _residual_arg(args, kwargs)
                return rebuild(fake_quant_act(x, s))

            handles.append(model.get_submodule(b).register_forward_pre_hook(pre, with_kwargs=True))
        softmax = {a: (lambda p, s=act_scale(amax[softmax_key(a)]): fake_quant_act(p, s)) for a in sites.attention}
        with _softmax_hooks(model, softmax):
            yield model
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def calibrate_tensorrt_amax(model: nn.Module, layers: Iterable[str],
                            batches: Iterable[Mapping[str, torch.Tensor]]) -> tuple[dict[str, float], dict[str, float]]:
    """(ranges, residual SQNR) of the extra TensorRT tensors over `batches`.

    Ranges are a plain max |x| (the residual stream's outlier channels carry signal: clipping them costs
    more than the coarser grid; docs/results/2026-11-24-tensorrt-placement.md). The SQNR (dB) of each
    residual-Add input, over the batches' real (non-padding) tokens with that range, is measured in a
    second pass; the ranges returned leave
    out the residual inputs under RESIDUAL_MIN_SQNR_DB, which then stay float in QAT and in the export.
    """
    from holoserve import HoloServeError

    batches = list(batches)
    sites = tensorrt_sites(model, layers)
    if not sites.attention:
        raise HoloServeError(f"tensorrt_qat: no BERT-style self-attention (…attention.self.query/key/value) among the "
                             f"encoder Linears of this {type(model).__name__}; TensorRT QAT supports BERT, RoBERTa, "
                             "XLM-R and ELECTRA encoders: leave it off for this model")
    seen: dict[str, float] = {}
    sums: dict[str, list[float]] = {}
    keep: list[torch.Tensor | None] = [None]  # the current batch's attention mask as bool, if any
    measure = [False]

    def note(key, t):
        t = t.detach()
        if not measure[0]:
            seen[key] = max(seen.get(key, 0.0), float(t.abs().max()))
            return
        real = t[keep[0]] if keep[0] is not None and t.shape[:2] == keep[0].shape else t
        sg, nz = int8_error(real.float().cpu().numpy(), seen[key])
        acc = sums.setdefault(key, [0.0, 0.0])
        acc[0] += sg
        acc[1] += nz

    def observe(residual_only: bool):
        handles = []
        for n in sites.outputs:
            if not residual_only or n.endswith(".output.dense"):
                handles.append(model.get_submodule(n).register_forward_hook(
                    lambda _m, _a, out, k=output_key(n): note(k, out)))
        for b in sites.blocks:
            handles.append(model.get_submodule(b).register_forward_pre_hook(
                lambda _m, args, kwargs, k=residual_key(b): note(k, _residual_arg(args, kwargs)[0]), with_kwargs=True))
        hooks = {} if residual_only else {a: (lambda p, k=softmax_key(a): note(k, p) or p) for a in sites.attention}
        with _softmax_hooks(model, hooks):
            _observe(model, _with_mask(batches, keep, model), handles)

    observe(residual_only=False)
    unseen = [a for a in sites.attention if softmax_key(a) not in seen]
    if unseen:
        raise HoloServeError(f"tensorrt_qat: the attention of {type(model).__name__} does not run through "
                             "transformers' attention interface, so its softmax cannot be quantized in QAT "
                             f"({unseen[0]}); leave tensorrt_qat off for this model")
    measure[0] = True
    observe(residual_only=True)
    sqnr = {k: sqnr_db(*sums[k]) for k in sites.residual_keys()}
    amax = {k: max(v, 1e-6) for k, v in seen.items() if sqnr.get(k, SQNR_CAP_DB) >= RESIDUAL_MIN_SQNR_DB}
    return amax, sqnr


def _with_mask(batches, keep: list, model: nn.Module):
    """Yield `batches`, setting keep[0] to each one's attention mask as bool (None if it has none)."""
    device = next(model.parameters()).device
    for b in batches:
        am = b.get("attention_mask")
        keep[0] = am.to(device).bool() if am is not None else None
        yield b


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
