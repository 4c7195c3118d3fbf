"""How benchmarks and checkpoints name the machine they ran on (by its hardware)."""
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


def describe_cpu() -> str:
    """e.g. "2-core x86_64 CPU (AMD EPYC ...)"."""
    return f"{os.cpu_count()}-core {platform.machine()} CPU ({cpu_name()})"
