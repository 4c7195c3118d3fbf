"""The hard projection onto 2:4 (∩ INT8) that every method ends with (for the default, `--method oneshot`, it
follows the dense teacher directly, with no ADMM; for the opt-in `--method admm` it follows the ADMM fine-tune,
compress/admm.py), the frozen-mask (+ fake-quant) weights used in QAT and masked fine-tuning, and post-training
INT8 of weights and word embeddings."""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.nn.utils import parametrize

from .layers import encoder_linear_names, get_linear
from .project import channel_scales, nm_mask, obs_prune, project, to_grid
from .quant import fake_quant_weight
from .sequential import LayerInputs, layer_blocks


# --------------------------------------------------------------------------- frozen mask (+ fake quant)


class MaskedWeight(nn.Module):
    """Parametrization: weight = fake_quant(original * mask). The mask is a buffer, never trained.

    Scales are per output channel from the masked weight (max |w| / 127), recomputed each forward
    exactly as `project` computes them at save time, so training sees the numerics that are saved.
    """

    def __init__(self, mask: torch.Tensor, quant: bool):
        super().__init__()
        self.register_buffer("mask", mask.to(torch.bool), persistent=True)
        self.quant = quant

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        w = w * self.mask
        if self.quant:
            w = fake_quant_weight(w, channel_scales(w))
        return w


def hard_masks(model: nn.Module, layers: list[str], n: int = 2, m: int = 4,
               importance: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each layer's N:M mask from its current weight (scored by |w|, or |w| * importance[layer])."""
    return {name: nm_mask(get_linear(model, name).weight.detach(), n, m, importance.get(name) if importance else None)
            for name in layers}


@torch.no_grad()
def obs_masks(model: nn.Module, layers: list[str], batches: list[Mapping[str, torch.Tensor]], n: int = 2, m: int = 4,
              masks: Mapping[str, torch.Tensor] | None = None, damp: float = 0.01
              ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Each layer's N:M mask, with the kept weights updated in place by optimal-brain-surgeon steps (obs_prune)
    so each pruned layer's output stays close to the unpruned one's on `batches`.

    Encoder layers are taken in order and each one's Linear inputs are measured after the layers before it
    were pruned, so later layers also compensate for the earlier ones (SparseGPT's sequential pass). The given
    `masks` are kept (compensation only); without them each is chosen by SparseGPT's saliency.
    Returns (masks, each layer's output error on its inputs relative to keeping the same mask's weights as
    they are, the nearest projection's: tr((W - Z) H (W - Z)^T) over the same for W * mask).
    """
    blocks, in_order = layer_blocks(model, layers)
    inputs = LayerInputs(model, [batches], sequential=in_order)
    given, masks = masks, {}
    ratios: dict[str, float] = {}
    for index, names in blocks:
        (hessians,) = inputs.hessians(index, names)
        for name in names:
            lin = get_linear(model, name)
            dense, h = lin.weight.detach().to("cpu", torch.float64), hessians[name]
            w, masks[name] = obs_prune(lin.weight.detach(), h, n, m, mask=given[name] if given else None, damp=damp)
            err = lambda z: float(((dense - z) @ h * (dense - z)).sum())  # noqa: E731
            ratios[name] = err(w.to("cpu", torch.float64)) / max(err(dense * masks[name].cpu()), 1e-30)
            lin.weight.copy_(w)
    return masks, ratios


def attach_masks(model: nn.Module, masks: Mapping[str, torch.Tensor], quant: bool) -> None:
    """Freeze the masks: zero the pruned weights and parametrize each weight as MaskedWeight."""
    for name, mask in masks.items():
        lin = get_linear(model, name)
        with torch.no_grad():
            lin.weight.mul_(mask)
        parametrize.register_parametrization(lin, "weight", MaskedWeight(mask, quant))


@torch.no_grad()
def reapply_masks(model: nn.Module, masks: Mapping[str, torch.Tensor]) -> None:
    """Zero the pruned entries of the trained (original) weights after every optimizer step."""
    for name, mask in masks.items():
        lin = get_linear(model, name)
        w = lin.parametrizations.weight.original if parametrize.is_parametrized(lin, "weight") else lin.weight
        w.mul_(mask)


@torch.no_grad()
def finalize(model: nn.Module, masks: Mapping[str, torch.Tensor], quant: bool,
             n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    """Remove parametrizations and write the exact projected weights. Returns per-channel scales (if quant)."""
    scales: dict[str, torch.Tensor] = {}
    for name, mask in masks.items():
        lin = get_linear(model, name)
        if parametrize.is_parametrized(lin, "weight"):
            parametrize.remove_parametrizations(lin, "weight", leave_parametrized=False)
        p = project(lin.weight.detach(), n, m, quant=quant, mask=mask)
        lin.weight.copy_(p.z)
        if quant:
            scales[name] = p.scales
    return scales


@torch.no_grad()
def project_layers(model: nn.Module, layers: list[str] | None = None, n: int = 2, m: int = 4,
                   quant: bool = True) -> dict[str, torch.Tensor]:
    """One-shot Π_{S∩Q} of each named Linear (all encoder Linears by default), in place.

    Returns the per-channel scales (empty without quant). Used for stand-in checkpoints and tests:
    the weights satisfy the contract but are not trained for it.
    """
    scales: dict[str, torch.Tensor] = {}
    for name in layers if layers is not None else encoder_linear_names(model):
        lin = get_linear(model, name)
        p = project(lin.weight.detach(), n, m, quant=quant)
        lin.weight.copy_(p.z)
        if quant:
            scales[name] = p.scales
    return scales


@torch.no_grad()
def quantize_embeddings(model: nn.Module, scales: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Put the word-embedding table on a per-row symmetric INT8 grid, in place.

    The table is the largest tensor of a small BERT (MiniLM: 11.7M of 22.7M parameters); storing it
    as int8 is what makes the exported file ~4x smaller. Given `scales` (from an earlier call) the
    rounding is idempotent, so calling again after training keeps the values bit-identical.
    Returns {module name: per-row scales}.
    """
    emb = model.get_input_embeddings()
    name = next(n for n, mod in model.named_modules() if mod is emb)
    if scales is None:
        scales = channel_scales(emb.weight)
    emb.weight.copy_(to_grid(emb.weight, scales))
    return {name: scales}


@torch.no_grad()
def quantize_weights(model: nn.Module, layers: list[str], masks: Mapping[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
    """Post-training INT8: round each layer (keeping its mask, if any) onto its per-channel grid."""
    scales = {}
    for name in layers:
        lin = get_linear(model, name)
        mask = masks.get(name) if masks else None
        if mask is None:
            mask = torch.ones_like(lin.weight, dtype=torch.bool)
        p = project(lin.weight.detach(), quant=True, mask=mask)
        lin.weight.copy_(p.z)
        scales[name] = p.scales
    return scales


@torch.no_grad()
def nm_share(model: nn.Module, layers: list[str], n: int = 2, m: int = 4) -> float:
    """Share of groups of m (along the input) holding at most n non-zeros, over all named layers."""
    ok = total = 0
    for name in layers:
        w = get_linear(model, name).weight
        g = (w.reshape(w.shape[0], -1, m) != 0).sum(-1)
        ok += int((g <= n).sum())
        total += g.numel()
    return ok / max(total, 1)
