"""The fused Triton kernels of the serving path: activation quantizers fused with what precedes them.

One kernel for the activation quantizer reads FP16 and writes int8 codes (3 bytes per element
instead of ~35 for the five separate torch ops: float, div, round, clamp, cast), which matters
because every encoder GEMM input passes through it; two more fuse it with the FFN's GELU and with
residual add + LayerNorm, so that no FP16 intermediate is written just to be re-read and quantized.
Same arithmetic as numerics.quantize_activation: the correctly rounded quotient by the scale (computed
through one FMA correction step on the GPU, see _codes), saturation, then round half to even via the
1.5 * 2**23 trick (exact for |q| <= 2**22, and saturating first gives the same codes as rounding first).

Triton is imported on first use; where it is missing (or incompatible) the wrappers raise and the
backend keeps the torch-op quantizer (probe.choose_quantizer decides, on the device).
"""
from __future__ import annotations

import os
from typing import Any

from ._torch import torch
from .numerics import quantize_activation

_TRITON: dict[str, Any] = {}
QUANT_BLOCK = 2048


def _triton_quant_kernel():
    if "kernel" in _TRITON or "error" in _TRITON:
        return _TRITON.get("kernel")
    try:
        import triton
        import triton.language as tl

        # (a @triton.jit body sees module globals only, so tl.div_rn is named directly: IEEE division)
        # The saturation bounds -128.0 / 127.0 are ACT_QMIN / ACT_QMAX of holoserve.core.numerics,
        # spelled as literals because the kernel bodies need compile-time constants.
        # _gelu_quant is bound by the instructions it issues, so the division below costs as few instructions
        # as the exact arithmetic allows; why: docs/results/2026-11-26-gpu-h200.md
        @triton.jit
        def _codes(v, s, FMA_DIV: tl.constexpr, SCALE_CHECK: tl.constexpr = True):
            # round-half-even(clamp(v / s)) with v / s correctly rounded (IEEE), as the reference.
            # FMA_DIV: v * RN(1/s) corrected by one fused multiply-add step (Markstein), which gives
            # RN(v / s) for every v unless the significand of s is all ones (the theorem's exception);
            # such a scale takes the plain division. Without a hardware FMA (Triton's CPU interpreter
            # rounds a*b+c twice) the plain division is used throughout. v is first clamped to
            # +-256 s, which changes no code (those quotients saturate anyway) and keeps v * (1/s) finite;
            # a scale under 2**-100 (zero included) takes the plain division too. Checked in float32 by
            # bench/gpu/fma_division_check.py. (SCALE_CHECK=False only for bench/gpu/kernel_instructions.py,
            # to count the path an ordinary scale takes.)
            if FMA_DIV:
                if SCALE_CHECK and (((s.to(tl.uint32, bitcast=True) & 0x7FFFFF) == 0x7FFFFF) | (s < 7.9e-31)):
                    q = tl.div_rn(v, s)
                else:
                    lim = s * 256.0
                    v = tl.minimum(tl.maximum(v, -lim), lim)
                    inv = tl.div_rn(1.0, s)
                    q0 = v * inv
                    q = tl.fma(tl.fma(q0, -s, v), inv, q0)  # -s: one negation per program
            else:
                q = tl.div_rn(v, s)
            q = tl.minimum(tl.maximum(q, -128.0), 127.0)
            q = (q + 12582912.0) - 12582912.0
            return q.to(tl.int8)

        @triton.jit
        def _quant_block(x_ptr, out_ptr, scale_ptr, n, BLOCK: tl.constexpr, FMA_DIV: tl.constexpr,
                         SCALE_CHECK: tl.constexpr, GELU: tl.constexpr):
            # one block of BLOCK elements: codes of x, or of the exact (erf) GELU of x
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            if GELU:
                x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
            tl.store(out_ptr + offs, _codes(x, tl.load(scale_ptr), FMA_DIV, SCALE_CHECK), mask=m)

        @triton.jit
        def _quant(x_ptr, out_ptr, scale_ptr, n, BLOCK: tl.constexpr, FMA_DIV: tl.constexpr,
                   SCALE_CHECK: tl.constexpr = True):
            _quant_block(x_ptr, out_ptr, scale_ptr, n, BLOCK, FMA_DIV, SCALE_CHECK, False)

        @triton.jit
        def _gelu_quant(x_ptr, out_ptr, scale_ptr, n, BLOCK: tl.constexpr, FMA_DIV: tl.constexpr,
                        SCALE_CHECK: tl.constexpr = True):
            # GELU of the FFN's first GEMM, quantized for the second: the FP16 GELU output never goes
            # to memory (a kernel of its own, so that profiles tell it from the plain quantizer)
            _quant_block(x_ptr, out_ptr, scale_ptr, n, BLOCK, FMA_DIV, SCALE_CHECK, True)

        @triton.jit
        def _ln_load(x_ptr, r_ptr, off, cols, m, HAS_RES: tl.constexpr):
            # one chunk of x + r, rounded to FP16 as the torch ops' FP16 sum is, in float32
            x = tl.load(x_ptr + off + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_RES:
                x = (x + tl.load(r_ptr + off + cols, mask=m, other=0.0).to(tl.float32)).to(tl.float16).to(tl.float32)
            return x

        @triton.jit
        def _ln_store(xc, rstd, w_ptr, b_ptr, h_ptr, q_ptr, scale_ptr, base, off, cols, m, HAS_Q: tl.constexpr,
                      FMA_DIV: tl.constexpr, SCALE_CHECK: tl.constexpr):
            # one chunk of h = (x - mean) * rstd * w + b in FP16, and its int8 codes
            w = tl.load(w_ptr + off + cols, mask=m, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + off + cols, mask=m, other=0.0).to(tl.float32)
            yh = (xc * rstd * w + b).to(tl.float16)
            tl.store(h_ptr + base + off + cols, yh, mask=m)
            if HAS_Q:
                codes = _codes(yh.to(tl.float32), tl.load(scale_ptr), FMA_DIV, SCALE_CHECK)
                tl.store(q_ptr + base + off + cols, codes, mask=m)

        # the kernels find these helpers (and tl, in their signatures) as module globals when they compile,
        # as Triton requires
        globals().update(tl=tl, _codes=_codes, _quant_block=_quant_block, _ln_load=_ln_load, _ln_store=_ln_store)

        @triton.jit
        def _add_ln_quant(x_ptr, r_ptr, w_ptr, b_ptr, h_ptr, q_ptr, scale_ptr, H, eps,
                          HAS_RES: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr, FMA_DIV: tl.constexpr,
                          SCALE_CHECK: tl.constexpr = True, CHUNKS: tl.constexpr = 1):
            # one row: h = LayerNorm(x + r) in FP16 (the residual stream) and, for the next GEMM,
            # the int8 codes of h; the same roundings as the separate torch ops (FP16 sum, FP16 h).
            # CHUNKS=3: the row is three chunks of BLOCK (H = 3 * 2**k, as 384 and 768), so no lane idles;
            # CHUNKS=1: one block of the next power of two >= H, the lanes past H masked.
            base = tl.program_id(0).to(tl.int64) * H
            cols = tl.arange(0, BLOCK)
            if CHUNKS == 1:
                m = cols < H
                x0 = _ln_load(x_ptr, r_ptr, base, cols, m, HAS_RES)
                mean = tl.sum(x0, axis=0) / H
                xc0 = tl.where(m, x0 - mean, 0.0)
                rstd = 1.0 / tl.sqrt(tl.sum(xc0 * xc0, axis=0) / H + eps)
                _ln_store(xc0, rstd, w_ptr, b_ptr, h_ptr, q_ptr, scale_ptr, base, 0, cols, m, HAS_Q, FMA_DIV,
                          SCALE_CHECK)
            else:
                m = cols < BLOCK
                x0 = _ln_load(x_ptr, r_ptr, base, cols, m, HAS_RES)
                x1 = _ln_load(x_ptr, r_ptr, base + BLOCK, cols, m, HAS_RES)
                x2 = _ln_load(x_ptr, r_ptr, base + 2 * BLOCK, cols, m, HAS_RES)
                mean = (tl.sum(x0, axis=0) + tl.sum(x1, axis=0) + tl.sum(x2, axis=0)) / H
                xc0, xc1, xc2 = x0 - mean, x1 - mean, x2 - mean
                var = (tl.sum(xc0 * xc0, axis=0) + tl.sum(xc1 * xc1, axis=0) + tl.sum(xc2 * xc2, axis=0)) / H
                rstd = 1.0 / tl.sqrt(var + eps)
                _ln_store(xc0, rstd, w_ptr, b_ptr, h_ptr, q_ptr, scale_ptr, base, 0, cols, m, HAS_Q, FMA_DIV,
                          SCALE_CHECK)
                _ln_store(xc1, rstd, w_ptr, b_ptr, h_ptr, q_ptr, scale_ptr, base, BLOCK, cols, m, HAS_Q, FMA_DIV,
                          SCALE_CHECK)
                _ln_store(xc2, rstd, w_ptr, b_ptr, h_ptr, q_ptr, scale_ptr, base, 2 * BLOCK, cols, m, HAS_Q, FMA_DIV,
                          SCALE_CHECK)

        @triton.jit
        def _table_quant(x_ptr, out_ptr, table_ptr, n, BLOCK: tl.constexpr):
            # codes by lookup: x is FP16 read as its 16 bits (int16), the table holds the code of every
            # FP16 value (activation_code_table): one gather per element instead of erf and a division
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            bits = tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32) & 0xFFFF
            tl.store(out_ptr + offs, tl.load(table_ptr + bits, mask=m, other=0), mask=m)

        _TRITON["kernel"] = _quant
        _TRITON["gelu_kernel"] = _gelu_quant
        _TRITON["table_kernel"] = _table_quant
        _TRITON["ln_kernel"] = _add_ln_quant
        _TRITON["next_pow2"] = triton.next_power_of_2
        _TRITON["cdiv"] = triton.cdiv
    except Exception as e:  # noqa: BLE001 - no triton (or an incompatible one): torch ops are used
        _TRITON["error"] = f"{type(e).__name__}: {e}"
    return _TRITON.get("kernel")


