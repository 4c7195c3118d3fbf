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
- any other 2:4 Linear with a one-output `Sparse24Gemm`;
- each attention block (per-head views of Q, K and V, scaled scores plus the mask, softmax, the weighted sum of
  V, the heads merged back) with one `holoserve.Attention` node that runs it in f32 per head, where
  OpenVINO's own attention on AVX-512 without AMX takes longer
  (docs/results/2026-11-30-attention-kernel.md).

A Linear is taken only where the graph is exactly QuantizeLinear (uint8, zero point 128) ->
DequantizeLinear -> MatMul with int8 weights (zero points 0, at most two non-zeros in each aligned group of
four along the input) -> Add of a bias, with the input width a multiple of 64 and the output width a
multiple of 32; anything else stays as it was.

Building and loading are separate steps. `build()` compiles `sparse24_gemm.cpp` with the C++ compiler
(`CXX`, else `g++`) against the installed OpenVINO's headers; the output ISA is fixed by CXXFLAGS, so any
x86-64 machine with a compiler can build it (an image's builder stage, a CI runner) whatever its CPU.
`locate()` finds the library to load and checks this CPU's flags first. The `reference` flavour compiles
the same source as portable scalar code (any x86-64 CPU, the same outputs bit for bit, many times slower):
`--openvino-kernels reference` runs it, to check the ops, the rewrite and a checkpoint's numbers on a machine
that cannot run the AVX-512 build, and the tests check that build against it. Builds live in
`$HOLOSERVE_KERNEL_CACHE` (default `~/.cache/holoserve/kernels`), one folder per build key (source,
OpenVINO version, flags, compiler, C library), each with a `build.json` saying what it was built from;
a machine without a compiler loads any build whose key matches on everything but the compiler. Concurrent
builds (`serve --workers N`, several services on one cache) are serialised by a file lock; a killed or
failed build leaves no library behind. `python -m holoserve.kernels build` builds ahead of serving.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from holoserve import HoloServeError
from holoserve.core.machine import cpu_flags

log = logging.getLogger("holoserve.kernels")

SOURCE = Path(__file__).with_name("sparse24_gemm.cpp")
LIBRARY = "libholoserve_sparse24.so"
BUILD_INFO = "build.json"
LOCK = ".build.lock"
CACHE_ENV = "HOLOSERVE_KERNEL_CACHE"
DOMAIN = "holoserve"
TILE, WINDOW = 32, 64
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512vbmi")
AVX512, REFERENCE = "avx512", "reference"  # the served build; the portable scalar one that checks it
FLAVOURS = (AVX512, REFERENCE)
# portable across CPUs with the required flags, so a library built in one place runs in another
CXXFLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi",
            "-Wno-uninitialized", "-Wno-maybe-uninitialized")
# any x86-64 CPU; no contraction into fused multiply-adds the AVX-512 code does not make
REFERENCE_CXXFLAGS = ("-O2", "-std=c++20", "-shared", "-fPIC", "-march=x86-64", "-ffp-contract=off",
                      "-DHOLOSERVE_REFERENCE")


class KernelsUnavailable(HoloServeError):
    """The kernels cannot run here (CPU, compiler, build or OpenVINO missing); the message says which."""


def cpu_missing() -> list[str]:
    """The CPU flags the kernels need that this CPU lacks (empty: it can run them)."""
    flags = cpu_flags()
    return [f for f in REQUIRED_FLAGS if f not in flags]


def check_cpu() -> None:
    """Raises KernelsUnavailable where this CPU cannot run the kernels."""
    missing = cpu_missing()
    if missing:
        raise KernelsUnavailable(f"this CPU lacks {', '.join(missing)}, which the 2:4 kernels need "
                                 "(AVX-512 VNNI and VBMI); run without them (--openvino-kernels off)")


def _openvino_dir() -> Path:
    try:
        import openvino
    except ImportError as e:
        raise KernelsUnavailable(f"OpenVINO is not installed ({e}): pip install 'holoserve[openvino]'") from None
    return Path(openvino.__file__).parent


def _compiler() -> str | None:
    """The C++ compiler's path, or None where there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _no_compiler(flavour: str = AVX512) -> KernelsUnavailable:
    cxx = os.environ.get("CXX", "g++")
    which, command = ("", "build") if flavour == AVX512 else (f"{flavour} ", f"build {flavour}")
    return KernelsUnavailable(f"no {which}build of the 2:4 kernels for this OpenVINO in {cache_dir()} and no C++ "
                              f"compiler {cxx!r} to build one: install g++ (or set CXX) and run `python -m "
                              f"holoserve.kernels {command}`, point HOLOSERVE_KERNEL_CACHE at a folder with a build, "
                              "or run without them (--openvino-kernels off)")


@functools.lru_cache(maxsize=8)
def _compiler_id(cxx: str) -> str:
    """The compiler's version line and target triple: part of the build key, so a new compiler rebuilds."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        target = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelsUnavailable(f"the C++ compiler {cxx!r} does not run ({e}): install g++ or set CXX") from None
    return f"{(version.splitlines() or ['?'])[0].strip()} ({target.strip() or '?'})"


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "holoserve" / "kernels"


def _cxxflags(flavour: str) -> tuple[str, ...]:
    if flavour not in FLAVOURS:
        raise KernelsUnavailable(f"unknown build of the 2:4 kernels {flavour!r}: choose {' or '.join(FLAVOURS)}")
    return CXXFLAGS if flavour == AVX512 else REFERENCE_CXXFLAGS


