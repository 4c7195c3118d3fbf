"""Load a bench/gpu script (not a package) as a module, with its folder importable while it loads."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parents[1] / "bench" / "gpu"


def gpu_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_gpu_{name}", GPU_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(GPU_DIR))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(GPU_DIR))
    return mod
