"""`--backend auto`: the fastest backend this machine can run, and why it was picked.

Order: TensorRT (an engine built for this GPU and TensorRT version) > torch-cuda (2:4 semi-structured
kernels on a CUDA GPU) > the fastest CPU backend. Where both OpenVINO and ONNX Runtime can serve the
checkpoint, the checkpoint's serving profile decides (written by `holoserve tune` on this machine; see
holoserve.backends.profile): nothing is timed at start-up, so every start serves the same way. Without
one, or with one written for another machine, runtime or export, both are timed here briefly on the
checkpoint's dev texts at the batch sizes the server forms, by the same rule: ONNX Runtime unless
OpenVINO is faster by a margin. Where one wins the small batches and the other the large ones by that
margin, both are loaded and each batch runs on the one that was faster for its size (RoutedCpuBackend).
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
from typing import Any, Iterable, Mapping

from holoserve import HoloServeError
from holoserve.core.artifact import Artifact
from holoserve.core.manifest import ONNXRUNTIME, OPENVINO, TENSORRT_ENGINE
from . import profile
from .base import Backend, BackendUnavailable, load_backend
from .routed import RoutedCpuBackend

log = logging.getLogger("holoserve.backends")

ORDER = ("tensorrt", "torch-cuda", "cpu")
CPU_BACKENDS = ("openvino", "onnxruntime")


def nvidia_gpu_visible() -> bool:
    """Whether an NVIDIA GPU looks usable, without importing any CUDA library."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1", "none", "NoDevFiles"):
        return False
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/version").exists() or bool(
        shutil.which("nvidia-smi"))


def _precheck(name: str, artifact: Artifact, gpu: bool, options: dict[str, Any] | None = None,
              probe: bool = True) -> str | None:
    """A reason to skip `name` without importing anything heavy, or None to try loading it; `probe` False
    leaves OpenVINO's INT8 probe (_saturates) to when OpenVINO is about to load."""
    exports = artifact.manifest.exports.recorded()
    if name == "tensorrt":
        from . import tensorrt as trt_backend  # light: imports no TensorRT library

        try:
            _cache, mode = trt_backend.engine_settings(options)
        except BackendUnavailable as e:
            return str(e)
        if TENSORRT_ENGINE not in exports and mode == "never" and not trt_backend.engines_on_disk(artifact, options):
            return ("the checkpoint has no TensorRT engine (holoserve build-engine, or "
                    "HOLOSERVE_BUILD_ENGINE=if-missing to build one at start-up)")
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
        if probe:
            return _saturates(name)
    return None


def _saturates(name: str) -> str | None:
    """Why `name` may not serve on its own choice here: OpenVINO where its INT8 GEMMs saturate on this CPU
    (exact numbers first: `--backend openvino` still serves it, with a warning). The probe compiles a model in
    OpenVINO, so it runs only where OpenVINO is about to be loaded, not for a profile that serves without it."""
    if name != "openvino":
        return None
    from .openvino import INT8_SATURATES, int8_gemm_saturates

    return INT8_SATURATES if int8_gemm_saturates() else None


ROUTE_ENV = "HOLOSERVE_CPU_ROUTE"  # a routing decided before `--workers N` start (server/backend_choice.py)
# Timing at start-up (no usable serving profile): short, as the server is not ready until it ends; a few
# rounds already tell a clear winner, and `holoserve tune` measures longer where the margin is thin.
STARTUP_PLAN = dict(min_rounds=3, max_rounds=15, seconds=2.0, per_round=16, light_per_round=4)
STARTUP_ROUTING_ROUNDS = 4  # profile.confirm_routing's rounds at start-up, where a routed pair comes out ahead


