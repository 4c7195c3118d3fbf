"""Projections onto the constraint sets, as pure tensor functions.

S = N:M sparse along the input dimension (keep the N largest |w| of every M consecutive inputs),
Q = per-output-channel symmetric INT8 grid (w = q * s, q integer in [-127, 127], zero-point 0).
The unified projection Π_{S∩Q} prunes first and then rounds the kept values; because the
quantizer is zero-preserving, the pruned entries stay exactly zero after rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
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


def nm_mask(w: torch.Tensor, n: int = 2, m: int = 4, importance: torch.Tensor | None = None, *,
            favour: torch.Tensor | None = None, tau: float = 0.0) -> torch.Tensor:
    """Keep the n largest |w| in every group of m along the last (input) dimension.

    With `importance` (one non-negative value per input channel), keep the n largest |w_ij| * importance_j
    instead: with importance_j = ||x_j||, the input channel's norm over sample data, that is the 2:4 mask
    closest to w in the output-error metric sum_j ||x_j||^2 (w_ij - z_ij)^2 (Wanda's score).
    With `favour` (a mask of w's shape) and tau > 0, the entries it keeps score (1 + tau) times as much: a
    hysteresis that leaves an entry of `favour` only when another beats it by that factor.
    """
    out_f, in_f = _nm_shape(w, n, m)
    score = w.detach().abs()
    if importance is not None:
        if importance.shape != (in_f,):
            raise ValueError(f"importance has shape {tuple(importance.shape)}, expected ({in_f},): one value per input")
        score = score * importance.to(score.device, score.dtype)
    if favour is not None and tau > 0:
        score = score * (1 + tau * favour.to(score.device, score.dtype))
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


class AdmmSolve(NamedTuple):
    # admm_prune: the exact least-squares weights on `mask` (not yet on the INT8 grid); admm_on_mask: the grid
    # point it ends on (= z). w's dtype and device
    w: torch.Tensor
    mask: torch.Tensor  # bool, the final 2:4 mask
    z: torch.Tensor  # ADMM's last Z (admm_on_mask: its best grid point), on 2:4 ∩ INT8, w's dtype and device
    iters: int  # ADMM iterations run
    rho: float  # the penalty at the end (relative to mean(diag H))
    # admm_prune: share of the weights whose kept/pruned state changed, per check (every `check` iters);
    # admm_on_mask: share of the kept weights whose INT8 code changed, per check
    mask_moves: list[float]
    rows_from_iterations: float = 0.0  # admm_on_mask: share of the rows that ended on an ADMM iterate


def _damped(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """X^T X in float64 on the CPU, scaled to mean diagonal 1, with `damp` added to the diagonal (an input never
    seen in the samples gets diagonal 1: no error to compensate through it)."""
    H = hessian.detach().to("cpu", torch.float64, copy=True)
    diag = H.diagonal()
    diag[diag <= 0] = float(diag[diag > 0].mean()) if bool((diag > 0).any()) else 1.0
    H /= float(diag.mean())
    H.diagonal().add_(damp)
    return H


def masked_least_squares(w: torch.Tensor, hessian: torch.Tensor, mask: torch.Tensor, *, damp: float = 0.01,
                         start: torch.Tensor | None = None, tol: float = 1e-4, max_iters: int = 300,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights on `mask` closest to w in the layer's output error: for each row i,
    argmin_v (w_i - v)^T H (w_i - v) with v zero off the row's mask, i.e. v_S = H_SS^-1 (H w_i)_S
    (H scaled and damped as in admm_prune).

    Solved for all rows at once by conjugate gradients on the masked normal equations, preconditioned by
    diag(H), from `start` (default: w on the mask), until every row's residual is under `tol` of its right-hand
    side (or `max_iters`): one [out, in] x [in, in] product per iteration, where a direct solve of each row's own
    [k, k] system costs ~out * k^3. float64 on the CPU; returns w's dtype and device.
    """
    out_f, in_f = w.shape
    if hessian.shape != (in_f, in_f) or mask.shape != w.shape:
        raise ValueError(f"hessian {tuple(hessian.shape)} / mask {tuple(mask.shape)} do not fit weight "
                         f"{tuple(w.shape)}")
    H64 = _damped(hessian, damp)
    W = w.detach().to("cpu", torch.float64)
    b = ((W @ H64) * mask.detach().to("cpu", torch.float64)).to(dtype)
    H, M = H64.to(dtype), mask.detach().to("cpu", dtype)
    x = (start.detach().to("cpu", dtype) if start is not None else W.to(dtype)) * M
    bnorm = b.norm(dim=1).clamp_min(1e-30)
    inv_d = M / H.diagonal()
    r = b - (x @ H) * M
    z = r * inv_d
    p = z.clone()
    rz = (r * z).sum(1)
    for _ in range(max_iters):
        if bool((r.norm(dim=1) <= tol * bnorm).all()):
            break
        Ap = (p @ H) * M
        pAp = (p * Ap).sum(1)
        alpha = torch.where(pAp > 0, rz / pAp.clamp_min(1e-30), torch.zeros_like(pAp)).unsqueeze(1)
        x += alpha * p
        r -= alpha * Ap
        z = r * inv_d
        rz_new = (r * z).sum(1)
        beta = torch.where(rz > 0, rz_new / rz.clamp_min(1e-30), torch.zeros_like(rz)).unsqueeze(1)
        p = z + beta * p
        rz = rz_new
    return x.to(w.device, w.dtype)


@dataclass(frozen=True)
class AdmmSolverOptions:
    """The layer-wise ADMM solve's settings (admm_prune, admm_on_mask)."""

    damp: float = 0.01  # added to the scaled Hessian's diagonal, so every solve is well posed
    rho: float = 0.1  # the proximal weight to start from
    max_iters: int = 150
    check: int = 3  # iterations between mask-change checks (and rho increases)
    # below `settle` of changed mask entries (admm_on_mask: kept codes) rho grows by growth[1], else growth[0];
    # below `stop` the iterations stop
    settle: float = 0.01
    stop: float = 1e-3
    growth: tuple[float, float] = (1.2, 1.5)
    ls_tol: float = 1e-3  # relative residual of the final least-squares solve
    # The stable free mask (projection=admm_stable): the Z-step favours the mask metric's mask by `hysteresis` (tau:
    # 0 is the free mask, a large tau keeps the start, see nm_mask); over the first `ramp` iterations the share
    # it prunes grows to (m - n) of m on Zhu & Gupta's cubic schedule, so the mask forms while W moves; and
    # with schedule "alps" rho follows the support change relative to the kept count every `check` iterations
    # (more than 10 %: x1.3, more than 0.5 %: x1.2, any: x1.1; none: stop), as ALPS does, instead of `settle`.
    hysteresis: float = 0.0
    ramp: int = 0
    schedule: str = "settle"


def admm_prune(w: torch.Tensor, hessian: torch.Tensor, n: int = 2, m: int = 4, *, quant: bool = True,
               mask: torch.Tensor | None = None, importance: torch.Tensor | None = None,
               solver: AdmmSolverOptions = AdmmSolverOptions()) -> AdmmSolve:
    """min_V ||X w^T - X V^T||^2 s.t. V ∈ 2:4 ∩ per-row INT8 grid, by ADMM (scaled form), for one Linear.

    H = X^T X (`hessian`, scaled to mean diagonal 1 and damped by `damp`) is factorised once, H = Q diag(λ) Q^T:
      W-step  W = (W0 H + ρ (Z - U)) (H + ρI)^-1  per row, the exact minimiser of the output error plus the
              proximal term ρ/2 ||W - Z + U||^2; with the eigenbasis a change of ρ costs nothing
      Z-step  Z = Π(W + U): the 2:4 mask by |v| x importance (compress.project.nm_mask, the activation-weighted
              metric the other projections use), then the kept values rounded onto their row's INT8 grid
      U-step  U += W - Z
    Every `check` iterations ρ grows (by growth[1] once fewer than `settle` of the weights changed kept/pruned
    state since the last check, else by growth[0]), rescaling U so ρU is continuous; the loop stops once fewer
    than `stop` changed (or after `max_iters`). The kept weights are then solved by least squares on the final
    mask (masked_least_squares, to a residual of `ls_tol`); the caller rounds them onto the grid
    (compress.sparsify.finalize). The factorisation and the iterations run in float32 on the CPU. With a given
    `mask` the mask stays fixed and the same iterations solve for the values on it (admm_on_mask). The
    settings named here are `solver`'s (AdmmSolverOptions); with its hysteresis, ramp or "alps" schedule the
    Z-step favours the metric's mask of w (nm_mask by |w| x importance), ramps its sparsity, and rho follows ALPS.
    """
    damp, rho, max_iters, check = solver.damp, solver.rho, solver.max_iters, solver.check
    settle, stop, growth, ls_tol = solver.settle, solver.stop, solver.growth, solver.ls_tol
    out_f, in_f = _nm_shape(w, n, m)
    if hessian.shape != (in_f, in_f):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({in_f}, {in_f})")
    if mask is not None and mask.shape != w.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(w.shape)}")
    if not (rho > 0 and max_iters >= 1 and check >= 1):
        raise ValueError(f"admm_prune needs rho > 0, max_iters >= 1 and check >= 1 (got {rho}, {max_iters}, {check})")
    H = _damped(hessian, damp)
    W0 = w.detach().to("cpu", torch.float64)
    ev32, Q32 = torch.linalg.eigh(H.float())
    WH = (W0 @ H).float()
    imp = importance.detach().to("cpu", torch.float32) if importance is not None else None
    if mask is not None:
        return _admm_on_mask(w, hessian, H, mask.detach().to("cpu", torch.bool), n, m, quant, solver)
    if solver.schedule not in ("settle", "alps"):
        raise ValueError(f"admm_prune: schedule {solver.schedule!r} is not settle or alps")
    tau, ramp = solver.hysteresis, solver.ramp
    favour = None
    if tau > 0:
        favour = nm_mask(W0.float(), n, m, imp).to(torch.float32)

    def z_step(v: torch.Tensor, it: int) -> Projection:
        # the entries kept per group: m at the start of a ramp, n from its end on (Zhu & Gupta's cubic schedule)
        k = n if it >= ramp else m - round((m - n) * (1 - (1 - it / ramp) ** 3))
        if favour is None and k == n:
            return project(v, n, m, quant=quant, importance=imp)
        return project(v, n, m, quant=quant, mask=nm_mask(v, k, m, imp, favour=favour, tau=tau))

    W = W0.float()
    p = z_step(W, 0)
    Z, keep = p.z, p.mask
    U = torch.zeros_like(W)
    last = keep
    moves: list[float] = []
    it = 0
    while it < max_iters:
        it += 1
        W = ((WH + rho * (Z - U)) @ Q32 / (ev32 + rho)) @ Q32.T
        p = z_step(W + U, it)
        Z, keep = p.z, p.mask
        U += W - Z
        if it % check == 0:
            moved = float((keep != last).float().mean())
            last = keep
            if it <= ramp:  # the mask is still forming: no verdict, rho as it is
                continue
            moves.append(moved)
            grow = _rho_growth(moved * m / n) if solver.schedule == "alps" else (
                0.0 if moved < stop else growth[1] if moved < settle else growth[0])
            if grow == 0.0:
                break
            rho *= grow
            U /= grow  # scaled dual: rho * U unchanged
    w_ls = masked_least_squares(W0, hessian, keep, damp=damp, start=W, tol=ls_tol)
    return AdmmSolve(w_ls.to(w.device, w.dtype), keep.to(w.device), Z.to(w.device, w.dtype), it, rho, moves)


def _rho_growth(change: float) -> float:
    """ALPS's rho factor for a support change `change` (relative to the kept count) since the last check; 0: stop."""
    if change > 0.1:
        return 1.3
    if change > 0.005:
        return 1.2
    return 1.1 if change > 0 else 0.0


def admm_on_mask(w: torch.Tensor, hessian: torch.Tensor, mask: torch.Tensor, n: int = 2, m: int = 4, *,
                 quant: bool = True, solver: AdmmSolverOptions = AdmmSolverOptions()) -> AdmmSolve:
    """min_V ||X w^T - X V^T||^2 s.t. V zero off `mask` and on its row's INT8 grid, by ADMM, for one Linear: the
    2:4 mask is given (a mask metric's choice) and only the kept values are solved for.

    Without the grid the problem is convex and its answer is the least-squares solve on the mask
    (masked_least_squares), returned as it is. With the grid, rounding that solve is one candidate; ADMM
    (admm_prune's W-step, ρ schedule and stopping rule, with the Z-step Π(W + U) keeping `mask` and rounding the
    kept values onto the row's grid, scale = max |kept| / 127) looks for a grid point with less error, and each
    row ends on whichever of the rounded solve and the iterations' Z leaves the least error in the damped
    metric (the rows' errors are independent). `mask_moves` then records, per check, the share of the kept
    codes that changed. Returns w = z = that point (exactly on 2:4 ∩ the grid, zero off the mask) in w's
    dtype and device.
    """
    out_f, in_f = _nm_shape(w, n, m)
    if hessian.shape != (in_f, in_f) or mask.shape != w.shape:
        raise ValueError(f"hessian {tuple(hessian.shape)} / mask {tuple(mask.shape)} do not fit weight "
                         f"{tuple(w.shape)}")
    if not (solver.rho > 0 and solver.max_iters >= 1 and solver.check >= 1):
        raise ValueError(f"admm_on_mask needs rho > 0, max_iters >= 1 and check >= 1 (got {solver.rho}, "
                         f"{solver.max_iters}, {solver.check})")
    return _admm_on_mask(w, hessian, _damped(hessian, solver.damp), mask.detach().to("cpu", torch.bool), n, m, quant,
                         solver)


def _admm_on_mask(w: torch.Tensor, hessian: torch.Tensor, H: torch.Tensor, keep: torch.Tensor, n: int, m: int,
                  quant: bool, solver: AdmmSolverOptions) -> AdmmSolve:
    """admm_on_mask's iterations, given the damped Hessian H (_damped) and the mask on the CPU."""
    rho, check, growth = solver.rho, solver.check, solver.growth
    W0 = w.detach().to("cpu", torch.float64)
    w_ls = masked_least_squares(W0, hessian, keep, damp=solver.damp)
    if not quant:
        ls = w_ls.to(w.device, w.dtype)
        return AdmmSolve(ls, keep.to(w.device), ls, 0, rho, [])
    Hf = H.float()
    W0f = W0.float()

    def row_errors(v: torch.Tensor) -> torch.Tensor:  # (w0_i - v_i)^T H (w0_i - v_i), one per row
        d = W0f - v
        return ((d @ Hf) * d).sum(1)

    def z_step(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # Z and its int8 codes
        p = project(v, n, m, quant=True, mask=keep)
        return p.z, torch.round(p.z / p.scales.reshape(-1, 1))

    best, last = z_step(w_ls.float())
    best_err = row_errors(best)
    from_iterations = torch.zeros(best.shape[0], dtype=torch.bool)
    ev32, Q32 = torch.linalg.eigh(Hf)
    WH = W0f @ Hf
    W, Z, U = w_ls.float(), best.clone(), torch.zeros_like(best)
    kept = max(1, int(keep.sum()))
    moves: list[float] = []
    it = 0
    while it < solver.max_iters:
        it += 1
        W = ((WH + rho * (Z - U)) @ Q32 / (ev32 + rho)) @ Q32.T
        Z, codes = z_step(W + U)
        U += W - Z
        err = row_errors(Z)
        better = err < best_err
        best[better], best_err[better] = Z[better], err[better]
        from_iterations |= better
        if it % check == 0:
            moved = float(((codes != last) & keep).sum()) / kept
            last = codes
            moves.append(moved)
            if moved < solver.stop:
                break
            grow = growth[1] if moved < solver.settle else growth[0]
            rho *= grow
            U /= grow  # scaled dual: rho * U unchanged
    out = best.to(w.device, w.dtype)
    return AdmmSolve(out, keep.to(w.device), out, it, rho, moves, float(from_iterations.float().mean()))
