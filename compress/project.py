"""Projections onto the constraint sets, as pure tensor functions.

S = N:M sparse along the input dimension (keep the N largest |w| of every M consecutive inputs),
Q = per-output-channel symmetric INT8 grid (w = q * s, q integer in [-127, 127], zero-point 0).
The unified projection Π_{S∩Q} prunes first and then rounds the kept values; because the
quantizer is zero-preserving, the pruned entries stay exactly zero after rounding.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from holoserve.core.numerics import WEIGHT_QMAX

# Smallest scale used for an all-zero output channel (its codes are all zero anyway).
_MIN_SCALE = 1e-12


class Projection(NamedTuple):
    z: torch.Tensor  # projected weight, same shape/dtype as the input
    mask: torch.Tensor  # bool, True where the weight is kept
    scales: torch.Tensor | None  # per-output-channel scales (float32), or None without quantization


def nm_mask(w: torch.Tensor, n: int = 2, m: int = 4, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the n largest |w| in every group of m along the last (input) dimension.

    With `importance` (one non-negative value per input channel), keep the n largest |w_ij| * importance_j
    instead: with importance_j = ||x_j||, the input channel's norm over sample data, that is the 2:4 mask
    closest to w in the output-error metric sum_j ||x_j||^2 (w_ij - z_ij)^2 (Wanda's score).
    """
    if w.dim() != 2:
        raise ValueError(f"N:M masks need a 2-D weight, got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    if in_f % m:
        raise ValueError(f"input dimension {in_f} is not a multiple of {m}; this layer cannot be {n}:{m} sparse")
    score = w.detach().abs()
    if importance is not None:
        if importance.shape != (in_f,):
            raise ValueError(f"importance has shape {tuple(importance.shape)}, expected ({in_f},): one value per input")
        score = score * importance.to(score.device, score.dtype)
    groups = score.reshape(out_f, in_f // m, m)
    idx = groups.topk(n, dim=-1, sorted=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, idx, True)
    return mask.reshape(out_f, in_f)


def channel_scales(w: torch.Tensor, qmax: int = WEIGHT_QMAX) -> torch.Tensor:
    """Symmetric per-output-channel scale: max |w| of the row / qmax, in float32."""
    amax = w.detach().abs().amax(dim=1).float()
    return torch.clamp(amax / qmax, min=_MIN_SCALE)


def to_grid(w: torch.Tensor, scales: torch.Tensor, qmax: int = WEIGHT_QMAX) -> torch.Tensor:
    """Round onto the grid q * s (float32 arithmetic, so the result is bit-exact q * s)."""
    s = scales.float().reshape(-1, 1)
    q = torch.clamp(torch.round(w.float() / s), -qmax, qmax)
    return (q * s).to(w.dtype)


def project(
    w: torch.Tensor,
    n: int = 2,
    m: int = 4,
    *,
    quant: bool = True,
    mask: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    importance: torch.Tensor | None = None,
) -> Projection:
    """Π_{S∩Q}(w) (or Π_S with quant=False). A given mask/scales is kept fixed (QAT and frozen-mask phases);
    `importance` weighs the input channels when the mask is chosen (see nm_mask)."""
    if mask is None:
        mask = nm_mask(w, n, m, importance)
    kept = w * mask
    if not quant:
        return Projection(kept, mask, None)
    if scales is None:
        scales = channel_scales(kept)
    return Projection(to_grid(kept, scales), mask, scales)
