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


def _nm_shape(w: torch.Tensor, n: int, m: int) -> tuple[int, int]:
    """(out, in) of a weight that can be N:M sparse along its input; ValueError naming why otherwise."""
    if w.dim() != 2:
        raise ValueError(f"N:M masks need a 2-D weight, got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    if in_f % m:
        raise ValueError(f"input dimension {in_f} is not a multiple of {m}; this layer cannot be {n}:{m} sparse")
    return out_f, in_f


def nm_mask(w: torch.Tensor, n: int = 2, m: int = 4, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the n largest |w| in every group of m along the last (input) dimension.

    With `importance` (one non-negative value per input channel), keep the n largest |w_ij| * importance_j
    instead: with importance_j = ||x_j||, the input channel's norm over sample data, that is the 2:4 mask
    closest to w in the output-error metric sum_j ||x_j||^2 (w_ij - z_ij)^2 (Wanda's score).
    """
    out_f, in_f = _nm_shape(w, n, m)
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


def obs_prune(w: torch.Tensor, hessian: torch.Tensor, n: int = 2, m: int = 4, *, mask: torch.Tensor | None = None,
              damp: float = 0.01, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """N:M pruning with optimal-brain-surgeon updates of the kept weights (SparseGPT, Frantar & Alistarh 2023).

    `hessian` is X^T X of the layer's inputs ([in, in], any positive scale). Input columns are pruned left
    to right; each pruned weight's error on the layer output, measured by the Hessian, is moved onto the
    columns not yet processed, so the pruned layer's output stays as close as it can to the dense one's on
    those inputs. The group mask is the given `mask` (compensation only) or, without one, chosen as each
    group is reached by SparseGPT's saliency w_ij^2 / [H^-1]_jj^2 on the updated weights.
    `damp` × mean(diag H) is added to the diagonal. The arithmetic runs in float64 on the CPU. Returns
    (pruned weight in w's dtype, bool mask), both on w's device.
    """
    out_f, in_f = _nm_shape(w, n, m)
    if hessian.shape != (in_f, in_f):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({in_f}, {in_f})")
    if mask is not None and mask.shape != w.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(w.shape)}")
    block = max(m, block - block % m)
    W = w.detach().to("cpu", torch.float64, copy=True)
    H = hessian.detach().to("cpu", torch.float64, copy=True)
    diag = H.diagonal()
    diag[diag <= 0] = 1.0  # an input never seen in the samples: no error to compensate through it
    diag += damp * float(diag.mean())
    # the upper Cholesky factor of H^-1: row j holds how column j's error spreads over columns j..in
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    keep = mask.detach().to("cpu", torch.bool, copy=True) if mask is not None else \
        torch.zeros(out_f, in_f, dtype=torch.bool)
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        Wb = W[:, b0:b1]  # a view: updates land in W
        Ub = U[b0:b1, b0:b1]
        err = torch.zeros_like(Wb)
        for j in range(b1 - b0):
            if mask is None and j % m == 0:
                d = Ub.diagonal()[j:j + m]
                top = (Wb[:, j:j + m] ** 2 / d ** 2).topk(n, dim=1).indices
                keep[:, b0 + j:b0 + j + m].scatter_(1, top, True)
            e = Wb[:, j] * ~keep[:, b0 + j] / Ub[j, j]  # a new tensor: the update below cannot change it
            Wb[:, j:] -= e.unsqueeze(1) * Ub[j, j:].unsqueeze(0)
            err[:, j] = e
        if b1 < in_f:
            W[:, b1:] -= err @ U[b0:b1, b1:]
    return (W * keep).to(w.device, w.dtype), keep.to(w.device)
