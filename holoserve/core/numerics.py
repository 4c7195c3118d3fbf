"""Checks of the two weight constraints on plain numpy arrays (torch-free, used when loading artifacts).

A weight W (out_features x in_features) is N:M sparse along the input dimension when every
group of M consecutive input columns of every row holds at most N non-zeros. It is on the INT8
grid of per-output-channel scales s when W == float32(q) * s[:, None] exactly for integers
q in [-127, 127] (symmetric, zero-point 0, so pruned zeros stay exactly zero).
"""
from __future__ import annotations

import numpy as np

QMAX = 127


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


def int8_codes(w: np.ndarray, scales: np.ndarray) -> np.ndarray | None:
    """The int8 codes q with float32(q) * scale == w exactly, or None if w is not on that grid."""
    w = np.asarray(w, dtype=np.float32)
    s = np.asarray(scales, dtype=np.float32).reshape(-1, 1)
    if w.ndim != 2 or s.shape[0] != w.shape[0] or not np.all(s > 0) or not np.all(np.isfinite(s)):
        return None
    q = np.rint(w / s)
    if np.abs(q).max(initial=0) > QMAX:
        return None
    if not np.array_equal(q.astype(np.float32) * s, w):
        return None
    return q.astype(np.int8)


def is_on_int8_grid(w: np.ndarray, scales: np.ndarray) -> bool:
    return int8_codes(w, scales) is not None
