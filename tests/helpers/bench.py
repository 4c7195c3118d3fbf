"""Import a bench/ script as the module the repository root runs it as (`python -m bench.FOLDER.NAME`)."""
from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "bench"
GPU_DIR = BENCH_DIR / "gpu"


def bench_module(folder: str, name: str):
    return importlib.import_module(f"bench.{folder}.{name}")


def gpu_module(name: str):
    return bench_module("gpu", name)
