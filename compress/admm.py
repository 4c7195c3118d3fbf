"""The ADMM step toward Z ∈ S(2:4) ∩ Q(INT8) (NxMTransformer / HoloFormer).

ADMM (scaled form) for min_W loss(W) s.t. W ∈ C, with C = S ∩ Q (or S alone with quant=False):
    W-step  gradient steps on loss(W) + rho/2 ||W - Z + U||^2   (penalty="decoupled": the trainer's
            AdamW step, then `penalty_step`, a plain gradient step on the proximal term, like weight
            decay; penalty="loss": `penalty_loss` joins the training loss and AdamW takes both)
    Z-step  Z = Π_C(W + U)                       (compress.project.project: prune, then round)
    U-step  U += W - Z
rho rises geometrically; when it changes, the scaled dual U is rescaled by rho_old / rho_new so the
unscaled multiplier rho·U is continuous.

`layerwise_projection` is the one-time projection of the teacher onto the set, layer by layer on calibration
inputs (preset projection="obs": SparseGPT's OBS updates; "admm": compress.project.admm_prune, the mask free;
"admm_fixed_mask": the same ADMM on the mask metric's mask), with each Linear's reconstruction error on
held-out calibration rows for the manifest.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from .config import AdmmConfig
from .layers import get_linear
from .project import AdmmSolverOptions, admm_prune, obs_prune, project
from .sequential import LayerInputs, layer_blocks


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
        return _relative_residual(self.weights, self.weights, self.Z)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return _dual_tensors(self.Z, self.U)

    def state_meta(self) -> dict:
        return {"k": self.k, "num_updates": self.num_updates, "mask_moves": list(self.mask_moves)}

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping) -> None:
        _load_dual(self, tensors, meta)


def _relative_residual(current: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor],
                       Z: Mapping[str, torch.Tensor]) -> float:
    """||current - Z|| / ||W|| summed over the layers."""
    num = sum(float(((w - Z[k]) ** 2).sum()) for k, w in current.items())
    den = sum(float((w ** 2).sum()) for w in weights.values())
    return math.sqrt(num / max(den, 1e-30))


def _dual_tensors(Z: Mapping[str, torch.Tensor], U: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Z and U as the tensors a saved run carries."""
    return {**{f"admm.Z.{k}": v for k, v in Z.items()}, **{f"admm.U.{k}": v for k, v in U.items()}}


def _load_dual(solver, tensors: Mapping[str, torch.Tensor], meta: Mapping) -> None:
    """Z, U, the step count and the mask-move history of `solver` (Admm or GuidedAdmm) from a saved run."""
    for k in solver.layers:
        dev = solver.weights[k].device
        solver.Z[k] = tensors[f"admm.Z.{k}"].to(dev, copy=True)
        solver.U[k] = tensors[f"admm.U.{k}"].to(dev, copy=True)
    solver.k = int(meta["k"])
    solver.mask_moves = [float(x) for x in meta.get("mask_moves", [])]


