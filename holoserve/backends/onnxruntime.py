"""ONNX Runtime backend: the checkpoint's ONNX export on the CPU EP (CUDA EP where present)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from holoserve.core.artifact import Artifact
from holoserve.core.machine import per_instance_threads
from holoserve.core.manifest import ONNXRUNTIME
from holoserve.core.ort import session as ort_session
from .base import BackendUnavailable

EXPORT_KEY = ONNXRUNTIME
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def onnx_path(artifact: Artifact, export_key: str = EXPORT_KEY) -> Path:
    """The ONNX file recorded under exports[export_key], or a clear error saying how to make it."""
    entry = artifact.export(export_key)
    if entry is None:
        raise BackendUnavailable(
            f"{artifact.path} has no {export_key!r} export (manifest exports['{export_key}'] is missing): "
            f"run `holoserve export {artifact.path}` first"
        )
    path = artifact.path / entry.file
    if not path.is_file():
        raise BackendUnavailable(
            f"{artifact.path}: the manifest lists ONNX export {entry.file!r} but the file is missing; "
            f"re-run `holoserve export {artifact.path}`"
        )
    return path


def choose_providers(available: list[str], device: str = "auto") -> list[str]:
    """CPU always; CUDA first when ONNX Runtime was built with it and the caller did not ask for CPU."""
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda" and "CUDAExecutionProvider" not in available:
        raise BackendUnavailable(
            "the CUDA execution provider is not available in this ONNX Runtime build "
            "(install onnxruntime-gpu, or use --backend onnxruntime on the CPU)"
        )
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class OrtBackend:
    name = "onnxruntime"
    whole_batches = False  # on a CPU, length groups save the padded tokens' work

    def __init__(self, artifact: Artifact, *, device: str = "auto", threads: int | None = None,
                 export_key: str = EXPORT_KEY, instances: int = 1):
        try:
            import onnxruntime as ort
        except ImportError as e:  # pragma: no cover - part of the base install
            raise BackendUnavailable(f"onnxruntime is not installed ({e}): pip install onnxruntime") from None
        self.path = onnx_path(artifact, export_key)
        threads = threads if threads is not None else int(os.environ.get("HOLOSERVE_ORT_THREADS", "0") or 0)
        providers = choose_providers(ort.get_available_providers(), device)
        # Batches run at once share the threads (a session's run is thread-safe); on CUDA one runs at a time.
        self.instances = max(1, int(instances)) if providers[0] == "CPUExecutionProvider" else 1
        threads = per_instance_threads(threads, self.instances)
        try:
            self.session = ort_session(self.path, threads=threads, providers=providers)
        except Exception as e:  # ORT raises its own exception types
            raise BackendUnavailable(f"ONNX Runtime cannot load {self.path}: {e}") from None
        self.providers = self.session.get_providers()
        names = [i.name for i in self.session.get_inputs()]
        unknown = [n for n in names if n not in INPUTS]
        if unknown or "input_ids" not in names:
            raise BackendUnavailable(
                f"{self.path} has inputs {names}; expected a subset of {list(INPUTS)} including input_ids. "
                f"Re-export with `holoserve export {artifact.path}`"
            )
        # An export may drop an input the graph never uses (e.g. token_type_ids); feed only what it has.
        self.input_names = names
        self.output_name = self.session.get_outputs()[0].name
        self.threads = threads

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray) -> np.ndarray:
        arrays = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        feed = {n: np.ascontiguousarray(arrays[n], dtype=np.int64) for n in self.input_names}
        (logits,) = self.session.run([self.output_name], feed)
        return np.asarray(logits, dtype=np.float32)

    def info(self) -> dict[str, Any]:
        import onnxruntime as ort

        return {
            "backend": self.name,
            "file": self.path.name,
            "providers": list(self.providers),
            "device": "cuda" if self.providers[0] == "CUDAExecutionProvider" else "cpu",
            "onnxruntime_version": ort.__version__,
            "intra_op_threads": self.threads or "default",
            "instances": self.instances,
            "threads_spin": "inside a run only",  # core.ort.session(spin="run")
        }


def load(artifact: Artifact, **options: Any) -> OrtBackend:
    return OrtBackend(artifact, device=options.get("device", "auto"), threads=options.get("threads"),
                      instances=int(options.get("instances") or 1))
