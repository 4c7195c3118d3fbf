"""TensorRT backend: deserialize the checkpoint's engine (model.plan) and run it on a CUDA stream.

The library is imported only when this backend is loaded. Engines are specific to the TensorRT
version and the GPU they were built for, so before deserializing anything the engine's JSON
sidecar (written by `holoserve build-engine`, format in holoserve/core/sidecar.py) is checked
against this machine and a plan built elsewhere is refused with a message that says how to
rebuild it. The sidecar names the runtime that must load it: datacenter TensorRT (libnvinfer,
module `tensorrt`) or TensorRT-RTX (module `tensorrt_rtx`, same Python API).

Device memory comes from cuda-python (`cuda.bindings.runtime`, or the older `cuda.cudart`) or, if
that is absent, from torch; buffers are sized for the engine profile's maximum shape once.
"""
from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..core import sidecar as engine_sidecar
from holoserve.core.artifact import Artifact
from holoserve.core.manifest import TENSORRT_ENGINE
from .base import BackendUnavailable

EXPORT_KEY = TENSORRT_ENGINE
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "logits"
LIBRARIES = ("tensorrt", "tensorrt_rtx")


# --------------------------------------------------------------------------- sidecar checks (no library needed)


def engine_files(artifact: Artifact) -> tuple[Path, Path]:
    entry = artifact.export(EXPORT_KEY)
    if entry is None:
        raise BackendUnavailable(
            f"{artifact.path} has no TensorRT engine (manifest exports['{EXPORT_KEY}'] is missing): "
            f"build one for the serving GPU with `holoserve build-engine {artifact.path}`"
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
    """(flavour, Python module) that must load this plan: ("tensorrt", "tensorrt") or ("tensorrt-rtx", "tensorrt_rtx")."""
    built = sidecar.get("tensorrt") or {}
    flavour = str(built.get("flavour") or "")
    module = str(built.get("module") or flavour.replace("-", "_"))
    if module not in LIBRARIES or flavour not in ("tensorrt", "tensorrt-rtx"):
        raise BackendUnavailable(f"the engine sidecar names an unknown TensorRT flavour {flavour!r}; rebuild the engine")
    return flavour, module


def check_engine(sidecar: Mapping[str, Any], *, flavour: str, version: str, compute_capability: str | None,
                 where: str = "engine") -> None:
    """Refuse, before deserializing anything, a plan built by another TensorRT or for another GPU."""
    if compute_capability is None:
        raise BackendUnavailable(f"{where}: no CUDA GPU found on this machine; TensorRT engines need one")
    try:
        engine_sidecar.check_compatible(sidecar, flavour=flavour, version=version,
                                        compute_capability=compute_capability)
    except engine_sidecar.EngineMismatchError as e:
        raise BackendUnavailable(f"{where}: {e}") from None


# --------------------------------------------------------------------------- machine probes


def gpu_compute_capability() -> str | None:
    """The first visible GPU's compute capability ("8.6"), via cuda-python or nvidia-smi; None if no GPU."""
    cudart = _cudart()
    if cudart is not None:
        try:
            err, major = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, 0)
            err2, minor = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, 0)
            if int(err) == 0 and int(err2) == 0:
                return f"{major}.{minor}"
        except Exception:
            pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10, check=True).stdout.split()
            return _cc(out[0]) if out else None
        except (subprocess.SubprocessError, OSError, ValueError):
            return None
    return None


def _cc(value: Any) -> str | None:
    """"8.6" from "8.6" / "sm_86" / "86"; None stays None."""
    if value is None:
        return None
    s = str(value).strip().lower().removeprefix("sm_").removeprefix("sm")
    if "." in s:
        return s
    return f"{int(s[:-1])}.{int(s[-1])}" if s.isdigit() and len(s) >= 2 else s


def _cudart():
    for mod in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            return importlib.import_module(mod)
        except ImportError:
            continue
    return None


