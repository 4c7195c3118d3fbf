"""`--backend auto`: the fastest backend this machine can run, and why it was picked.

Order: TensorRT (an engine built for this GPU and TensorRT version) > torch-cuda (2:4
semi-structured kernels on a CUDA GPU) > ONNX Runtime (CPU, or its CUDA EP where present).
Cheap checks come first so that a CPU-only machine never imports torch or TensorRT.

An engine on disk (in the checkpoint or the engine cache) that is not used is never a quiet
fallback: the reason is logged as a warning and put in the decision's "warnings", which the server
reports with the backend (GET /v1/models) and logs at start-up.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from holoserve.core.artifact import Artifact
from holoserve.core.manifest import ONNXRUNTIME, TENSORRT_ENGINE
from .base import Backend, BackendUnavailable, load_backend

log = logging.getLogger("holoserve.backends")

ORDER = ("tensorrt", "torch-cuda", "onnxruntime")


def nvidia_gpu_visible() -> bool:
    """Whether an NVIDIA GPU looks usable, without importing any CUDA library."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1", "none", "NoDevFiles"):
        return False
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/version").exists() or bool(
        shutil.which("nvidia-smi"))


def _precheck(name: str, artifact: Artifact, gpu: bool, options: dict[str, Any] | None = None) -> str | None:
    """A reason to skip `name` without importing anything heavy, or None to try loading it."""
    exports = artifact.manifest.exports.recorded()
    if name == "tensorrt":
        from . import tensorrt as trt_backend  # light: imports no TensorRT library

        try:
            _cache, mode = trt_backend.engine_settings(options)
        except BackendUnavailable as e:
            return str(e)
        if TENSORRT_ENGINE not in exports and mode == "never" and not trt_backend.engines_on_disk(artifact, options):
            return ("the checkpoint has no TensorRT engine (holoserve build-engine, or HOLOSERVE_BUILD_ENGINE=if-missing "
                    "to build one at start-up)")
        if not gpu:
            return "no NVIDIA GPU visible"
    if name == "torch-cuda":
        if not gpu:
            return "no NVIDIA GPU visible"
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
    if name == "onnxruntime" and ONNXRUNTIME not in exports:
        return "the checkpoint has no ONNX export (holoserve export)"
    return None


def select_backend(artifact: Artifact, *, order: tuple[str, ...] = ORDER, **options: Any) -> tuple[Backend, dict[str, Any]]:
    """Load the first backend in `order` that works here. Returns (backend, decision)."""
    gpu = nvidia_gpu_visible()
    skipped: dict[str, str] = {}
    for name in order:
        reason = _precheck(name, artifact, gpu, options)
        if reason is None:
            try:
                backend = load_backend(name, artifact, **options)
            except (BackendUnavailable, ImportError) as e:
                reason = str(e)
            except Exception as e:  # a broken optional backend must not stop auto from falling back
                reason = f"failed to load: {type(e).__name__}: {e}"
        if reason is not None:
            skipped[name] = reason
            log.info("backend auto: skipping %s: %s", name, reason)
            continue
        why = f"first usable of {' > '.join(order)}" + (
            f" (skipped: {'; '.join(f'{k}: {v}' for k, v in skipped.items())})" if skipped else "")
        warnings = unused_engine_warnings(artifact, name, skipped, options)
        for w in warnings:
            log.warning("backend auto: %s", w)
        if warnings:
            why = "WARNING: " + " ".join(warnings) + " Picked " + name + ": " + why
        log.info("backend auto: picked %s, %s", name, why)
        return backend, {"picked": name, "reason": why, "skipped": skipped, "warnings": warnings}
    raise BackendUnavailable(
        f"no backend can serve {artifact.path} on this machine: "
        + "; ".join(f"{k}: {v}" for k, v in skipped.items())
    )


def unused_engine_warnings(artifact: Artifact, picked: str, skipped: dict[str, str],
                           options: dict[str, Any] | None = None) -> list[str]:
    """Why a TensorRT engine on disk is not serving, when `auto` picked something else (else [])."""
    if picked == "tensorrt" or "tensorrt" not in skipped:
        return []
    from . import tensorrt as trt_backend

    engines = trt_backend.engines_on_disk(artifact, options)
    if not engines:
        return []
    return [f"the TensorRT engine {', '.join(engines)} is not used: {skipped['tensorrt']}."]
