"""The TensorRT engine sidecar (model.plan.json): read it and refuse a plan this machine cannot run.

A serialized TensorRT plan only loads with the TensorRT build that wrote it and only runs on the
GPU architecture it was built for; loading a mismatched one fails deep inside TensorRT or, worse,
silently. The builder (export/engine.py) records both in the sidecar; a server backend calls
`check_compatible` before deserializing. Torch-free and library-free on purpose.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from .. import HoloServeError

SIDECAR_FORMAT = "holoserve-tensorrt-engine"
SIDECAR_VERSION = 1


class EngineMismatchError(HoloServeError):
    """The plan was built for another GPU or another TensorRT build than the one here."""


def sidecar_path(plan: str | os.PathLike) -> Path:
    p = Path(plan)
    return p.with_name(p.name + ".json")


def read_sidecar(plan: str | os.PathLike) -> dict[str, Any]:
    path = sidecar_path(plan)
    if not path.is_file():
        raise EngineMismatchError(
            f"{path.name} is missing next to {Path(plan).name}: rebuild the engine with `holoserve build-engine`"
        )
    try:
        side = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineMismatchError(f"{path.name} is not valid JSON ({e}); rebuild the engine") from None
    if not isinstance(side, dict) or side.get("format") != SIDECAR_FORMAT:
        raise EngineMismatchError(f"{path.name} is not a HoloServe engine sidecar")
    if int(side.get("version", 0)) > SIDECAR_VERSION:
        raise EngineMismatchError(f"{path.name} has sidecar version {side.get('version')}; upgrade holoserve")
    return side


def normalize_cc(cc: str | None) -> str | None:
    """"8.0" / "sm_80" / "SM80" -> "SM80"."""
    if cc is None:
        return None
    s = str(cc).strip().upper().replace("SM_", "SM")
    m = re.fullmatch(r"(\d+)\.(\d+)", s)
    return f"SM{m.group(1)}{m.group(2)}" if m else s


def check_compatible(
    sidecar: Mapping[str, Any], *, flavour: str, version: str, compute_capability: str | None, gpu: str | None = None
) -> None:
    """Raise EngineMismatchError unless the plan was built by this TensorRT flavour+version for this GPU.

    flavour: "tensorrt" or "tensorrt-rtx"; version: the runtime's __version__;
    compute_capability: the device's, e.g. "8.0" (None skips the GPU check, e.g. no GPU at all).
    """
    built = sidecar.get("tensorrt") or {}
    if built.get("flavour") != flavour:
        raise EngineMismatchError(
            f"the engine was built with {built.get('flavour')} {built.get('version')}, but this server runs {flavour} "
            f"{version}; rebuild it here with `holoserve build-engine`"
        )
    if str(built.get("version")) != str(version):
        raise EngineMismatchError(
            f"the engine was built with {flavour} {built.get('version')} and this machine has {version}: TensorRT "
            "plans are not portable across versions; rebuild it with `holoserve build-engine`"
        )
    want = normalize_cc((sidecar.get("target") or {}).get("compute_capability"))
    have = normalize_cc(compute_capability)
    if have is not None and want is not None and want != have:
        built_gpu = (sidecar.get("target") or {}).get("gpu") or want
        raise EngineMismatchError(
            f"the engine was built for {built_gpu} ({want}) but this GPU{f' ({gpu})' if gpu else ''} is {have}; "
            "rebuild it on (or for) this GPU with `holoserve build-engine`"
        )
