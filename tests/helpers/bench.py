"""Load a bench/ script (not a package) as a module, with its folder importable while it loads."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
GPU_DIR = BENCH_DIR / "gpu"


def bench_module(folder: str, name: str):
    where = BENCH_DIR / folder
    spec = importlib.util.spec_from_file_location(f"bench_{folder}_{name}", where / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(where))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(where))
    return mod


def gpu_module(name: str):
    return bench_module("gpu", name)
