"""ADMM toward Z ∈ S(2:4) ∩ Q(INT8), hard projection, and the frozen-mask (+ fake-quant) weights used in QAT.

ADMM (scaled form) for min_W loss(W) s.t. W ∈ C, with C = S ∩ Q (or S alone with quant=False):
    W-step  gradient steps on loss(W) + rho/2 ||W - Z + U||^2
    Z-step  Z = Π_C(W + U)                       (compress.project.project: prune, then round)
    U-step  U += W - Z
rho rises geometrically; when it changes, the scaled dual U is rescaled by rho_old / rho_new so the
unscaled multiplier rho·U is continuous.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import nn
from torch.nn.utils import parametrize

from .config import AdmmConfig
from .layers import encoder_linear_names, get_linear
from .project import channel_scales, nm_mask, project, to_grid
from .quant import fake_quant_weight


class Admm:
    def __init__(self, model: nn.Module, layers: list[str], cfg: AdmmConfig, total_steps: int,
                 n: int = 2, m: int = 4, quant: bool = True):
        self.layers, self.cfg, self.n, self.m, self.quant = list(layers), cfg, n, m, quant
        self.weights = {name: get_linear(model, name).weight for name in self.layers}
        self.num_updates = max(1, total_steps // max(1, cfg.interval))
        self.k = 0  # Z/U updates done
        with torch.no_grad():
            self.Z = {name: self._proj(w) for name, w in self.weights.items()}
            self.U = {name: torch.zeros_like(w) for name, w in self.weights.items()}

    def _proj(self, w: torch.Tensor) -> torch.Tensor:
        return project(w.detach(), self.n, self.m, quant=self.quant).z

    @property
    def rho(self) -> float:
        c = self.cfg
        if self.num_updates <= 1:
            return c.rho_end
        frac = min(1.0, self.k / (self.num_updates - 1))
        return c.rho_start * math.exp(frac * math.log(c.rho_end / c.rho_start))

    @torch.no_grad()
    def penalty_step(self) -> None:
        """One gradient step on rho/2 ||W - Z + U||^2 (decoupled from the AdamW step on the task loss)."""
        step = self.cfg.penalty_lr * self.rho
        for name, w in self.weights.items():
            w.sub_(step * (w - self.Z[name] + self.U[name]))

    @torch.no_grad()
    def update(self) -> None:
        """Z-step and U-step, then move rho along its schedule."""
        old = self.rho
        for name, w in self.weights.items():
            self.Z[name] = self._proj(w + self.U[name])
            self.U[name].add_(w - self.Z[name])
        self.k += 1
        new = self.rho
        if new != old:
            for u in self.U.values():
                u.mul_(old / new)

    @torch.no_grad()
    def residual(self) -> float:
        """||W - Z|| / ||W|| over all constrained layers (0 means W already lies in the constraint set)."""
        num = sum(float(((w - self.Z[k]) ** 2).sum()) for k, w in self.weights.items())
        den = sum(float((w ** 2).sum()) for w in self.weights.values())
        return math.sqrt(num / max(den, 1e-30))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"admm.Z.{k}": v for k, v in self.Z.items()}
        out.update({f"admm.U.{k}": v for k, v in self.U.items()})
        return out

    def state_meta(self) -> dict:
        return {"k": self.k, "num_updates": self.num_updates}

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping) -> None:
        for k in self.layers:
            dev = self.weights[k].device
            self.Z[k] = tensors[f"admm.Z.{k}"].to(dev, copy=True)
            self.U[k] = tensors[f"admm.U.{k}"].to(dev, copy=True)
        self.k = int(meta["k"])


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


def hard_masks(model: nn.Module, layers: list[str], n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    return {name: nm_mask(get_linear(model, name).weight.detach(), n, m) for name in layers}


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
