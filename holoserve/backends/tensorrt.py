"""TensorRT backend: deserialize an engine built for this GPU and run it on a CUDA stream.

The library is imported only when this backend is loaded. Engines are specific to the TensorRT
version and the GPU they were built for, so before deserializing anything the engine's JSON
sidecar (written by `holoserve build-engine`, format in holoserve/core/sidecar.py) is checked
against this machine and a plan built elsewhere is refused with a message that says how to
rebuild it. The sidecar names the runtime that must load it: datacenter TensorRT (libnvinfer,
module `tensorrt`) or TensorRT-RTX (module `tensorrt_rtx`, same Python API, plus its own header
check, `Runtime.get_engine_validity`).

Where the engine comes from, first usable wins:
1. the checkpoint's own engine (manifest exports['tensorrt']);
2. the engine cache, HOLOSERVE_ENGINE_CACHE=DIR (`holoserve build-engine CKPT --cache-dir DIR`): one
   engine per model, TensorRT version and GPU;
3. with HOLOSERVE_BUILD_ENGINE=if-missing, an engine built now into that cache by running
   `holoserve build-engine` in a child process (the GPU image does this on its first start; the
   builder's memory goes back to the system before serving starts).

Device memory comes from cuda-python (`cuda.bindings.runtime`, or the older `cuda.cudart`) or, if
that is absent, from torch. Buffers are sized once from the engine itself: the inputs from the
profile's maximum shape, the output from the shape TensorRT computes for those inputs. `close()`
(also run when the backend is garbage-collected) frees them and the stream.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from ..core import sidecar as engine_sidecar
from holoserve.core.artifact import Artifact
from holoserve.core.manifest import TENSORRT_ENGINE, TENSORRT_ONNX
from .base import BackendUnavailable

log = logging.getLogger("holoserve.backends")

EXPORT_KEY = TENSORRT_ENGINE
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "logits"
LIBRARIES = ("tensorrt", "tensorrt_rtx")
ENGINE_CACHE_ENV = "HOLOSERVE_ENGINE_CACHE"
BUILD_ENV = "HOLOSERVE_BUILD_ENGINE"
BUILD_MODES = ("never", "if-missing")
BUILD_TIMEOUT_S = 3600


# --------------------------------------------------------------------------- where engines are (no library needed)


def engine_files(artifact: Artifact) -> tuple[Path, Path]:
    """The checkpoint's own plan and sidecar; BackendUnavailable (saying how to build one) if absent."""
    entry = artifact.export(EXPORT_KEY)
    if entry is None:
        raise BackendUnavailable(
            f"{artifact.path} has no TensorRT engine (manifest exports['{EXPORT_KEY}'] is missing): "
            f"build one for the serving GPU with `holoserve build-engine {artifact.path}`, or set "
            f"{BUILD_ENV}=if-missing and {ENGINE_CACHE_ENV}=DIR to build it at start-up"
        )
    plan = artifact.path / entry.file
    sidecar = artifact.path / entry.sidecar
    for p in (plan, sidecar):
        if not p.is_file():
            raise BackendUnavailable(
                f"{artifact.path}: the manifest lists {p.name} but the file is missing; "
                f"rebuild with `holoserve build-engine {artifact.path}`"
            )
    return plan, sidecar


def engine_settings(options: Mapping[str, Any] | None = None) -> tuple[Path | None, str]:
    """(engine cache folder or None, build mode) from the backend options or HOLOSERVE_ENGINE_CACHE / _BUILD_ENGINE."""
    options = options or {}
    cache = options.get("engine_cache") or os.environ.get(ENGINE_CACHE_ENV, "").strip() or None
    mode = str(options.get("build_engine") or os.environ.get(BUILD_ENV, "") or "never").strip().lower()
    if mode in ("0", "no", "false", "off"):
        mode = "never"
    if mode not in BUILD_MODES:
        raise BackendUnavailable(f"{BUILD_ENV}={mode!r} is not understood: choose {' or '.join(BUILD_MODES)}")
    if mode == "if-missing" and cache is None:
        raise BackendUnavailable(f"{BUILD_ENV}=if-missing needs {ENGINE_CACHE_ENV}=DIR, a writable folder (a volume) "
                                 "to keep the engine in")
    return (Path(cache) if cache else None), mode


