"""How benchmarks and checkpoints name the machine they ran on (by its hardware), and what its CPU can do."""
from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass
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


# ---------------------------------------------------------------------------------------------- CPU budget
# ONNX Runtime and OpenVINO size their thread pools from the machine's cores, not from a container's CPU
# quota (`docker run --cpus`, Kubernetes `limits.cpu`) or a cpuset: in a 2-CPU pod on a 64-core node they
# start 64 threads, and the kernel throttles the process every scheduling period. The budget below is what
# the server gives them instead, wherever such a limit exists.

CGROUP_ROOT = Path("/sys/fs/cgroup")
SYS_CPU = Path("/sys/devices/system/cpu")


def _cgroup_dirs(proc_cgroup: str, root: Path) -> list[tuple[str, Path]]:
    """(version, folder) of this process's CPU cgroup and each of its ancestors, innermost first: cgroup v2
    (`0::/path` under root) and v1 (the `cpu` controller's mount). In a container the path /proc names may be
    the host's and not exist under the container's mount, whose root is then the container's own cgroup."""
    found: list[tuple[str, Path]] = []
    for line in proc_cgroup.splitlines():
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":
            version, mount = "v2", root
        elif "cpu" in controllers.split(","):
            version = "v1"
            mount = next((root / name for name in (controllers, "cpu", "cpu,cpuacct") if (root / name).is_dir()),
                         None)
            if mount is None:
                continue
        else:
            continue
        rel = Path(path.strip().lstrip("/"))
        chain = [mount / rel, *(mount / p for p in rel.parents)] if rel.parts else [mount]
        found += [(version, d) for d in chain if d.is_dir()]
    return found


def _quota(version: str, folder: Path) -> float | None:
    """CPUs' worth of time per period this cgroup allows, or None where it sets no limit (or says nothing)."""
    try:
        if version == "v2":
            quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
            if quota == "max":
                return None
            return int(quota) / int(period or 100000)
        quota_us = int((folder / "cpu.cfs_quota_us").read_text())
        period_us = int((folder / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError, ZeroDivisionError):
        return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors (CPUs, e.g. 1.5), or None where
    there is none (Linux cgroup v1 or v2; None elsewhere)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    limits = [q for q in (_quota(v, d) for v, d in _cgroup_dirs(proc_cgroup, root)) if q is not None]
    return min(limits) if limits else None


def physical_cores(cpus: set[int], sys_cpu: Path = SYS_CPU) -> int:
    """How many physical cores the logical CPUs `cpus` lie on (SMT siblings count once), from sysfs; where
    the topology is unreadable, one core per CPU."""
    cores = set()
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


@dataclass(frozen=True)
class CpuBudget:
    threads: int | None  # intra-op threads per model; None: the runtime's own default is right here
    why: str


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity: a cpuset, `taskset`)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """The physical cores this process may run on (its affinity)."""
    return physical_cores(allowed_cpus())


def per_instance_threads(threads: int | None, instances: int) -> int:
    """The intra-op threads of each of `instances` batches run at once: their share of `threads` (0 or None:
    of the usable cores), at least 1; 0 (the runtime's default) for a single instance given none."""
    if instances <= 1:
        return int(threads or 0)
    return max(1, int(threads or usable_cores()) // instances)


def cpu_budget(workers: int = 1, *, quota: float | None | bool = True, affinity: set[int] | None = None,
               host_cpus: int | None = None, sys_cpu: Path = SYS_CPU) -> CpuBudget:
    """The intra-op threads each of `workers` model copies should use: the physical cores this process may
    run on (its affinity: a cpuset, `taskset`), at most the cgroup's CPU quota rounded down (at least 1),
    shared out between the workers. Where neither limits the process, None: the runtimes' own default (the
    machine's physical cores) is already that. `quota` True reads the cgroup; the other arguments stand in
    for the machine in tests."""
    if quota is True:
        quota = cgroup_cpu_limit()
    if affinity is None:
        affinity = allowed_cpus()
    host = host_cpus if host_cpus is not None else (os.cpu_count() or len(affinity))
    limits = []
    if len(affinity) < host:
        limits.append(f"{len(affinity)} of the machine's {host} CPUs allowed (cpuset or affinity)")
    if quota is not None:
        limits.append(f"a CPU quota of {quota:g} CPU{'s' * (quota != 1)} (cgroup)")
    if not limits:
        return CpuBudget(None, "the runtime's default: no CPU quota or cpuset limits this process")
    cores = physical_cores(affinity, sys_cpu)
    total = min(cores, max(1, math.floor(quota + 1e-9))) if quota is not None else cores
    threads = max(1, total // max(1, workers))
    split = f", shared by {workers} workers" if workers > 1 else ""
    return CpuBudget(threads, f"{threads} thread{'s' * (threads != 1)}: {' and '.join(limits)}, "
                              f"{cores} physical core{'s' * (cores != 1)}{split}")
