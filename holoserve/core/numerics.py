"""The numerics contract: the INT8 scheme and the N:M pattern, on plain numpy arrays (torch-free).

Every stage uses these definitions; nothing else spells the constants.

Weights (per output channel, symmetric, zero-point 0): w == float32(q) * s[:, None] exactly, with
integer codes q in [-WEIGHT_QMAX, WEIGHT_QMAX]. Zero-preserving, so pruned zeros stay exactly zero.

Activations (per tensor, symmetric, zero-point 0): scale = amax / ACT_SCALE_DIV, codes rounded
half-to-even and saturated to [ACT_QMIN, ACT_QMAX] — what ONNX QuantizeLinear(int8) computes. A
uint8 QuantizeLinear with zero-point UINT8_ZERO_POINT gives the same codes shifted by 128.

N:M (along the input dimension): every group of M consecutive input columns of every row holds at
most N non-zeros.
"""
from __future__ import annotations

import numpy as np

WEIGHT_QMAX = 127
ACT_QMIN, ACT_QMAX = -128, 127
ACT_SCALE_DIV = 127.0
UINT8_ZERO_POINT = 128

# The TensorRT placement quantizes a residual-Add input only if its per-tensor INT8 Q/DQ keeps at least
# this signal-to-noise ratio on the calibration rows' real tokens (export "auto", and TensorRT QAT): it
# separates the FFN-output sides, where one scale over outlier channels rounds most values to zero, from
# every other residual input; why: docs/results/2026-11-24-tensorrt-placement.md
RESIDUAL_MIN_SQNR_DB = 20.0
SQNR_CAP_DB = 120.0  # what a tensor exactly on its grid (or all zeros) gets


def activation_scale(amax: float) -> np.float32:
    """The per-tensor activation scale for a calibrated range, in float32 as QuantizeLinear reads it."""
    return np.float32(amax) / np.float32(ACT_SCALE_DIV)


def int8_error(x: np.ndarray, amax: float) -> tuple[float, float]:
    """(sum of x^2, sum of (x - QDQ(x))^2) for the per-tensor int8 Q/DQ pair with range `amax`; summed over
    batches, `sqnr_db` of the two sums is the tensor's INT8 SQNR."""
    s = activation_scale(amax)
    x = np.asarray(x, dtype=np.float32)
    q = np.clip(np.rint(x / s), ACT_QMIN, ACT_QMAX) * s
    return float(np.square(x, dtype=np.float64).sum()), float(np.square(q - x, dtype=np.float64).sum())


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise), capped at SQNR_CAP_DB, rounded to 0.01 dB."""
    if signal == 0:
        return SQNR_CAP_DB
    return round(min(SQNR_CAP_DB, 10 * float(np.log10(signal / max(noise, signal * 1e-12)))), 2)


def round_codes(w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Round a weight onto its per-row grid: int8 codes clip(rint(w / s), ±WEIGHT_QMAX)."""
    s = np.asarray(scales, dtype=np.float32).reshape(-1, 1)
    q = np.rint(np.asarray(w, dtype=np.float32) / s)
    return np.clip(q, -WEIGHT_QMAX, WEIGHT_QMAX).astype(np.int8)


def grid_codes(w: np.ndarray, scales: np.ndarray) -> np.ndarray | None:
    """The int8 codes q with float32(q) * scale == w exactly, or None if w is not on that grid."""
    w = np.asarray(w, dtype=np.float32)
    s = np.asarray(scales, dtype=np.float32).reshape(-1, 1)
    if w.ndim != 2 or s.shape[0] != w.shape[0] or not np.all(s > 0) or not np.all(np.isfinite(s)):
        return None
    q = np.rint(w / s)
    if np.abs(q).max(initial=0) > WEIGHT_QMAX:
        return None
    if not np.array_equal(q.astype(np.float32) * s, w):
        return None
    return q.astype(np.int8)


def is_on_int8_grid(w: np.ndarray, scales: np.ndarray) -> bool:
    return grid_codes(w, scales) is not None


def nm_violations(w: np.ndarray, n: int = 2, m: int = 4) -> int:
    """Number of groups of m (along the last axis) holding more than n non-zeros; -1 if the shape cannot be N:M."""
    if w.ndim != 2 or w.shape[1] % m:
        return -1
    groups = (w.reshape(w.shape[0], w.shape[1] // m, m) != 0).sum(axis=-1)
    return int((groups > n).sum())


def is_nm_sparse(w: np.ndarray, n: int = 2, m: int = 4) -> bool:
    return nm_violations(w, n, m) == 0


def nm_fraction(w: np.ndarray, n: int = 2, m: int = 4) -> float:
    """Share of groups that already satisfy N:M (1.0 means the whole tensor is N:M sparse)."""
    if w.ndim != 2 or w.shape[1] % m:
        return 0.0
    groups = (w.reshape(w.shape[0], w.shape[1] // m, m) != 0).sum(axis=-1)
    return float((groups <= n).mean())