def model_id(artifact: Artifact) -> str | None:
    """The sha256 of the checkpoint's TensorRT-placement ONNX (the engine cache's model key), or None without one."""
    entry = artifact.export(TENSORRT_ONNX)
    if entry is None:
        return None
    files = artifact.manifest.files
    return files[entry.file].sha256 if entry.file in files else None


def engine_candidates(artifact: Artifact, cache: Path | None) -> list[tuple[Path, Path, str]]:
    """(plan, sidecar, where) of every engine this checkpoint could be served with, checkpoint first."""
    found = []
    if artifact.export(EXPORT_KEY) is not None:
        plan, side = engine_files(artifact)
        found.append((plan, side, "the checkpoint"))
    mid = model_id(artifact)
    if cache is not None and mid:
        for plan in engine_sidecar.cached_engines(cache, mid):
            found.append((plan, engine_sidecar.sidecar_path(plan), f"the engine cache ({plan.parent.name})"))
    return found


def engines_on_disk(artifact: Artifact, options: Mapping[str, Any] | None = None) -> list[str]:
    """Names of the engines (checkpoint and cache) `auto` should explain not using; never raises."""
    try:
        cache, _ = engine_settings(options)
    except BackendUnavailable:
        cache = None
    try:
        return [str(plan) for plan, _, _ in engine_candidates(artifact, cache)]
    except BackendUnavailable as e:  # listed in the manifest but missing
        return [str(e)]