def _output_error(dense: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - V) H (W - V)^T): the squared output error of V against W on the inputs whose X^T X is H."""
    d = dense - w.to(dense.dtype)
    return float((d @ h * d).sum())


@dataclass(frozen=True)
class ProjectionOptions:
    """How layerwise_projection projects each Linear."""

    method: str = "admm"  # "obs" or "admm" (see layerwise_projection)
    quant: bool = True  # onto 2:4 ∩ INT8; False: 2:4 alone
    n: int = 2
    m: int = 4
    fixed_mask: bool = False  # admm: keep the given masks (ADMM on the values only) instead of letting them move
    solver: AdmmSolverOptions = AdmmSolverOptions()  # its damp is OBS's too; the rest is the ADMM solve's


@torch.no_grad()
def layerwise_projection(model: nn.Module, layers: list[str], batches: list[Mapping[str, torch.Tensor]],
                         heldout: list[Mapping[str, torch.Tensor]] | None = None,
                         options: ProjectionOptions = ProjectionOptions(), *,
                         masks: Mapping[str, torch.Tensor] | None = None,
                         importance: Mapping[str, torch.Tensor] | None = None,
                         ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float]]]:
    """Project each named Linear onto 2:4 (∩ INT8), in place, so its output on `batches` stays close to the dense
    one's.

    Encoder layers are taken in order and each one's Linear inputs are measured after the layers before it were
    projected (SparseGPT's sequential pass), so later layers also make up for the earlier ones' error.
      method="obs"   optimal-brain-surgeon updates (compress.project.obs_prune) on the given `masks`; the model
                     keeps the updated weights off the grid, as compress.sparsify.obs_masks does
      method="admm"  layer-wise ADMM (compress.project.admm_prune), the masks free to move from `masks` (mask
                     choice by |w| x importance[layer]); the model gets the least-squares weights on the final
                     mask rounded onto the grid (with `quant`), what the later layers will see. With
                     options.fixed_mask the given `masks` stay and ADMM solves the values on them
                     (compress.project.admm_on_mask); the model gets its grid point
    Returns (masks, per-layer diagnostics): for each Linear the squared output error of its final weights (on
    the grid with `quant`) relative to that of the nearest projection (the same mask metric, the weights kept
    as they are), on the fit batches ("fit_vs_nearest") and on `heldout` ("heldout_vs_nearest"), and relative
    to the dense output's energy on `heldout` ("heldout_relative"); with "admm" also its iterations.
    """
    method, quant, n, m, fixed_mask = options.method, options.quant, options.n, options.m, options.fixed_mask
    damp = options.solver.damp
    if method not in ("obs", "admm"):
        raise ValueError(f"layerwise_projection: method {method!r} is not obs or admm")
    blocks, in_order = layer_blocks(model, layers)
    inputs = LayerInputs(model, [batches, heldout] if heldout else [batches], sequential=in_order)
    out_masks: dict[str, torch.Tensor] = {}
    diag: dict[str, dict[str, float]] = {}
    for index, names in blocks:
        hessians, *rest = inputs.hessians(index, names)
        held = rest[0] if rest else None
        for name in names:
            lin = get_linear(model, name)
            w = lin.weight.detach()
            dense, h = w.to("cpu", torch.float64), hessians[name]
            imp = importance.get(name) if importance else None
            given = masks.get(name) if masks else None
            nearest = project(dense, n, m, quant=quant, mask=given, importance=imp).z
            t0 = time.perf_counter()
            info: dict[str, float] = {}
            if method == "obs":
                new, out_masks[name] = obs_prune(w, h, n, m, mask=given, damp=damp)
                final = project(new.to("cpu", torch.float64), n, m, quant=quant, mask=out_masks[name].cpu()).z
            else:
                res = admm_prune(w, h, n, m, quant=quant, mask=given if fixed_mask else None, importance=imp,
                                 solver=options.solver)
                out_masks[name] = res.mask
                if fixed_mask and given is not None:  # already the grid point (or, without quant, the solve)
                    final = res.z.to("cpu", torch.float64)
                else:
                    final = project(res.w.to("cpu", torch.float64), n, m, quant=quant, mask=res.mask.cpu()).z
                new = final.to(w.device, w.dtype)
                info = {"iters": res.iters, "rho_final": round(res.rho, 4),
                        "mask_moved_vs_start": round(float((res.mask.cpu() != (nearest != 0)).float().mean()), 5)}
                if given is not None:
                    info["mask_moved_vs_start"] = round(float((res.mask.cpu() != given.cpu()).float().mean()), 5)
                if fixed_mask and given is not None:
                    info["rows_from_iterations"] = round(res.rows_from_iterations, 5)
            info["seconds"] = round(time.perf_counter() - t0, 2)
            info["fit_vs_nearest"] = _output_error(dense, final, h) / max(_output_error(dense, nearest, h), 1e-30)
            if held is not None:
                hh = held[name]
                info["heldout_vs_nearest"] = _output_error(dense, final, hh) / max(_output_error(dense, nearest, hh),
                                                                                   1e-30)
                info["heldout_relative"] = _output_error(dense, final, hh) / max(float((dense @ hh * dense).sum()),
                                                                                 1e-30)
            diag[name] = info
            lin.weight.copy_(new)
    return out_masks, diag


class GuidedWeight(nn.Module):
    """Parametrization for ADMM-guided QAT: weight = fake_quant(original * mask), the mask a buffer that the
    Z-steps of GuidedAdmm replace. The gradient reaches every entry of `original` (straight through the mask
    as through the rounding), so a pruned weight the task needs can grow until a Z-step keeps it."""

    def __init__(self, mask: torch.Tensor, quant: bool):
        super().__init__()
        # a copy: the Z-steps overwrite it, and the caller's mask stays the projection's
        self.register_buffer("mask", mask.detach().to(torch.bool, copy=True), persistent=True)
        self.quant = quant

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        from .project import channel_scales
        from .quant import fake_quant_weight

        masked = w * self.mask
        v = w + (masked - w).detach()  # the value of w * mask, the gradient of w
        if self.quant:
            v = fake_quant_weight(v, channel_scales(masked.detach()))
        return v


class GuidedAdmm:
    """ADMM kept on through QAT with distillation (stage 2 after projection="admm"), for compress.trainer.

    The student's encoder Linears carry GuidedWeight (W latent, the forward sees W on Z's mask, rounded). After
    every optimizer step the proximal term ρ/2 Σ_ij d_j (W_ij - Z_ij + U_ij)^2 takes a plain gradient step, with
    d_j = importance_j^2 / mean(importance^2): the metric whose 2:4 choice (|w| x importance) makes the Z-step,
    so Z is the minimiser, over the set, of the penalty it enters. ρ is constant (cfg.guide_rho). Every
    cfg.interval steps, until cfg.guide_until of the steps, Z = Π(W + U) (2:4 by that metric, then the row's
    INT8 grid), U += W - Z, and the forward's mask becomes Z's; after that the mask stays, so the last steps train
    the final mask. The masks at
    the end are Z's (no mask rebuilt from W). Same interface as Admm (penalty_loss, penalty_step, update, state).
    """

    def __init__(self, model: nn.Module, layers: list[str], masks: Mapping[str, torch.Tensor], cfg: AdmmConfig,
                 total_steps: int, *, quant: bool = True, importance: Mapping[str, torch.Tensor] | None = None):
        from torch.nn.utils import parametrize

        from holoserve import HoloServeError

        rho, interval, until = cfg.guide_rho, cfg.interval, cfg.guide_until
        if not (rho > 0 and interval >= 1 and 0.0 <= until <= 1.0):
            raise HoloServeError(f"admm guidance needs rho > 0, interval >= 1 and 0 <= until <= 1 (got {rho}, "
                                 f"{interval}, {until})")
        n, m = 2, 4
        self.layers, self.n, self.m, self.quant = list(layers), n, m, quant
        self.cfg = cfg  # the trainer reads cfg.interval
        self._rho = rho
        self.last_update_step = int(until * total_steps)
        self.importance = dict(importance or {})
        self.k = 0
        self.mask_moves: list[float] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.params: dict[str, GuidedWeight] = {}
        self.d: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name in self.layers:
                lin = get_linear(model, name)
                lin.weight.mul_(masks[name])
                guide = GuidedWeight(masks[name], quant)
                parametrize.register_parametrization(lin, "weight", guide)
                self.weights[name] = lin.parametrizations.weight.original
                self.params[name] = guide
                imp = self.importance.get(name)
                w = self.weights[name]
                if imp is None:
                    self.d[name] = torch.ones(1, w.shape[1], device=w.device, dtype=w.dtype)
                else:
                    sq = imp.to(w.device, w.dtype) ** 2
                    self.d[name] = (sq / sq.mean().clamp_min(1e-30)).reshape(1, -1)
            self.Z = {k: project(w.detach(), n, m, quant=quant, mask=masks[k]).z for k, w in self.weights.items()}
            self.U = {k: torch.zeros_like(w) for k, w in self.weights.items()}

    @property
    def rho(self) -> float:
        return self._rho

    def penalty_loss(self) -> None:
        return None

    @torch.no_grad()
    def penalty_step(self) -> None:
        for name, w in self.weights.items():
            w.sub_(self._rho * self.d[name] * (w - self.Z[name] + self.U[name]))

    @torch.no_grad()
    def update(self) -> None:
        """Z-step, U-step and the forward's new mask (until cfg.guide_until of the steps; then nothing)."""
        if (self.k + 1) * self.cfg.interval > self.last_update_step:
            return
        moved = total = 0
        for name, w in self.weights.items():
            p = project(w + self.U[name], self.n, self.m, quant=self.quant, importance=self.importance.get(name))
            guide = self.params[name]
            moved += int((p.mask != guide.mask).sum())
            total += p.mask.numel()
            self.Z[name] = p.z
            self.U[name].add_(w - p.z)
            guide.mask.copy_(p.mask)
        self.mask_moves.append(moved / max(1, total))
        self.k += 1

    def masks(self) -> dict[str, torch.Tensor]:
        return {k: g.mask.clone() for k, g in self.params.items()}

    @torch.no_grad()
    def residual(self) -> float:
        masked = {k: w * self.params[k].mask for k, w in self.weights.items()}
        return _relative_residual(masked, self.weights, self.Z)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return _dual_tensors(self.Z, self.U)

    def state_meta(self) -> dict:
        return {"k": self.k, "mask_moves": list(self.mask_moves)}

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping) -> None:
        _load_dual(self, tensors, meta)  # the masks come back with the model's state (GuidedWeight's buffer)
