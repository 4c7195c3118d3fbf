"""`serve --workers N`: the backend is chosen once, before the workers start, and every worker serves it.

Each worker builds its own app from HOLOSERVE_* variables; left to themselves, N workers would each run
`--backend auto`'s timing and could end up on different backends (or with the 2:4 kernels on in some and
off in others). So the parent process decides in a short-lived child process (spawned, so no model,
thread pool or CUDA context stays in the parent that supervises the workers), then pins the choice in
the environment the workers inherit: HOLOSERVE_BACKEND names the backend (or stays auto, with
HOLOSERVE_CPU_ROUTE fixing how two CPU backends share the batches), HOLOSERVE_OPENVINO_KERNELS says on or
off, HOLOSERVE_OPENVINO_SHAPES lists OpenVINO's static shapes (those of the serving profile, where it
chose some), and HOLOSERVE_BACKEND_DECISION carries the decision (JSON) that each worker reports in
GET /v1/models and its start-up log.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from holoserve import HoloServeError
from holoserve.backends.auto import ROUTE_ENV

from .config import ServerConfig, env_name

DECISION_ENV = "HOLOSERVE_BACKEND_DECISION"


def _decide(env: dict[str, str]) -> dict[str, Any]:
    """In the child: load the configured backend as one server would, and describe it."""
    from holoserve.core.artifact import load_artifact

    from .service import open_backend

    cfg = ServerConfig.from_env(env)
    backend, decision = open_backend(cfg, load_artifact(cfg.artifact_dir, verify=False))
    info = backend.info()
    kernels = info.get("kernels", {}).get("status", "") if isinstance(info.get("kernels"), dict) else ""
    route = backend.route() if hasattr(backend, "route") else None  # auto's RoutedCpuBackend
    shapes = info.get("static_shapes") or []  # OpenVINO's, alone or routed: the profile's or --openvino-shapes
    return {"decision": decision, "backend": backend.name, "kernels": kernels, "route": route, "shapes": shapes}


def decide_for_workers(cfg: ServerConfig) -> dict[str, Any]:
    """Choose the backend once for all workers and pin it in `cfg` and os.environ. Returns the decision.
    Raises HoloServeError (with the loader's message) where the backend cannot load."""
    env = {**os.environ, **cfg.to_env()}
    env.pop(DECISION_ENV, None)
    env.pop(ROUTE_ENV, None)
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            got = pool.submit(_decide, env).result()
    except HoloServeError:
        raise
    except Exception as e:  # BackendUnavailable and the like travel back as their own type
        raise HoloServeError(f"cannot load a backend for {cfg.artifact_dir}: {e}") from None
    decision = dict(got["decision"])
    decision["reason"] = (f"chosen once for all {cfg.workers} workers before they started: "
                          f"{decision.get('reason', '')}")
    if got["route"]:  # two CPU backends routed by batch size: each worker loads both, routed the same way
        os.environ[ROUTE_ENV] = json.dumps(got["route"])
    else:
        cfg.backend = got["backend"]
    if "openvino" in got["backend"].split("+"):
        if cfg.openvino_kernels == "auto":  # what auto found, so that no worker finds otherwise
            cfg.openvino_kernels = "on" if got["kernels"].startswith("on") else "off"
        cfg.openvino_shapes = ",".join(got.get("shapes") or []) or cfg.openvino_shapes
    os.environ[env_name("backend")] = cfg.backend
    os.environ[env_name("openvino_kernels")] = cfg.openvino_kernels
    os.environ[env_name("openvino_shapes")] = cfg.openvino_shapes
    os.environ[DECISION_ENV] = json.dumps(decision)
    return decision


def inherited_decision() -> dict[str, Any] | None:
    """In a worker: the decision its parent pinned, or None."""
    raw = os.environ.get(DECISION_ENV)
    if not raw:
        return None
    try:
        decision = json.loads(raw)
    except ValueError:
        return None
    return decision if isinstance(decision, dict) else None
