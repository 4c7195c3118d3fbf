"""HoloServe's own 2:4 INT8 kernels for OpenVINO's CPU plugin: an OpenVINO extension (C++, AVX-512 VNNI +
VBMI) whose Linears skip the zeros of the 2:4 weights, and the rewrite of the `openvino` export that uses it.

No runtime uses 2:4 zeros on a CPU without AMX: OpenVINO's sparse-weight decompression needs AMX, and its
int8 GEMM otherwise multiplies the zeros too. Ours keeps two of every four weights and gathers the
matching activation bytes with VPERMB, so one VPDPBUSD does the work of two
(docs/results/2026-11-27-sparse24-kernels.md). The rewrite replaces, in the ONNX graph:

- the Linears that share one quantized input (Q, K and V) with one `holoserve.Sparse24Gemm` node that
  quantizes the input once;
- each FFN (Linear, exact GELU or ReLU, QuantizeLinear, Linear) with one `holoserve.Sparse24Ffn` node that
  keeps the hidden layer as uint8 codes in cache;
- any other 2:4 Linear with a one-output `Sparse24Gemm`.

A Linear is taken only where the graph is exactly QuantizeLinear (uint8, zero point 128) ->
DequantizeLinear -> MatMul with int8 weights (zero points 0, at most two non-zeros in each aligned group of
four along the input) -> Add of a bias, with the input width a multiple of 64 and the output width a
multiple of 32; anything else stays as it was.

The extension is built from `sparse24_gemm.cpp` with the C++ compiler (`CXX`, else `g++`) against the
installed OpenVINO's headers, once per source and OpenVINO version, into
`$HOLOSERVE_KERNEL_CACHE` (default `~/.cache/holoserve/kernels`); `python -m holoserve.kernels build`
does it ahead of time (for a machine or image that has OpenVINO but no compiler at serving time).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from holoserve import HoloServeError
from holoserve.core.machine import cpu_flags

SOURCE = Path(__file__).with_name("sparse24_gemm.cpp")
LIBRARY = "libholoserve_sparse24.so"
DOMAIN = "holoserve"
TILE, WINDOW = 32, 64
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512vbmi")
# portable across CPUs with the required flags, so a library built in one place runs in another
CXXFLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi",
            "-Wno-uninitialized", "-Wno-maybe-uninitialized")


class KernelsUnavailable(HoloServeError):
    """The kernels cannot run here (CPU, compiler or OpenVINO missing); the message says which."""


def cpu_missing() -> list[str]:
    """The CPU flags the kernels need that this CPU lacks (empty: it can run them)."""
    flags = cpu_flags()
    return [f for f in REQUIRED_FLAGS if f not in flags]


def _openvino_dir() -> Path:
    try:
        import openvino
    except ImportError as e:
        raise KernelsUnavailable(f"OpenVINO is not installed ({e}): pip install 'holoserve[openvino]'") from None
    return Path(openvino.__file__).parent


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise KernelsUnavailable(f"no C++ compiler {cxx!r} to build the 2:4 kernels: install g++ (or set CXX), "
                                 "or run without them (--openvino-kernels off)")
    return path


def _cache_dir() -> Path:
    root = os.environ.get("HOLOSERVE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "holoserve" / "kernels"


def library_path() -> Path:
    """Where the library for this source, OpenVINO version and flags lives (built or not)."""
    import openvino

    key = hashlib.sha256(SOURCE.read_bytes() + "\0".join([openvino.__version__, *CXXFLAGS]).encode())
    return _cache_dir() / key.hexdigest()[:16] / LIBRARY


def build(verbose: bool = False) -> Path:
    """The extension's path, compiled first if this source, OpenVINO and compiler have no build yet.
    The library is written under a temporary name and renamed, so a reader sees none or all of it."""
    missing = cpu_missing()
    if missing:
        raise KernelsUnavailable(f"this CPU lacks {', '.join(missing)}, which the 2:4 kernels need "
                                 "(AVX-512 VNNI and VBMI); run without them (--openvino-kernels off)")
    ov_dir = _openvino_dir()
    target = library_path()
    if target.is_file():
        return target
    libs = {name: sorted((ov_dir / "libs").glob(f"{name}.so*"), key=lambda p: len(p.name))
            for name in ("libopenvino", "libtbb")}
    if not (ov_dir / "include" / "openvino").is_dir() or not all(libs.values()):
        raise KernelsUnavailable(f"this OpenVINO install ({ov_dir}) has no headers or libopenvino to build the "
                                 "2:4 kernels against: pip install 'holoserve[openvino]'")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise KernelsUnavailable(f"cannot write the 2:4 kernels' build to {target.parent} ({e.strerror}): set "
                                 "HOLOSERVE_KERNEL_CACHE to a writable folder") from None
    cmd = [_compiler(), *CXXFLAGS, f"-I{ov_dir / 'include'}", str(SOURCE), "-o", tmp,
           f"-L{ov_dir / 'libs'}", *(f"-l:{found[-1].name}" for found in libs.values())]
    if verbose:
        print("building the 2:4 kernels:", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise KernelsUnavailable("building the 2:4 kernels failed:\n" + proc.stderr[-2000:])
    os.replace(tmp, target)
    return target


# ---------------------------------------------------------------------------------------------- packing

def pack_24(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 weights [K, N], 2:4 along K -> (values [N/32, K/8, 32, 4] int8, index (same shape, uint8: each
    value's k within its 64-k window), comp [N] int32 = 128 * column sums). Groups with fewer than two
    non-zeros keep zeros in the free slots."""
    K, N = w.shape
    if K % WINDOW or N % TILE:
        raise ValueError(f"a {K}x{N} Linear: the kernels need K a multiple of {WINDOW} and N of {TILE}")
    g = w.reshape(K // 4, 4, N)
    nonzero = g != 0
    if (nonzero.sum(1) > 2).any():
        raise ValueError("weights are not 2:4 along the input")
    slots = np.sort(np.argsort(~nonzero, axis=1, kind="stable")[:, :2, :], axis=1)  # non-zeros first
    values = np.take_along_axis(g, slots, axis=1).reshape(K // 8, 4, N)
    k = ((4 * np.arange(K // 4)[:, None, None] + slots) % WINDOW).reshape(K // 8, 4, N)

    def tiles(a: np.ndarray, dtype) -> np.ndarray:  # [K/8, 4, N] -> [N/32, K/8, 32, 4]
        return np.ascontiguousarray(a.transpose(2, 0, 1).reshape(N // TILE, TILE, K // 8, 4)
                                    .transpose(0, 2, 1, 3), dtype=dtype)

    comp = (128 * w.astype(np.int64).sum(0)).astype(np.int32)
    return tiles(values, np.int8), tiles(k, np.uint8), comp


def unpack_24(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The int8 [K, N] weights `pack_24` packed (its inverse, for checks)."""
    tiles, chunks = values.shape[:2]
    K, N = chunks * 8, tiles * TILE
    w = np.zeros((K, N), np.int8)
    v = values.transpose(0, 2, 1, 3).reshape(N, K // 8, 4)
    i = index.transpose(0, 2, 1, 3).reshape(N, K // 8, 4).astype(np.int64)
    k = (np.arange(K // 8)[None, :, None] * 8 // WINDOW) * WINDOW + i
    np.add.at(w, (k.reshape(N, -1), np.repeat(np.arange(N), K // 2).reshape(N, -1)), v.reshape(N, -1))
    return w