def build_key(compiler: str | None, flavour: str = AVX512) -> dict[str, str]:
    """What a build depends on; `compiler` None leaves the compiler out (for matching without one)."""
    import openvino

    libc = " ".join(platform.libc_ver()).strip() or "unknown libc"
    key = {"source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(), "openvino": openvino.__version__,
           "flavour": flavour, "cxxflags": " ".join(_cxxflags(flavour)), "libc": libc, "machine": platform.machine()}
    if compiler is not None:
        key["compiler"] = compiler
    return key


def _key_dir(key: dict[str, str]) -> Path:
    return cache_dir() / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _matching_builds(key: dict[str, str]) -> list[Path]:
    """Libraries in the cache whose build.json matches `key` on each of its fields, newest first."""
    found = []
    for info in cache_dir().glob(f"*/{BUILD_INFO}"):
        try:
            recorded = json.loads(info.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        lib = info.parent / LIBRARY
        if isinstance(recorded, dict) and all(recorded.get(k) == v for k, v in key.items()) and lib.is_file():
            found.append(lib)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def library_path(flavour: str = AVX512) -> Path | None:
    """The build this machine would load now (built or not, with a compiler; None without a compiler and
    no matching build)."""
    cxx = _compiler()
    if cxx is not None:
        return _key_dir(build_key(_compiler_id(cxx), flavour)) / LIBRARY
    found = _matching_builds(build_key(None, flavour))
    return found[0] if found else None


def locate(flavour: str = AVX512) -> Path:
    """The library to load here: checks the CPU (the AVX-512 build's flags), then takes this compiler's build
    (building it if needed) or, without a compiler, a matching prebuilt one. Raises KernelsUnavailable saying
    why not."""
    if flavour == AVX512:
        check_cpu()
    _openvino_dir()
    if _compiler() is None:
        found = _matching_builds(build_key(None, flavour))
        if not found:
            raise _no_compiler(flavour)
        return found[0]
    return build(flavour=flavour)


# x86-64-v4, the level the library is compiled for (CXXFLAGS): its every function may use these
V4_FLAGS = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_LOAD = "import sys, openvino as ov; ov.Core().add_extension(sys.argv[1])"
# openvino imported first: its libraries are what the library links against
_LINK = "import ctypes, sys, openvino; ctypes.CDLL(sys.argv[1]).create_extensions"


def _check_loads(path: str | os.PathLike, flavour: str = AVX512) -> None:
    """Raises KernelsUnavailable where the library does not load. Checked in a child process: OpenVINO loads it
    and calls its entry point where this CPU has x86-64-v4 (loading runs none of the code that needs VBMI) or
    the build is the portable reference; elsewhere that entry point would stop the process with an illegal
    instruction, so the check is that the library links against this OpenVINO and exports the entry point (a
    builder need not run the kernels)."""
    from holoserve.core import machine

    code = _LOAD if flavour == REFERENCE or set(V4_FLAGS) <= machine.cpu_flags() else _LINK
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelsUnavailable(f"cannot check the 2:4 kernels' library {path} ({e})") from None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        raise KernelsUnavailable(f"OpenVINO cannot load the 2:4 kernels' library {path}: {lines[-1][:300]}")


def build(verbose: bool = False, flavour: str = AVX512) -> Path:
    """The extension's path, compiled first if this source, OpenVINO and compiler have no build yet. Needs
    a compiler, not a CPU that runs the kernels. Builds are serialised by a lock in the cache folder; the
    library is written under a temporary name and renamed, and a failed or interrupted build is removed."""
    ov_dir = _openvino_dir()
    cxx = _compiler()
    if cxx is None:
        raise _no_compiler(flavour)
    key = build_key(_compiler_id(cxx), flavour)
    folder = _key_dir(key)
    target = folder / LIBRARY
    if target.is_file():
        return target
    libs = {name: sorted((ov_dir / "libs").glob(f"{name}.so*"), key=lambda p: len(p.name))
            for name in ("libopenvino", "libtbb")}
    if not (ov_dir / "include" / "openvino").is_dir() or not all(libs.values()):
        raise KernelsUnavailable(f"this OpenVINO install ({ov_dir}) has no headers or libopenvino to build the "
                                 "2:4 kernels against: pip install 'holoserve[openvino]'")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir() / LOCK, "a")
    except OSError as e:
        raise KernelsUnavailable(f"cannot write the 2:4 kernels' build to {folder} ({e.strerror}): set "
                                 f"{CACHE_ENV} to a writable folder") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        if target.is_file():  # another process built it while this one waited
            return target
        for stale in cache_dir().glob("*/.build-*"):  # left by a build that was killed: no build runs now
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
        os.close(fd)
        cmd = [cxx, *_cxxflags(flavour), f"-I{ov_dir / 'include'}", str(SOURCE), "-o", tmp,
               f"-L{ov_dir / 'libs'}", *(f"-l:{found[-1].name}" for found in libs.values())]
        log.info("building the 2:4 kernels (%s) once for OpenVINO %s with %s into %s (about a minute)",
                 flavour, key["openvino"], key["compiler"], folder)
        if verbose:
            print("building the 2:4 kernels:", " ".join(cmd), flush=True)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise KernelsUnavailable("building the 2:4 kernels failed:\n" + proc.stderr[-2000:])
            info_tmp = folder / f".build-{os.getpid()}.json"
            info_tmp.write_text(json.dumps({**key, "built_s": round(time.monotonic() - t0, 1)}, indent=1),
                                encoding="utf-8")
            _check_loads(tmp, flavour)
            os.replace(tmp, target)
            os.replace(info_tmp, folder / BUILD_INFO)
        finally:
            Path(tmp).unlink(missing_ok=True)
            for leftover in folder.glob(f".build-{os.getpid()}.json"):
                leftover.unlink(missing_ok=True)
        log.info("built the 2:4 kernels in %.0f s: %s", time.monotonic() - t0, target)
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
