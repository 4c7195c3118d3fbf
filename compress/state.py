"""Resumable training state: safetensors + JSON, written atomically, never pickled.

A state folder holds `<name>.safetensors` (model, optimizer moments, ADMM Z/U, RNG states) and
`<name>.json` (step, schedule, metrics). The JSON is written last and records the sha256 of the
tensors file, so a half-written save is never mistaken for a complete one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load, save

from holoserve import HoloServeError
from holoserve.core.files import atomic_write_bytes, atomic_write_json, sha256_file


def _contiguous(t: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared/non-contiguous storage; copies are cheap next to a training step
    return {k: v.detach().contiguous().clone() for k, v in t.items()}


def save_state(folder: str | os.PathLike, name: str, tensors: Mapping[str, torch.Tensor],
               meta: Mapping[str, Any]) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tpath = folder / f"{name}.safetensors"
    atomic_write_bytes(tpath, save(_contiguous(tensors)))
    atomic_write_json(folder / f"{name}.json", {**meta, "tensors_sha256": sha256_file(tpath)})


def load_state(folder: str | os.PathLike, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """(tensors, meta) of a complete save, or None when there is none."""
    folder = Path(folder)
    jpath, tpath = folder / f"{name}.json", folder / f"{name}.safetensors"
    if not jpath.is_file() or not tpath.is_file():
        return None
    try:
        meta = json.loads(jpath.read_text())
    except json.JSONDecodeError as e:
        raise HoloServeError(f"training state {jpath} is damaged ({e}); delete it or pass --restart") from None
    if sha256_file(tpath) != meta.get("tensors_sha256"):
        raise HoloServeError(f"training state {tpath} does not match {jpath.name}; delete it or pass --restart")
    return load(tpath.read_bytes()), meta


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for idx, st in opt.state_dict()["state"].items():
        for key, val in st.items():
            out[f"opt.{idx}.{key}"] = val if torch.is_tensor(val) else torch.tensor(val)
    return out


def load_optimizer(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    sd = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, val in tensors.items():
        if key.startswith("opt."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = val.clone()
    sd["state"] = state
    opt.load_state_dict(sd)


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout on the GPU draws from here
        out["rng.cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(tensors: Mapping[str, torch.Tensor]) -> None:
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