def _require_triton() -> None:
    if _triton_quant_kernel() is None:
        raise RuntimeError(f"triton is unavailable: {_TRITON.get('error')}")


def triton_kernels() -> dict[str, Any]:
    """The Triton kernels and launch helpers by name (kernel, gelu_kernel, table_kernel, ln_kernel, next_pow2,
    cdiv), compiled on first use; RuntimeError saying why when Triton is unavailable."""
    _require_triton()
    return dict(_TRITON)


FMA_DIVISION = True  # bench/gpu/run.py turns it off for one encoder variant, to time the plain division beside it
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # Triton reads it at start-up too


def fma_div() -> bool:
    """Whether the kernels divide by the scale through a fused multiply-add (exact with a hardware FMA):
    not in Triton's CPU interpreter (TRITON_INTERPRET=1), whose fma rounds twice."""
    return FMA_DIVISION and not _INTERPRETED


def _codes_out(x: "torch.Tensor", rows: int | None) -> tuple["torch.Tensor", "torch.Tensor", int]:
    """(x contiguous, an int8 [rows, k] output whose rows past x's are zero, x's element count)."""
    _require_triton()
    x = x.contiguous()
    m, k = x.shape
    rows = rows or m
    out = torch.empty((rows, k), dtype=torch.int8, device=x.device)
    if rows > m:
        out[m:].zero_()
    return x, out, m * k


