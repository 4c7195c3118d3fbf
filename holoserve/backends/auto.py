"""`--backend auto`: the fastest backend this machine can run, and why it was picked.

Order: TensorRT (an engine built for this GPU and TensorRT version) > torch-cuda (2:4
semi-structured kernels on a CUDA GPU) > the fastest CPU backend: where both OpenVINO and ONNX
Runtime can serve the checkpoint, each runs a short warm-up here and the faster one is picked, with
the timings in the reason (which runtime wins depends on the CPU, the batch and the model).
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
from holoserve.core.manifest import ONNXRUNTIME, OPENVINO, TENSORRT_ENGINE
from .base import Backend, BackendUnavailable, load_backend

log = logging.getLogger("holoserve.backends")

ORDER = ("tensorrt", "torch-cuda", "cpu")
CPU_BACKENDS = ("openvino", "onnxruntime")


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
    if name == "openvino":
        if OPENVINO not in exports:
            return "the checkpoint has no OpenVINO export (holoserve export --target openvino)"
        if importlib.util.find_spec("openvino") is None:
            return "OpenVINO is not installed (pip install 'holoserve[openvino]')"
    return None


def _warmup_feed(artifact: Artifact, batch: int = 8, seq: int = 64) -> tuple:
    """Fixed random token ids inside the model's vocabulary (read from config.json), no padding."""
    import json

    import numpy as np

    vocab = int(json.loads((artifact.path / "config.json").read_text(encoding="utf-8")).get("vocab_size", 1000))
    seq = max(2, min(seq, artifact.max_seq_length))
    ids = np.random.default_rng(0).integers(min(1000, vocab // 2), vocab, (batch, seq)).astype(np.int64)
    return ids, np.ones_like(ids), np.zeros_like(ids)


def fastest_cpu(artifact: Artifact, gpu: bool, options: dict[str, Any], skipped: dict[str, str],
                runs: int = 7) -> tuple[Backend | None, str]:
    """The faster of the CPU backends that load here, timed alternately on the same warm-up batch."""
    import time

    loaded: dict[str, Backend] = {}
    for name in CPU_BACKENDS:
        reason = _precheck(name, artifact, gpu, options)
        if reason is None:
            try:
                loaded[name] = load_backend(name, artifact, **options)
            except (BackendUnavailable, ImportError) as e:
                reason = str(e)
        if reason is not None:
            skipped[name] = reason
    if not loaded:
        return None, "no CPU backend loads"
    if len(loaded) == 1:
        (name, backend), = loaded.items()
        return backend, f"{name}{_kernels_note(backend)}, the only CPU backend that loads here"
    feed = _warmup_feed(artifact)
    times: dict[str, list[float]] = {n: [] for n in loaded}
    for _ in range(2):  # untimed: first-run allocations
        for backend in loaded.values():
            backend.infer(*feed)
    for _ in range(runs):
        for name, backend in loaded.items():
            t0 = time.perf_counter()
            backend.infer(*feed)
            times[name].append(time.perf_counter() - t0)
    # the fastest run of each: other processes on the machine only ever add time, so the minimum is the
    # estimate of what each backend can do that background load disturbs least
    fastest = {n: min(v) * 1000 for n, v in times.items()}
    best = min(fastest, key=fastest.get)
    shape = "x".join(str(d) for d in feed[0].shape)
    timing = ", ".join(f"{n} {ms:.2f} ms{_kernels_note(loaded[n])}"
                       for n, ms in sorted(fastest.items(), key=lambda kv: kv[1]))
    return loaded[best], f"{best}, the fastest CPU backend on a warm-up batch of {shape} tokens here (best of {runs}: {timing})"


def _kernels_note(backend: Backend) -> str:
    """" with the 2:4 kernels on/off: why" for the OpenVINO backend (what its timing measured), else ""."""
    kernels = backend.info().get("kernels") if backend.name == "openvino" else None
    status = kernels.get("status") if isinstance(kernels, dict) else None
    return f" with the 2:4 kernels {status}" if status else ""


def select_backend(artifact: Artifact, *, order: tuple[str, ...] = ORDER, **options: Any) -> tuple[Backend, dict[str, Any]]:
    """Load the first backend in `order` that works here. Returns (backend, decision)."""
    gpu = nvidia_gpu_visible()
    skipped: dict[str, str] = {}
    for name in order:
        if name == "cpu":
            backend, why = fastest_cpu(artifact, gpu, options, skipped)
            if backend is None:
                continue
            name = backend.name
            if skipped:
                why += f" (skipped: {'; '.join(f'{k}: {v}' for k, v in skipped.items())})"
            warnings = unused_engine_warnings(artifact, name, skipped, options)
            for w in warnings:
                log.warning("backend auto: %s", w)
            if warnings:
                why = "WARNING: " + " ".join(warnings) + " Picked " + why
            log.info("backend auto: picked %s", why)
            return backend, {"picked": name, "reason": why, "skipped": skipped, "warnings": warnings}
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
