"""`--backend auto`: the fastest backend this machine can run, and why it was picked.

Order: TensorRT (an engine built for this GPU and TensorRT version) > torch-cuda (2:4
semi-structured kernels on a CUDA GPU) > the fastest CPU backend: where both OpenVINO and ONNX
Runtime can serve the checkpoint, each runs a short warm-up here at batches from a lone request to a
full one, and the faster one is picked, with the timings in the reason (which runtime wins depends on the
CPU, the batch and the model). Where one wins the small batches and the other the large ones, both are
loaded and each batch runs on the one that was faster for its size (RoutedCpuBackend).
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


# Warm-up batch sizes the CPU backends are timed at, each with (batch, seq) up to these: a lone request up
# to a full batch (the server's default --max-batch-size). Which runtime wins can change with the batch.
# Each timed run has a sequence length of its own, as served traffic does: a runtime that pays for every
# new input shape (OpenVINO's dynamic-shape models do) pays for it here too.
PROBE_SHAPES = ((1, 64), (4, 64), (8, 64), (16, 64), (32, 64))
ROUTE_ENV = "HOLOSERVE_CPU_ROUTE"  # a routing decided before `--workers N` start (server/backend_choice.py)


def _warmup_feed(artifact: Artifact, batch: int = 8, seq: int = 64) -> tuple:
    """Fixed random token ids inside the model's vocabulary (read from config.json), no padding."""
    import json

    import numpy as np

    vocab = int(json.loads((artifact.path / "config.json").read_text(encoding="utf-8")).get("vocab_size", 1000))
    seq = max(2, min(seq, artifact.max_seq_length))
    ids = np.random.default_rng(0).integers(min(1000, vocab // 2), vocab, (batch, seq)).astype(np.int64)
    return ids, np.ones_like(ids), np.zeros_like(ids)


class RoutedCpuBackend:
    """Two CPU backends loaded side by side, each batch run by the one that was faster for batches of its
    size at start-up: `small` up to `max_small_tokens` tokens (rows x sequence), `large` above."""

    whole_batches = False

    def __init__(self, small: Backend, large: Backend, max_small_tokens: int):
        self.small, self.large, self.max_small_tokens = small, large, int(max_small_tokens)
        self.name = f"{small.name}+{large.name}"
        self.runs = {small.name: 0, large.name: 0}

    def infer(self, input_ids, attention_mask, token_type_ids):
        backend = self.small if input_ids.size <= self.max_small_tokens else self.large
        self.runs[backend.name] += 1
        return backend.infer(input_ids, attention_mask, token_type_ids)

    def route(self) -> dict[str, Any]:
        return {"small": self.small.name, "large": self.large.name, "max_small_tokens": self.max_small_tokens}

    def info(self) -> dict[str, Any]:
        parts = {b.name: b.info() for b in (self.small, self.large)}
        out: dict[str, Any] = {"backend": self.name, "routing": {**self.route(), "runs": dict(self.runs)},
                               "backends": parts}
        for part in parts.values():
            if "kernels" in part:
                out["kernels"] = part["kernels"]
        return out


def _route_from_env(loaded: dict[str, Backend]) -> tuple[Backend, str] | None:
    """The routing pinned for this worker by its parent, if any and if its backends loaded here."""
    import json

    raw = os.environ.get(ROUTE_ENV)
    if not raw:
        return None
    try:
        route = json.loads(raw)
        small, large, limit = loaded[route["small"]], loaded[route["large"]], int(route["max_small_tokens"])
    except (ValueError, KeyError, TypeError):
        return None
    return RoutedCpuBackend(small, large, limit), "the routing chosen before the workers started"


def fastest_cpu(artifact: Artifact, gpu: bool, options: dict[str, Any], skipped: dict[str, str],
                runs: int = 7) -> tuple[Backend | None, str]:
    """The fastest of the CPU backends that load here, timed alternately at each of PROBE_SHAPES; where
    one wins the small batches and another the large ones, both serve, routed by batch size."""
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
    notes = "".join(f"; {n}{note}" for n, b in loaded.items() if (note := _kernels_note(b)))
    if len(loaded) == 1:
        (name, backend), = loaded.items()
        return backend, f"{name}, the only CPU backend that loads here{notes}"
    pinned = _route_from_env(loaded)
    if pinned is not None:
        return pinned[0], pinned[1] + notes
    winners, table = [], []
    top = max(2, min(max(s for _, s in PROBE_SHAPES), artifact.max_seq_length))
    # distinct lengths from a quarter of the longest up to it, none repeated: every timed run a new shape
    lengths = sorted({max(2, round(top * (0.25 + 0.75 * i / max(1, runs - 1)))) for i in range(runs)})
    for batch, _ in PROBE_SHAPES:
        warm = _warmup_feed(artifact, batch, top)
        for backend in loaded.values():  # untimed: first-run allocations
            backend.infer(*warm)
        times: dict[str, list[float]] = {n: [] for n in loaded}
        for seq in lengths:
            feed = _warmup_feed(artifact, batch, seq)
            for name, backend in loaded.items():
                t0 = time.perf_counter()
                backend.infer(*feed)
                times[name].append(time.perf_counter() - t0)
        # the total over the same shapes, taken in turns, so background load hits both alike
        total = {n: sum(v) * 1000 for n, v in times.items()}
        mean_tokens = batch * sum(lengths) // len(lengths)
        winners.append((mean_tokens, min(total, key=total.get)))
        table.append(f"{batch} rows: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in
                                                   sorted(total.items(), key=lambda kv: kv[1])))
    timing = f"{len(lengths)} runs each, lengths {lengths[0]} to {lengths[-1]}: {'; '.join(table)}{notes}"
    names = [w for _, w in winners]
    first, last = names[0], names[-1]
    if first == last:  # one runtime at both ends: the one that won most sizes serves everything
        best = max(dict.fromkeys(names), key=names.count)
        return loaded[best], f"{best}, the fastest CPU backend on warm-up batches here ({timing})"
    # small batches to `first` up to the geometric middle between its last win and `last`'s first
    cut = next(i for i, w in enumerate(names) if w != first)
    limit = int((winners[cut - 1][0] * winners[cut][0]) ** 0.5)
    routed = RoutedCpuBackend(loaded[first], loaded[last], limit)
    return routed, (f"{first} for batches of up to {limit} tokens and {last} above, the fastest CPU backend for "
                    f"each size on warm-up batches here ({timing})")


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