def read_sidecar(path: Path) -> dict[str, Any]:
    """The engine's sidecar JSON (format owned by holoserve.core.sidecar), as a BackendUnavailable on error."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BackendUnavailable(f"{path} is not a readable engine sidecar ({e}); rebuild the engine") from None
    if not isinstance(data, dict) or data.get("format") != engine_sidecar.SIDECAR_FORMAT:
        raise BackendUnavailable(f"{path} is not a HoloServe engine sidecar; rebuild with `holoserve build-engine`")
    if int(data.get("version", 0)) > engine_sidecar.SIDECAR_VERSION:
        raise BackendUnavailable(f"{path} has sidecar version {data.get('version')}; upgrade holoserve")
    return data


def runtime_module(sidecar: Mapping[str, Any]) -> tuple[str, str]:
    """(flavour, Python module) that must load this plan: ("tensorrt", "tensorrt") or
    ("tensorrt-rtx", "tensorrt_rtx")."""
    built = sidecar.get("tensorrt") or {}
    flavour = str(built.get("flavour") or "")
    module = str(built.get("module") or flavour.replace("-", "_"))
    if module not in LIBRARIES or flavour not in ("tensorrt", "tensorrt-rtx"):
        raise BackendUnavailable(f"the engine sidecar names an unknown TensorRT flavour {flavour!r}; "
                                 "rebuild the engine")
    return flavour, module


def check_engine(sidecar: Mapping[str, Any], *, flavour: str, version: str, compute_capability: str | None,
                 where: str = "engine", gpu: str | None = None) -> None:
    """Refuse, before deserializing anything, a plan built by another TensorRT or for another GPU."""
    if compute_capability is None:
        raise BackendUnavailable(f"{where}: no CUDA GPU found on this machine; TensorRT engines need one")
    try:
        engine_sidecar.check_compatible(sidecar, flavour=flavour, version=version,
                                        compute_capability=compute_capability, gpu=gpu)
    except engine_sidecar.EngineMismatchError as e:
        raise BackendUnavailable(f"{where}: {e}") from None


# --------------------------------------------------------------------------- machine probes


def current_gpu() -> dict[str, Any] | None:
    """The GPU this process runs on (CUDA's current device, so CUDA_VISIBLE_DEVICES applies), or None."""
    return engine_sidecar.current_gpu()


def gpu_compute_capability() -> str | None:
    """This process's GPU's compute capability ("8.6"), or None without a GPU."""
    gpu = current_gpu()
    return gpu["compute_capability"] if gpu else None


def _cudart():
    return engine_sidecar._cudart()


def import_library(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        hint = ("use the GPU image (docker/Dockerfile.gpu, which has it) or pip install tensorrt-cu12"
                if name == "tensorrt" else
                "pip install tensorrt-rtx-cu12 (CUDA 12 driver) or tensorrt-rtx-cu13 (CUDA 13 driver)")
        raise BackendUnavailable(f"the {name} Python package is not installed ({e}); {hint}") from None


_DIAGNOSTICS = {
    "VERSION_MISMATCH": "it was built by another TensorRT-RTX version",
    "UNSUPPORTED_CC": "it was not built for this GPU's compute capability",
    "OLD_CUDA_DRIVER": "the CUDA driver is too old for it",
    "OLD_CUDA_RUNTIME": "the CUDA runtime is too old for it",
    "INSUFFICIENT_GPU_MEMORY": "the GPU has too little memory for it",
    "MALFORMED_ENGINE": "the file is damaged or not a TensorRT-RTX engine",
    "CUDA_ERROR": "CUDA reported an error while checking it (is the GPU usable from here?)",
}


def rtx_validity(trt, runtime, plan: bytes) -> tuple[str, list[str]]:
    """TensorRT-RTX's header check: ("VALID" | "SUBOPTIMAL" | "INVALID", reasons); ("VALID", []) where absent."""
    check = getattr(runtime, "get_engine_validity", None)
    if check is None:
        return "VALID", []
    validity, diagnostics = check(plan)
    flags = int(diagnostics)
    members = getattr(getattr(trt, "EngineInvalidityDiagnostics", None), "__members__", {})
    reasons = [_DIAGNOSTICS.get(name, name.lower()) for name, m in members.items() if flags & int(m)]
    return str(validity).rsplit(".", 1)[-1], reasons


# --------------------------------------------------------------------------- device memory


class _CudaMem:
    """Minimal device memory + stream via cuda-python's runtime API, or torch as a fallback."""

    def __init__(self) -> None:
        self.cudart = _cudart()
        self.torch = None
        self._buffers: dict[int, Any] = {}
        self._ptrs: list[int] = []
        self.closed = False
        if self.cudart is None:
            try:
                import torch  # only on GPU machines that have torch but not cuda-python
            except ImportError:
                raise BackendUnavailable(
                    "TensorRT needs CUDA memory: install cuda-python (pip install cuda-python) or torch with CUDA"
                ) from None
            if not torch.cuda.is_available():
                raise BackendUnavailable("torch cannot see a CUDA GPU; TensorRT engines need one")
            self.torch = torch
            self._stream = torch.cuda.Stream()
        else:
            self._stream = self._check(self.cudart.cudaStreamCreate())

    def _check(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA runtime error {err}")
        return rest[0] if len(rest) == 1 else (rest or None)

    @property
    def stream_handle(self) -> int:
        return int(self._stream.cuda_stream) if self.torch is not None else int(self._stream)

    def malloc(self, nbytes: int) -> int:
        if self.torch is not None:
            buf = self.torch.empty(max(nbytes, 1), dtype=self.torch.uint8, device="cuda")
            ptr = int(buf.data_ptr())
            self._buffers[ptr] = buf
            return ptr
        ptr = int(self._check(self.cudart.cudaMalloc(max(nbytes, 1))))
        self._ptrs.append(ptr)
        return ptr

    def htod(self, dst: int, src: np.ndarray) -> None:
        src = np.ascontiguousarray(src)
        if self.torch is not None:
            t = self.torch.from_numpy(src.view(np.uint8).reshape(-1))
            with self.torch.cuda.stream(self._stream):
                self._view(dst, src.nbytes).copy_(t, non_blocking=False)
            return
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._check(self.cudart.cudaMemcpyAsync(dst, src.ctypes.data, src.nbytes, kind, self._stream))

    def dtoh(self, dst: np.ndarray, src: int) -> None:
        if self.torch is not None:
            with self.torch.cuda.stream(self._stream):
                host = self._view(src, dst.nbytes).cpu()
            dst.reshape(-1).view(np.uint8)[:] = host.numpy()
            return
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._check(self.cudart.cudaMemcpyAsync(dst.ctypes.data, src, dst.nbytes, kind, self._stream))

    def _view(self, ptr: int, nbytes: int):
        for base, buf in self._buffers.items():
            if base <= ptr < base + buf.numel():
                return buf[ptr - base: ptr - base + nbytes]
        raise KeyError(ptr)

    def synchronize(self) -> None:
        if self.torch is not None:
            self._stream.synchronize()
        else:
            self._check(self.cudart.cudaStreamSynchronize(self._stream))

    def close(self) -> None:
        """Free every buffer and the stream (idempotent; errors at shutdown are ignored)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.synchronize()
        except Exception:
            pass
        if self.torch is not None:
            self._buffers.clear()
            self._stream = None
            return
        for p in self._ptrs:
            try:
                self.cudart.cudaFree(p)
            except Exception:
                pass
        self._ptrs.clear()
        try:
            self.cudart.cudaStreamDestroy(self._stream)
        except Exception:
            pass


# --------------------------------------------------------------------------- buffers


@dataclass(frozen=True)
class EngineBuffers:
    """The engine's I/O tensors and the device buffers bound to them, sized once for the profile's largest
    shape: an inference within the profile never needs more."""

    inputs: Mapping[str, np.dtype]  # engine input -> the host dtype it reads
    max_shape: Mapping[str, tuple[int, ...]]  # engine input -> the profile's largest shape
    output: str
    output_dtype: np.dtype
    output_capacity: int  # bytes of the output buffer
    ptrs: Mapping[str, int]  # tensor -> its device buffer

    @property
    def max_batch(self) -> int:
        return self.max_shape["input_ids"][0]

    @property
    def max_seq(self) -> int:
        return self.max_shape["input_ids"][1]


def allocate_buffers(trt, engine, context, mem: _CudaMem, plan_path: Path, artifact: Artifact) -> EngineBuffers:
    """Check the engine's I/O against the artifact contract, allocate its buffers on `mem` and bind them to
    `context`. A refused engine raises BackendUnavailable (what was allocated is freed with `mem`)."""
    inputs: dict[str, Any] = {}
    max_shapes: dict[str, tuple[int, ...]] = {}
    output: str | None = None
    output_dtype = None
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            if name not in INPUTS:
                raise BackendUnavailable(f"{plan_path}: unexpected engine input {name!r}; expected {list(INPUTS)}")
            _, _, max_shape = engine.get_tensor_profile_shape(name, 0)
            inputs[name] = dtype
            max_shapes[name] = tuple(int(x) for x in max_shape)
        elif output is None:
            output, output_dtype = name, dtype
        else:
            raise BackendUnavailable(f"{plan_path}: the engine has more than one output; expected only {OUTPUT!r}")
    if "input_ids" not in inputs or output is None:
        raise BackendUnavailable(f"{plan_path}: the engine needs an input_ids input and a logits output")
    num_labels = artifact.num_labels
    # The output buffer is sized from the engine, not the manifest: at the profile's largest inputs.
    for name in inputs:
        context.set_input_shape(name, max_shapes[name])
    out_max = tuple(int(d) for d in context.get_tensor_shape(output))
    if len(out_max) != 2 or any(d < 0 for d in out_max):
        raise BackendUnavailable(f"{plan_path}: the engine's output {output!r} has shape {out_max} at the "
                                 "largest profile shape; expected [batch, labels]. Rebuild the engine")
    if out_max[1] != num_labels:
        raise BackendUnavailable(
            f"{plan_path}: the engine's output {output!r} has {out_max[1]} values per row but the checkpoint "
            f"has {num_labels} labels: the engine was built from another model; rebuild it with "
            f"`holoserve build-engine {artifact.path}`")
    output_capacity = int(np.prod(out_max)) * output_dtype.itemsize
    ptrs = {name: mem.malloc(int(np.prod(max_shapes[name])) * dt.itemsize) for name, dt in inputs.items()}
    ptrs[output] = mem.malloc(output_capacity)
    for name, ptr in ptrs.items():
        context.set_tensor_address(name, ptr)
    return EngineBuffers(MappingProxyType(inputs), MappingProxyType(max_shapes), output, output_dtype,
                         output_capacity, MappingProxyType(ptrs))


# --------------------------------------------------------------------------- backend


@dataclass
class _Chosen:
    plan: Path
    sidecar: dict[str, Any]
    where: str
    trt: Any
    flavour: str
    module: str
    plan_bytes: bytes
    runtime: Any
    logger: Any


class TensorRTBackend:
    name = "tensorrt"
    whole_batches = True  # one padded engine launch beats several smaller ones

    def __init__(self, artifact: Artifact, *, library: str | None = None, engine_cache: str | os.PathLike | None = None,
                 build_engine: str | None = None, max_batch: int | None = None):
        cache, mode = engine_settings({"engine_cache": engine_cache, "build_engine": build_engine})
        candidates = engine_candidates(artifact, cache)
        if not candidates and mode == "never":
            engine_files(artifact)  # raises: no engine, and how to get one
        gpu = current_gpu()
        if gpu is None:  # before importing a multi-hundred-megabyte library for nothing
            where = candidates[0][0] if candidates else artifact.path
            raise BackendUnavailable(f"{where}: no CUDA GPU found on this machine; TensorRT engines need one")
        reasons: list[str] = []
        chosen = self._pick(candidates, gpu, library, reasons)
        if chosen is None and mode == "if-missing":
            if model_id(artifact) is None:
                reasons.append(f"no engine can be built at start-up: {artifact.path} has no TensorRT-placement ONNX "
                               f"export (`holoserve export {artifact.path} --target tensorrt`)")
            elif self._build(artifact, cache, gpu, library, max_batch, reasons):
                tried = {plan for plan, _, _ in candidates}
                chosen = self._pick([c for c in engine_candidates(artifact, cache) if c[0] not in tried], gpu,
                                    library, reasons)
        if chosen is None:
            raise BackendUnavailable("no TensorRT engine usable here: " + "; ".join(reasons or ["none found"]))

        trt = chosen.trt
        self.trt, self.library = trt, chosen.module
        self.compute_capability, self.gpu = gpu["compute_capability"], gpu.get("name")
        self.plan_path, self.sidecar, self.source = chosen.plan, chosen.sidecar, chosen.where
        self.logger, self.runtime = chosen.logger, chosen.runtime
        self.engine = self.runtime.deserialize_cuda_engine(chosen.plan_bytes)
        if self.engine is None:
            raise BackendUnavailable(f"{chosen.plan}: TensorRT could not deserialize the engine (see its log above); "
                                     "rebuild it with `holoserve build-engine`")
        self.context = self.engine.create_execution_context()
        self.mem = _CudaMem()
        self._finalizer = weakref.finalize(self, self.mem.close)  # frees device memory even without close()
        self._lock = threading.Lock()  # one execution context: one inference at a time
        self._closed = False
        try:
            self.buffers = allocate_buffers(trt, self.engine, self.context, self.mem, chosen.plan, artifact)
        except BaseException:
            self.close()
            raise

    # ---- choosing and building
    def _pick(self, candidates, gpu: Mapping[str, Any], library: str | None, reasons: list[str]) -> _Chosen | None:
        cc = gpu["compute_capability"]
        for plan, side_path, where in candidates:
            try:
                side = read_sidecar(side_path)
                flavour, module = runtime_module(side)
                if library and library.replace("-", "_") != module:
                    raise BackendUnavailable(f"it was built with {flavour}; it cannot be loaded with {library}")
                trt = import_library(module)
                check_engine(side, flavour=flavour, version=trt.__version__, compute_capability=cc,
                             where=str(plan), gpu=gpu.get("name"))
                data = plan.read_bytes()
                logger = trt.Logger(trt.Logger.WARNING)
                runtime = trt.Runtime(logger)
                if module == "tensorrt_rtx":
                    validity, why = rtx_validity(trt, runtime, data)
                    if validity == "INVALID":
                        raise BackendUnavailable(
                            f"{plan}: TensorRT-RTX reports the engine invalid on this machine ("
                            + ("; ".join(why) or "no reason given") + "); rebuild it with `holoserve build-engine`")
                    if validity == "SUBOPTIMAL":
                        log.warning("%s: TensorRT-RTX reports the engine valid but suboptimal on this GPU (%s); "
                                    "a build pinned to it is faster", plan, "; ".join(why) or "no reason given")
                return _Chosen(plan, side, where, trt, flavour, module, data, runtime, logger)
            except BackendUnavailable as e:
                msg = str(e)
                reasons.append(msg if str(plan) in msg else f"{where}: {msg}")
            except OSError as e:
                reasons.append(f"{plan}: cannot be read ({e})")
        return None

    def _build(self, artifact: Artifact, cache: Path, gpu: Mapping[str, Any], library: str | None,
               max_batch: int | None, reasons: list[str]) -> bool:
        """Run `holoserve build-engine CKPT --cache-dir CACHE --if-missing` for this GPU; False (and why) on failure."""
        module = library.replace("-", "_") if library else next(
            (m for m in LIBRARIES if importlib.util.find_spec(m) is not None), None)
        if module is None:
            reasons.append("no engine can be built at start-up: no TensorRT library is installed here")
            return False
        cmd = [sys.executable, "-m", "holoserve", "build-engine", str(artifact.path), "--cache-dir", str(cache),
               "--if-missing", "--flavour", module]
        cc = engine_sidecar.normalize_cc(gpu["compute_capability"])
        if module == "tensorrt_rtx":  # pinned to this GPU: faster than the portable default
            cmd += ["--compute-capability", cc]
        if max_batch:
            seq = artifact.max_seq_length
            cmd += ["--max", f"{int(max_batch)}x{seq}", "--opt", f"{min(8, int(max_batch))}x{min(128, seq)}"]
        log.warning("building a TensorRT engine for %s (%s, %s) into %s; the first start takes minutes, later starts "
                    "reuse it", artifact.path, gpu.get("name"), cc, cache)
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            reasons.append(f"building the engine failed: {e}")
            return False
        for line in (r.stdout or "").splitlines():
            log.info("build-engine: %s", line)
        if r.returncode != 0:
            tail = [ln for ln in (r.stderr or "").strip().splitlines() if ln.strip()][-3:]
            reasons.append("building the engine at start-up failed: " + (" | ".join(tail) or f"exit {r.returncode}"))
            return False
        return True

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray) -> np.ndarray:
        buf = self.buffers
        batch, seq = input_ids.shape
        if batch > buf.max_batch or seq > buf.max_seq:
            # Larger than the engine's profile: split the batch (sequence length is capped by the manifest).
            if seq > buf.max_seq:
                raise ValueError(f"sequence length {seq} exceeds the engine profile's maximum {buf.max_seq}")
            parts = [self.infer(input_ids[i:i + buf.max_batch], attention_mask[i:i + buf.max_batch],
                                token_type_ids[i:i + buf.max_batch]) for i in range(0, batch, buf.max_batch)]
            return np.concatenate(parts, axis=0)
        arrays = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        with self._lock:
            if self._closed:
                raise RuntimeError("the TensorRT backend is closed")
            for name, dtype in buf.inputs.items():
                host = np.ascontiguousarray(arrays[name], dtype=dtype)
                self.context.set_input_shape(name, tuple(host.shape))
                self.mem.htod(buf.ptrs[name], host)
            out_shape = tuple(self.context.get_tensor_shape(buf.output))
            out = np.empty(out_shape, dtype=buf.output_dtype)
            if out.nbytes > buf.output_capacity:  # cannot happen within the profile; never write past the buffer
                raise RuntimeError(f"TensorRT output {out_shape} is larger than its buffer ({buf.output_capacity} B)")
            if not self.context.execute_async_v3(self.mem.stream_handle):
                raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
            self.mem.dtoh(out, buf.ptrs[buf.output])
            self.mem.synchronize()
        return out.astype(np.float32, copy=False)

    def close(self) -> None:
        """Free device memory and the stream, and drop the context and engine (idempotent)."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return
        with lock:
            if self._closed:
                return
            self._closed = True
            self.context = None  # before its buffers go
            self.engine = None
            self._finalizer()  # runs self.mem.close() once

    def __enter__(self) -> "TensorRTBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def info(self) -> dict[str, Any]:
        sp = self.sidecar.get("sparsity") or {}
        return {
            "backend": self.name,
            "library": self.library,
            "tensorrt_version": self.trt.__version__,
            "file": self.plan_path.name,
            "engine_source": self.source,
            "device": "cuda",
            "gpu": self.gpu,
            "compute_capability": self.compute_capability,
            "max_batch": int(self.buffers.max_batch),
            "max_sequence": int(self.buffers.max_seq),
            "sparsity": {k: sp.get(k) for k in ("requested", "verdict", "sparse_gemms", "dense_gemms", "unknown_gemms",
                                                "note") if k in sp} or None,
            "precision": self.sidecar.get("precision"),
        }


def load(artifact: Artifact, **options: Any) -> TensorRTBackend:
    return TensorRTBackend(artifact, library=options.get("library"), engine_cache=options.get("engine_cache"),
                           build_engine=options.get("build_engine"), max_batch=options.get("max_batch"))