def quantize_activation_triton(x: "torch.Tensor", scale: "torch.Tensor", rows: int | None = None,
                               gelu: bool = False) -> "torch.Tensor":
    """quantize_activation (of GELU(x) with gelu=True) as one Triton kernel; `rows` >= x.shape[0]
    pads the result with zero rows."""
    x, out, n = _codes_out(x, rows)
    kernel = _TRITON["gelu_kernel" if gelu else "kernel"]
    kernel[(_TRITON["cdiv"](n, QUANT_BLOCK),)](x, out, scale.reshape(1), n, BLOCK=QUANT_BLOCK, FMA_DIV=fma_div())
    return out


def activation_code_table(act, scale: "torch.Tensor") -> "torch.Tensor":
    """The int8 code of act(x) for each of the 65,536 FP16 bit patterns x, indexed by the pattern (64 KiB):
    quantize_activation(act(x in float32)), the torch reference of the fused GELU kernel, exactly. A NaN
    activation gets code 0 (a NaN input; torch's GELU of +-inf is NaN too); ReLU(+inf) saturates to 127.
    The table is built on the scale's device."""
    every = torch.arange(65536, dtype=torch.int32, device=scale.device).to(torch.int16).view(torch.float16)
    return quantize_activation(act(every.float()).nan_to_num(nan=0.0), scale).contiguous()