def _route_from_env(loaded: dict[str, Backend]) -> tuple[Backend, str] | None:
    """The routing pinned for this worker by its parent, if any and if its backends loaded here."""
    import json

    raw = os.environ.get(ROUTE_ENV)
    if not raw:
        return None
    try:
        route = json.loads(raw)
        backend = RoutedCpuBackend.from_route(loaded, route)
    except (HoloServeError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return backend, "the routing chosen before the workers started"


def fastest_cpu(artifact: Artifact, gpu: bool, options: dict[str, Any], skipped: dict[str, str],
                notes: dict[str, Any] | None = None) -> tuple[Backend | None, str]:
    """The CPU backend(s) to serve with: as the checkpoint's serving profile says where it matches this
    machine (nothing is timed), else timed here on the checkpoint's dev texts (profile.decide's rule);
    where one wins the small batches and the other the large ones by the margin, both serve, routed by
    batch size. `notes` gets {"profile": what became of the serving profile}."""
    notes = {} if notes is None else notes
    usable = []
    for name in CPU_BACKENDS:
        reason = _precheck(name, artifact, gpu, options, probe=False)
        if reason is None:
            usable.append(name)
        else:
            skipped[name] = reason
    if not usable:
        return None, "no CPU backend loads"
    if os.environ.get(ROUTE_ENV):  # a worker of `--workers N`: the parent decided
        pinned_loaded = _load_cpu(artifact, usable, options_served(usable, options), skipped)
        pinned = _route_from_env(pinned_loaded)
        if pinned is not None:
            return pinned[0], pinned[1] + _notes(pinned_loaded)
    from_profile = _from_profile(artifact, usable, options, notes, skipped)
    if from_profile is not None:
        return from_profile
    loaded = _load_cpu(artifact, usable, options, skipped)
    if not loaded:
        return None, "no CPU backend loads"
    if len(loaded) == 1:
        (name, backend), = loaded.items()
        return (_as_served(loaded, [name], artifact, options)[name],
                f"{name}, the only CPU backend that loads here{_notes(loaded)}")
    return _timed_at_startup(artifact, loaded, options)


def options_served(names: Iterable[str], options: dict[str, Any]) -> dict[str, Any]:
    """The options the backends `names` load with to serve: where OpenVINO is one of them (alone, or a side of a
    routed pair) and the server gives it `openvino_instances` (service.open_backend), each loads with that many
    instances, so that a pair's ONNX Runtime side also runs its batches on all the threads; else `options`."""
    wanted = options.get("openvino_instances")
    return {**options, "instances": wanted} if "openvino" in names and wanted else options


def _as_served(loaded: Mapping[str, Backend], names: list[str], artifact: Artifact, options: dict[str, Any]
               ) -> dict[str, Backend]:
    """The backends `names` as they serve: each one timed as the plan's instances run it is loaded again where
    options_served gives it another count."""
    served = options_served(names, options)
    return {n: loaded[n] if served is options or served["instances"] == getattr(loaded[n], "instances", 1)
            else load_backend(n, artifact, **served) for n in names}


def _load_cpu(artifact: Artifact, names: list[str], options: dict[str, Any], skipped: dict[str, str]
              ) -> dict[str, Backend]:
    """The backends of `names` that load here, less any whose INT8 GEMMs saturate (_saturates); why each other
    one did not, in `skipped`."""
    loaded: dict[str, Backend] = {}
    for name in names:
        try:
            reason = _saturates(name)
            if reason is None:
                loaded[name] = load_backend(name, artifact, **options)
        except (BackendUnavailable, ImportError) as e:
            reason = str(e)
        if reason is not None:
            skipped[name] = reason
    return loaded


def _notes(loaded: dict[str, Backend]) -> str:
    return "".join(f"; {n}{note}" for n, b in loaded.items() if (note := _kernels_note(b)))


def _from_profile(artifact: Artifact, usable: list[str], options: dict[str, Any], notes: dict[str, Any],
                  skipped: dict[str, str]) -> tuple[Backend, str] | None:
    """The backend(s) the serving profile names, loaded as it says, where it matches this machine; else
    None, with the reason logged (a profile that is damaged or written elsewhere is never used)."""
    found, problem = profile.read_profile(artifact)
    if found is None:
        notes["profile"] = problem or "none"
        if problem:
            log.warning("backend auto: ignoring the serving profile: %s", problem)
        return None
    decision, path = found["decision"], profile.profile_path(artifact)
    retime = f"timing the CPU backends at start-up instead (run `holoserve tune {artifact.path}` on this machine)"
    current = profile.machine_key(artifact, options, kernels_on=found["key"].get("kernels_build") is not None)
    differs = profile.key_differences(found["key"], current)
    for n in profile.needed(decision):
        why = skipped.get(n, "it did not load") if n not in usable else _saturates(n)
        if why:
            differs.append(f"it picks {n}, which cannot serve here ({why})")
    if differs:
        notes["profile"] = "written for another setup: " + "; ".join(differs)
        log.warning("backend auto: the serving profile %s does not match this machine: %s; %s", path,
                    "; ".join(differs), retime)
        return None
    opts = dict(options_served(profile.needed(decision), options))
    if decision.get("openvino_shapes") and "openvino_shapes" not in options:  # a --openvino-shapes given wins
        opts["openvino_shapes"] = ",".join(decision["openvino_shapes"])
    # tune keeps the 2:4 kernels only where they measured faster than OpenVINO's own GEMMs; a setting given wins.
    # Where it did not time them (AMX, or a CPU they cannot run on), `auto` turns them off here by itself.
    phase = (found.get("timings") or {}).get("kernels")
    measured_off = ((options.get("openvino_kernels") or "auto") == "auto" and decision.get("openvino_kernels") == "off"
                    and isinstance(phase, dict) and phase.get("kept") is False)
    if measured_off:
        opts["openvino_kernels"] = "off"
    try:
        loaded = {n: load_backend(n, artifact, **opts) for n in profile.needed(decision)}
    except (HoloServeError, ImportError) as e:  # BackendUnavailable, or static shapes it cannot compile
        notes["profile"] = f"its backend did not load: {e}"
        log.warning("backend auto: the serving profile %s names a backend that did not load (%s); %s", path, e,
                    retime)
        return None
    if "openvino" in loaded and decision.get("openvino_kernels"):
        status = str(loaded["openvino"].info().get("kernels", {}).get("status", ""))
        if ("on" if status.startswith("on") else "off") != decision["openvino_kernels"]:
            notes["profile"] = f"the 2:4 kernels are {status or 'off'} here, {decision['openvino_kernels']} in it"
            log.warning("backend auto: the serving profile %s timed OpenVINO with the 2:4 kernels %s, but here "
                        "they are %s; %s", path, decision["openvino_kernels"], status or "off", retime)
            return None
    notes["profile"] = "used"
    if measured_off and "openvino" in loaded:
        measured = phase.get("reason") or "its decision"
        loaded["openvino"].note_kernels(f"off: the serving profile's `holoserve tune` kept OpenVINO's own GEMMs "
                                        f"({measured})")
    if decision["backend"] == "routed":
        backend: Backend = RoutedCpuBackend.from_route(loaded, decision)
    else:
        backend = loaded[decision["backend"]]
    return backend, (f"{profile.describe(decision)}, from the serving profile written by `holoserve tune` on "
                     f"{found.get('created', 'an unknown date')} ({decision.get('reason', 'no reason recorded')})"
                     f"{_notes(loaded)}")


def _timed_at_startup(artifact: Artifact, loaded: dict[str, Backend], options: dict[str, Any]
                      ) -> tuple[Backend, str]:
    """Time the loaded CPU backends here, briefly, on the checkpoint's dev texts (else random token ids at
    sentence-like lengths) at the batch sizes the server forms, and decide by profile.decide."""
    texts = None
    try:
        texts = profile.dev_texts(artifact)
    except (HoloServeError, OSError, UnicodeDecodeError) as e:
        log.warning("backend auto: the checkpoint's dev texts cannot be read (%s); timing on random token ids", e)
    items = profile.encode_texts(artifact, texts.rows) if texts else profile.synthetic_items(artifact)
    sizes = profile.batch_sizes(int(options.get("max_batch") or profile.BATCH_SIZES[-1]))
    timings = profile.time_backends(loaded, items, sizes, profile.Plan(**STARTUP_PLAN), profile.pad_id(artifact))
    medians, light = timings.medians(), timings.light_medians()
    decision = profile.confirm_routing(loaded, profile.decide(medians, timings.tokens, light=light), medians,
                                       items, sizes, profile.pad_id(artifact), STARTUP_ROUTING_ROUNDS, light)
    served = _as_served(loaded, profile.needed(decision), artifact, options)
    if decision["backend"] == "routed":
        backend: Backend = RoutedCpuBackend.from_route(served, decision)
    else:
        backend = served[decision["backend"]]
    on = texts.source if texts else "random token ids at sentence-like lengths (no dev texts found)"
    return backend, (f"{profile.describe(decision)}, the fastest CPU backend by the median of {timings.rounds} "
                     f"rounds timed at start-up on {on} ({decision['reason']}; {profile.medians_table(medians)})"
                     f"{_notes(loaded)}; `holoserve tune {artifact.path}` measures once, longer, and lets the "
                     "server start without timing")


def _kernels_note(backend: Backend) -> str:
    """" with the 2:4 kernels on/off: why" for the OpenVINO backend (what its timing measured), else ""."""
    kernels = backend.info().get("kernels") if backend.name == "openvino" else None
    status = kernels.get("status") if isinstance(kernels, dict) else None
    return f" with the 2:4 kernels {status}" if status else ""


def select_backend(artifact: Artifact, *, order: tuple[str, ...] = ORDER,
                   **options: Any) -> tuple[Backend, dict[str, Any]]:
    """Load the first backend in `order` that works here. Returns (backend, decision)."""
    gpu = nvidia_gpu_visible()
    skipped: dict[str, str] = {}
    for name in order:
        if name == "cpu":
            notes: dict[str, Any] = {}
            backend, why = fastest_cpu(artifact, gpu, options, skipped, notes)
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
            return backend, {"picked": name, "reason": why, "skipped": skipped, "warnings": warnings,
                             "serving_profile": notes.get("profile", "none")}
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
