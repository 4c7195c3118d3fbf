"""The TensorRT engine sidecar (model.plan.json): read it and refuse a plan this machine cannot run.

A serialized TensorRT plan only loads with the TensorRT build that wrote it and only runs on the
GPU architecture it was built for; loading a mismatched one fails deep inside TensorRT or, worse,
silently. The builder (export/engine.py) records both in the sidecar; a server backend calls
`check_compatible` before deserializing. Library-free on purpose: the GPU probe imports cuda-python
lazily and otherwise asks nvidia-smi.

Also here, because the builder and the backend must agree on them: which GPU this process runs on
(`current_gpu`), and where an engine built at start-up is kept (`engine_cache_dir`): one folder per
model, TensorRT flavour + version and GPU, so a volume shared by several GPUs or image versions never
hands a plan to the wrong one.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

from .. import HoloServeError

SIDECAR_FORMAT = "holoserve-tensorrt-engine"
SIDECAR_VERSION = 1
# What an unpinned TensorRT-RTX build runs on: compute capability 8.0, 8.6, 8.9 and 12.0 "and later"
# (TensorRT-RTX documentation, CPU-only AOT engines). Turing (SM75) needs a pinned build.
RTX_PORTABLE = ("SM80", "SM86", "SM89", "SM120")


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


def _cc_major(label: str) -> int:
    """"SM120" -> 12, "SM86" -> 8 (the last digit is the minor version)."""
    digits = label[2:] if label.startswith("SM") else label
    return int(digits[:-1]) if digits.isdigit() and len(digits) >= 2 else -1


def portable_runs_on(target: Mapping[str, Any], cc_label: str) -> bool:
    """Whether a portable TensorRT-RTX engine (target["portable"]) covers this compute capability."""
    ccs = [normalize_cc(c) for c in (target.get("compute_capabilities") or RTX_PORTABLE)]
    newest = max((_cc_major(c) for c in ccs), default=-1)
    return cc_label in ccs or (newest >= 12 and _cc_major(cc_label) >= newest)  # "12.0 and later"


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
    target = sidecar.get("target") or {}
    have = normalize_cc(compute_capability)
    if have is None:
        return
    if target.get("portable"):
        if not portable_runs_on(target, have):
            ccs = ", ".join(target.get("compute_capabilities") or RTX_PORTABLE)
            raise EngineMismatchError(
                f"the engine is a portable TensorRT-RTX engine for {ccs}, but this GPU{f' ({gpu})' if gpu else ''} "
                f"is {have}; rebuild it for this GPU with `holoserve build-engine --compute-capability {have}`"
            )
        return
    want = normalize_cc(target.get("compute_capability"))
    if want is not None and want != have:
        built_gpu = target.get("gpu") or want
        raise EngineMismatchError(
            f"the engine was built for {built_gpu} ({want}) but this GPU{f' ({gpu})' if gpu else ''} is {have}; "
            "rebuild it on (or for) this GPU with `holoserve build-engine`"
        )


# ------------------------------------------------------------------------------------------ this GPU


def _cudart():
    for mod in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            return importlib.import_module(mod)
        except ImportError:
            continue
    return None


def _cuda_gpu() -> dict[str, Any] | None:
    """The current CUDA device (the one TensorRT uses) through cuda-python's runtime API."""
    cudart = _cudart()
    if cudart is None:
        return None
    try:
        err, dev = cudart.cudaGetDevice()
        if int(err) != 0:
            return None
        err, prop = cudart.cudaGetDeviceProperties(dev)
        if int(err) != 0:
            return None
        name = prop.name
        name = (name.decode("utf-8", "replace") if isinstance(name, (bytes, bytearray)) else str(name)).split("\x00")[0]
        return {"name": name.strip(), "compute_capability": f"{int(prop.major)}.{int(prop.minor)}",
                "device": int(dev), "source": "cuda"}
    except Exception:  # no driver, no device, an old binding: fall back to nvidia-smi
        return None


def pick_visible_gpu(rows: Sequence[Sequence[str]], visible: str | None) -> Sequence[str] | None:
    """The nvidia-smi row (index, uuid, name, compute_cap) of CUDA's device 0 under CUDA_VISIBLE_DEVICES."""
    if visible is None:
        return rows[0] if rows else None
    first = visible.split(",")[0].strip()
    if first in ("", "-1", "none", "NoDevFiles"):
        return None
    for row in rows:
        index, uuid = row[0].strip(), row[1].strip()
        if first.isdigit() and index == first:
            return row
        if not first.isdigit() and uuid and (uuid.startswith(first) or first.removeprefix("MIG-").startswith(uuid)):
            return row
    return None


def _smi_gpu() -> dict[str, Any] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=index,uuid,name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[c.strip() for c in ln.split(",")] for ln in out.strip().splitlines() if ln.count(",") >= 3]
    # index, uuid, name (may contain commas), compute_cap
    rows = [[r[0], r[1], ",".join(r[2:-1]), r[-1]] for r in rows]
    row = pick_visible_gpu(rows, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if row is None:
        return None
    return {"name": row[2], "compute_capability": row[3], "device": int(row[0]) if row[0].isdigit() else None,
            "source": "nvidia-smi"}


def current_gpu() -> dict[str, Any] | None:
    """Name and compute capability ("8.6") of the GPU this process runs on, or None without one.

    CUDA's current device first (cuda-python), as TensorRT sees it; else nvidia-smi's row for the first
    entry of CUDA_VISIBLE_DEVICES (nvidia-smi orders by PCI bus, CUDA by speed unless
    CUDA_DEVICE_ORDER=PCI_BUS_ID, so this fallback can differ on a mixed multi-GPU machine).
    """
    return _cuda_gpu() or _smi_gpu()


# ------------------------------------------------------------------------------------------ engine cache


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.+]+", "-", text.lower()).strip("-")


def engine_cache_key(flavour: str, version: str, target: Mapping[str, Any]) -> str:
    """Folder name for one TensorRT build + GPU: "tensorrt-10.5.0.18-sm86-nvidia-a10",
    "tensorrt-rtx-1.7.1.116-portable"."""
    if target.get("portable"):
        ccs = [normalize_cc(c) for c in target.get("compute_capabilities") or RTX_PORTABLE]
        cc = "portable" if tuple(ccs) == RTX_PORTABLE else "+".join(ccs)
    else:
        cc = normalize_cc(target.get("compute_capability")) or "unknown"
    parts = [flavour, version, cc.lower()] + ([target["gpu"]] if target.get("gpu") else [])
    return _slug("-".join(str(p) for p in parts))


def engine_cache_dir(cache_root: str | os.PathLike, model_id: str, flavour: str, version: str,
                     target: Mapping[str, Any]) -> Path:
    """<cache>/<model id: the ONNX file's sha256, 16 hex digits>/<engine_cache_key>/ (holds model.plan + .json)."""
    return Path(cache_root) / model_id[:16] / engine_cache_key(flavour, version, target)


def cached_engines(cache_root: str | os.PathLike, model_id: str) -> list[Path]:
    """Every plan in the cache for this model that has its sidecar next to it (newest first)."""
    base = Path(cache_root) / model_id[:16]
    if not base.is_dir():
        return []
    plans = [p for p in base.glob("*/model.plan") if sidecar_path(p).is_file()]
    return sorted(plans, key=lambda p: sidecar_path(p).stat().st_mtime, reverse=True)