def quantize_by_table(x: "torch.Tensor", table: "torch.Tensor", rows: int | None = None) -> "torch.Tensor":
    """table[bits of each FP16 element of x] as one Triton kernel (x FP16 [m, k], table from
    activation_code_table); `rows` >= m pads the result with zero rows."""
    if x.dtype != torch.float16 or table.dtype != torch.int8 or table.numel() != 65536:
        raise ValueError(f"quantize_by_table needs FP16 input and a 65,536-entry int8 table, got {x.dtype} and "
                         f"{table.dtype}[{table.numel()}]")
    x, out, n = _codes_out(x, rows)
    _TRITON["table_kernel"][(_TRITON["cdiv"](n, QUANT_BLOCK),)](x.view(torch.int16), out, table, n, BLOCK=QUANT_BLOCK)
    return out


def ln_blocks(hdim: int) -> dict[str, int]:
    """_add_ln_quant's row layout and launch: three chunks of a power of two where H = 3 * 2**k (384, 768),
    else one power-of-two block with the lanes past H masked; one warp per row up to 1,024 lanes, so the row's
    reductions stay within the warp; why: docs/results/2026-11-26-gpu-h200.md"""
    third = hdim // 3
    if hdim % 3 == 0 and third >= 16 and third & (third - 1) == 0:
        layout = {"BLOCK": third, "CHUNKS": 3}
    else:
        layout = {"BLOCK": _TRITON["next_pow2"](hdim), "CHUNKS": 1}
    warps = max(1, min(8, layout["BLOCK"] * layout["CHUNKS"] // 1024))
    return layout | {"num_warps": 1 << (warps.bit_length() - 1)}  # a power of two, as Triton requires


def add_layer_norm_quant(x, res, weight, bias, eps: float, scale=None, rows: int | None = None):
    """(LayerNorm(x + res) as FP16 [T, H], its int8 codes [rows, H] or None) in one Triton kernel."""
    _require_triton()
    hdim = x.shape[-1]
    x2 = x.reshape(-1, hdim).contiguous()
    r2 = res.reshape(-1, hdim).contiguous() if res is not None else x2
    t = x2.shape[0]
    h = torch.empty_like(x2)
    q = None
    if scale is not None:
        rows = rows or t
        q = torch.empty((rows, hdim), dtype=torch.int8, device=x.device)
        if rows > t:
            q[t:].zero_()
    _TRITON["ln_kernel"][(t,)](
        x2, r2, weight, bias, h, q if q is not None else h, scale.reshape(1) if scale is not None else weight,
        hdim, float(eps), HAS_RES=res is not None, HAS_Q=scale is not None, FMA_DIV=fma_div(), **ln_blocks(hdim))
    return h, q
