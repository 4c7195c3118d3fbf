"""The engine cache: one plan per ONNX export, TensorRT flavour and version, and GPU, built once under
a lock (several server workers starting at once) and reused while its sidecar still matches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

from holoserve.core.files import sha256_file
from holoserve.core.sidecar import EngineMismatchError, check_compatible, engine_cache_dir, read_sidecar

from .engine import BuildResult, build_engine
from .engine_settings import EngineBuildError, EngineOptions, Flavour, build_target, load_trt


def up_to_date(plan: Path, *, flavour: Flavour, target: Mapping[str, Any], onnx_sha256: str) -> str | None:
    """None if `plan` (with its sidecar) was built from this ONNX by this TensorRT for this target; else why not."""
    if not plan.is_file():
        return f"{plan.name} does not exist"
    try:
        side = read_sidecar(plan)
        check_compatible(side, flavour=flavour.name, version=flavour.version,
                         compute_capability=None if target.get("portable") else target.get("compute_capability"))
    except EngineMismatchError as e:
        return str(e)
    if (side.get("onnx") or {}).get("sha256") != onnx_sha256:
        return "it was built from another ONNX export"
    built = side.get("target") or {}
    if (bool(built.get("portable")), built.get("compute_capabilities")) != (
            bool(target.get("portable")), target.get("compute_capabilities")):
        return "it was built for other compute capabilities"
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (one build per engine, even with several server workers starting at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            yield
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_cached_engine(onnx_path: str | os.PathLike, cache_root: str | os.PathLike,
                        options: EngineOptions = EngineOptions(), *, onnx_sha256: str | None = None,
                        if_missing: bool = True) -> BuildResult:
    """Build into <cache>/<model>/<flavour-version-GPU>/model.plan, or reuse the engine already there.

    The key (holoserve.core.sidecar.engine_cache_dir) names the TensorRT flavour and version and the
    GPU, so one volume serves several GPUs and image versions; the build holds a lock so concurrent
    server workers build once.
    """
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise EngineBuildError(f"ONNX file {onnx_path} does not exist")
    sha = onnx_sha256 or sha256_file(onnx_path)
    _, flv = load_trt(options.flavour)
    target = build_target(flv, options.compute_capability)
    folder = engine_cache_dir(cache_root, sha, flv.name, flv.version, target)
    plan = folder / "model.plan"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EngineBuildError(f"cannot create the engine cache folder {folder}: {e}; mount a writable volume "
                               "there (the server runs as uid 10001)") from None
    with _locked(folder.with_name(folder.name + ".lock")):
        if if_missing and up_to_date(plan, flavour=flv, target=target, onnx_sha256=sha) is None:
            side = read_sidecar(plan)
            return BuildResult(plan, plan.with_name(plan.name + ".json"), side, [], skipped=True)
        return build_engine(onnx_path, plan, dataclasses.replace(options, flavour=flv.module), onnx_sha256=sha)