def import_library(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pkg = "tensorrt" if name == "tensorrt" else "tensorrt-rtx-cu13"
        raise BackendUnavailable(
            f"the {name} Python package is not installed ({e}); use the GPU image (docker/Dockerfile.gpu) "
            f"or pip install {pkg}"
        ) from None


# --------------------------------------------------------------------------- device memory


class _CudaMem:
    """Minimal device memory + stream via cuda-python's runtime API, or torch as a fallback."""

    def __init__(self) -> None:
        self.cudart = _cudart()
        self.torch = None
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
            self._buffers: dict[int, Any] = {}
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
        return int(self._check(self.cudart.cudaMalloc(max(nbytes, 1))))

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

    def free_all(self, ptrs: list[int]) -> None:
        if self.torch is not None:
            self._buffers.clear()
            return
        for p in ptrs:
            self.cudart.cudaFree(p)


# --------------------------------------------------------------------------- backend


class TensorRTBackend:
    name = "tensorrt"

    def __init__(self, artifact: Artifact, *, library: str | None = None):
        plan_path, sidecar_path = engine_files(artifact)
        sidecar = read_sidecar(sidecar_path)
        flavour, module = runtime_module(sidecar)
        if library and library.replace("-", "_") != module:
            raise BackendUnavailable(f"{plan_path} was built with {flavour}; it cannot be loaded with {library}")
        cc = gpu_compute_capability()
        if cc is None:  # before importing a multi-hundred-megabyte library for nothing
            raise BackendUnavailable(f"{plan_path}: no CUDA GPU found on this machine; TensorRT engines need one")
        trt = import_library(module)
        check_engine(sidecar, flavour=flavour, version=trt.__version__, compute_capability=cc, where=str(plan_path))
        self.trt, self.library, self.compute_capability = trt, module, cc
        self.plan_path, self.sidecar = plan_path, sidecar
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise BackendUnavailable(f"{plan_path}: TensorRT could not deserialize the engine (see its log above); "
                                     "rebuild it with `holoserve build-engine`")
        self.context = self.engine.create_execution_context()
        self.mem = _CudaMem()
        self._lock = threading.Lock()  # one execution context: one inference at a time

        self.inputs: dict[str, Any] = {}
        self.max_shape: dict[str, tuple[int, ...]] = {}
        self.output: str | None = None
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                if name not in INPUTS:
                    raise BackendUnavailable(f"{plan_path}: unexpected engine input {name!r}; expected {list(INPUTS)}")
                _, _, max_shape = self.engine.get_tensor_profile_shape(name, 0)
                self.inputs[name] = dtype
                self.max_shape[name] = tuple(int(x) for x in max_shape)
            else:
                self.output, self.output_dtype = name, dtype
        if "input_ids" not in self.inputs or self.output is None:
            raise BackendUnavailable(f"{plan_path}: the engine needs an input_ids input and a logits output")
        self.max_batch, self.max_seq = self.max_shape["input_ids"][:2]
        self.num_labels = artifact.num_labels
        self.ptrs = {name: self.mem.malloc(int(np.prod(self.max_shape[name])) * dt.itemsize)
                     for name, dt in self.inputs.items()}
        self.ptrs[self.output] = self.mem.malloc(self.max_batch * self.num_labels * self.output_dtype.itemsize)
        for name, ptr in self.ptrs.items():
            self.context.set_tensor_address(name, ptr)

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray) -> np.ndarray:
        batch, seq = input_ids.shape
        if batch > self.max_batch or seq > self.max_seq:
            # Larger than the engine's profile: split the batch (sequence length is capped by the manifest).
            if seq > self.max_seq:
                raise ValueError(f"sequence length {seq} exceeds the engine profile's maximum {self.max_seq}")
            parts = [self.infer(input_ids[i:i + self.max_batch], attention_mask[i:i + self.max_batch],
                                token_type_ids[i:i + self.max_batch]) for i in range(0, batch, self.max_batch)]
            return np.concatenate(parts, axis=0)
        arrays = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        with self._lock:
            for name, dtype in self.inputs.items():
                host = np.ascontiguousarray(arrays[name], dtype=dtype)
                self.context.set_input_shape(name, tuple(host.shape))
                self.mem.htod(self.ptrs[name], host)
            out_shape = tuple(self.context.get_tensor_shape(self.output))
            out = np.empty(out_shape, dtype=self.output_dtype)
            if not self.context.execute_async_v3(self.mem.stream_handle):
                raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
            self.mem.dtoh(out, self.ptrs[self.output])
            self.mem.synchronize()
        return out.astype(np.float32, copy=False)

    def info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "library": self.library,
            "tensorrt_version": self.trt.__version__,
            "file": self.plan_path.name,
            "device": "cuda",
            "compute_capability": self.compute_capability,
            "max_batch": int(self.max_batch),
            "max_sequence": int(self.max_seq),
            "sparsity": self.sidecar.get("sparsity"),
            "precision": self.sidecar.get("precision"),
        }


def load(artifact: Artifact, **options: Any) -> TensorRTBackend:
    return TensorRTBackend(artifact, library=options.get("library"))
