"""How benchmarks and checkpoints name the machine they ran on (by its hardware), and what its CPU can do."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux; empty elsewhere), e.g. {"avx512_vnni", ...}."""
    try:
        line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def describe_cpu() -> str:
    """e.g. "2-core x86_64 CPU (AMD EPYC ...)"."""
    return f"{os.cpu_count()}-core {platform.machine()} CPU ({cpu_name()})"
