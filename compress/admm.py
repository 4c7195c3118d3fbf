"""The ADMM step toward Z ∈ S(2:4) ∩ Q(INT8) (NxMTransformer / HoloFormer).

ADMM (scaled form) for min_W loss(W) s.t. W ∈ C, with C = S ∩ Q (or S alone with quant=False):
    W-step  gradient steps on loss(W) + rho/2 ||W - Z + U||^2   (penalty="decoupled": the trainer's
            AdamW step, then `penalty_step`, a plain gradient step on the proximal term, like weight
            decay; penalty="loss": `penalty_loss` joins the training loss and AdamW takes both)
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

from .config import AdmmConfig
from .layers import get_linear
from .project import project


class Admm:
    def __init__(self, model: nn.Module, layers: list[str], cfg: AdmmConfig, total_steps: int,
                 n: int = 2, m: int = 4, quant: bool = True, importance: Mapping[str, torch.Tensor] | None = None):
        from holoserve import HoloServeError

        if cfg.penalty not in ("decoupled", "loss"):
            raise HoloServeError(f"admm_cfg.penalty={cfg.penalty!r}: choose decoupled or loss")
        if cfg.rho_start <= 0 or cfg.rho_end <= 0 or cfg.interval < 1:
            raise HoloServeError("admm_cfg: rho_start and rho_end must be > 0 and interval >= 1 "
                                 f"(got {cfg.rho_start}, {cfg.rho_end}, {cfg.interval})")
        self.layers, self.cfg, self.n, self.m, self.quant = list(layers), cfg, n, m, quant
        self.importance = dict(importance or {})  # per-input-channel weights of the Z-step's mask (see nm_mask)
        self.weights = {name: get_linear(model, name).weight for name in self.layers}
        self.num_updates = max(1, total_steps // max(1, cfg.interval))
        self.k = 0  # Z/U updates done
        self.mask_moves: list[float] = []  # per Z-update: share of weights whose kept/pruned state changed
        with torch.no_grad():
            self.Z = {name: self._proj(name, w) for name, w in self.weights.items()}
            self.U = {name: torch.zeros_like(w) for name, w in self.weights.items()}

    def _proj(self, name: str, w: torch.Tensor) -> torch.Tensor:
        return project(w.detach(), self.n, self.m, quant=self.quant, importance=self.importance.get(name)).z

    @property
    def rho(self) -> float:
        c = self.cfg
        if self.num_updates <= 1:
            return c.rho_end
        frac = min(1.0, self.k / (self.num_updates - 1))
        return c.rho_start * math.exp(frac * math.log(c.rho_end / c.rho_start))

    def penalty_loss(self) -> torch.Tensor | None:
        """rho/2 ||W - Z + U||^2 summed over the layers, for the training loss (penalty="loss"); else None."""
        if self.cfg.penalty != "loss":
            return None
        return 0.5 * self.rho * sum(((w - self.Z[k] + self.U[k]) ** 2).sum() for k, w in self.weights.items())

    @torch.no_grad()
    def penalty_step(self) -> None:
        """One gradient step on rho/2 ||W - Z + U||^2 (decoupled from the AdamW step on the task loss)."""
        if self.cfg.penalty != "decoupled":
            return
        step = self.cfg.penalty_lr * self.rho
        for name, w in self.weights.items():
            w.sub_(step * (w - self.Z[name] + self.U[name]))

    @torch.no_grad()
    def update(self) -> None:
        """Z-step and U-step, then move rho along its schedule."""
        old = self.rho
        moved = total = 0
        for name, w in self.weights.items():
            z = self._proj(name, w + self.U[name])
            moved += int(((z != 0) != (self.Z[name] != 0)).sum())
            total += z.numel()
            self.Z[name] = z
            self.U[name].add_(w - self.Z[name])
        self.mask_moves.append(moved / max(1, total))
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
        return {"k": self.k, "num_updates": self.num_updates, "mask_moves": list(self.mask_moves)}

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping) -> None:
        for k in self.layers:
            dev = self.weights[k].device
            self.Z[k] = tensors[f"admm.Z.{k}"].to(dev, copy=True)
            self.U[k] = tensors[f"admm.U.{k}"].to(dev, copy=True)
        self.k = int(meta["k"])
        self.mask_moves = [float(x) for x in meta.get("mask_moves", [])]
