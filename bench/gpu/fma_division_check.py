"""Is v * RN(1/s) plus one FMA correction step exactly RN(v / s)? Checked in float32 on the CPU.

The torch-cuda kernels divide by the activation scale this way (holoserve/backends/torch_cuda/kernels.py,
`_codes`): q0 = v * inv, q = fma(fma(q0, -s, v), inv, q0), with inv = RN(1/s). Markstein's theorem makes
that the correctly rounded quotient. The exception is a scale whose significand is all ones, which the
kernels send to the plain division; so is underflow (a quotient below about 2**-100, whose correction
term is subnormal), where the int8 code is 0 either way. This script counts mismatches against IEEE
float32 division, of the quotient (where |v| <= 256 s and the quotient is at least 2**-100) and of the
int8 codes (everywhere):
- for random scales;
- for all-ones-significand scales (expected to fail, which shows the check can fail);
- for every finite FP16 value, normal-distributed values and random bit patterns.
The FMA is emulated with one rounding: the exact product and sum in extended precision, then to float32.
Values are clamped to +-256 s first, as in the kernels, which keeps v * (1/s) finite and changes no code.

    python -m bench.gpu.fma_division_check [--scales 200] [--per-scale 300000]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

F32 = np.float32


def fma(a, b, c):
    """float32 fused multiply-add with one rounding (the product is exact in the 64-bit significand)."""
    return (a.astype(np.longdouble) * b.astype(np.longdouble) + c.astype(np.longdouble)).astype(F32)


def fma_divide(v: np.ndarray, s: F32) -> np.ndarray:
    lim = F32(s * F32(256.0))
    v = np.clip(v, -lim, lim)  # as the kernels: no code changes, and v * (1/s) stays finite
    inv = np.divide(F32(1.0), s, dtype=F32)
    q0 = (v * inv).astype(F32)
    ss, ii = np.full_like(v, s), np.full_like(v, inv)
    return fma(fma(q0, -ss, v), ii, q0)


def codes(q: np.ndarray) -> np.ndarray:
    """int8 codes of quotients: saturate, then round half to even (the kernels' order)."""
    return np.rint(np.clip(np.nan_to_num(q, nan=0.0), -128.0, 127.0)).astype(np.int8)


def all_ones(s: F32) -> bool:
    return int(np.array([s], F32).view(np.uint32)[0] & 0x7FFFFF) == 0x7FFFFF


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.fma_division_check", description=__doc__.splitlines()[0])
    ap.add_argument("--scales", type=int, default=200, help="random scales in [1e-4, 2]")
    ap.add_argument("--per-scale", type=int, default=300_000, help="random values per scale (twice: normal, bits)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    every_half = np.arange(65536, dtype=np.uint16).view(np.float16).astype(F32)
    every_half = every_half[np.isfinite(every_half)]
    scales = list(rng.uniform(1e-4, 2.0, args.scales).astype(F32))
    scales += [np.nextafter(F32(m * 2.0 ** -k), F32(0)) for m in (1, 3) for k in range(14)]  # all-ones significands
    out = {"ordinary": [0, 0, 0, 0], "all_ones_significand": [0, 0, 0, 0]}
    with np.errstate(all="ignore"):
        for s in scales:
            s = F32(s)
            bits = (rng.integers(0, 0x7F000000, args.per_scale, dtype=np.uint32).view(F32)
                    * rng.choice([F32(1), F32(-1)]))
            v = np.concatenate([every_half,
                                rng.standard_normal(args.per_scale).astype(F32) * F32(rng.uniform(0.01, 60)),
                                bits])
            want = np.divide(v, s, dtype=F32)
            got = fma_divide(v, s)
            # quotients compared where the clamp leaves v alone and the correction term is not subnormal
            ok = np.isfinite(want) & (np.abs(want) >= F32(2.0 ** -100)) & (np.abs(v) <= s * F32(256.0))
            key = "all_ones_significand" if all_ones(s) else "ordinary"
            out[key][0] += int((ok & (want != got)).sum())
            out[key][1] += int(ok.sum())
            out[key][2] += int((codes(want) != codes(got)).sum())
            out[key][3] += int(v.size)
    print(json.dumps({k: {"quotient_mismatches": a, "quotients": b, "code_mismatches": c, "codes": d}
                      for k, (a, b, c, d) in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
