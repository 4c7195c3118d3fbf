"""The CPU budget the server gives the runtimes' thread pools: cgroup v1 and v2 quotas, cpusets and SMT,
read from stand-in /sys trees built here (the real ones are the machine's, whatever limits it has)."""
from __future__ import annotations

from pathlib import Path

import pytest

from holoserve.core.machine import cgroup_cpu_limit, cpu_budget, physical_cores


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_the_container_and_of_an_ancestor(tmp_path):
    # a container's own cgroup namespace: /proc says "0::/", the mount's root is its cgroup
    _write(tmp_path / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/\n") == pytest.approx(1.5)
    # a pod's container under a pod cgroup with a tighter quota: the tightest one holds
    _write(tmp_path / "kubepods" / "pod1" / "cpu.max", "50000 100000\n")
    _write(tmp_path / "kubepods" / "pod1" / "c1" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/kubepods/pod1/c1\n") == pytest.approx(0.5)


def test_no_quota_reads_as_none(tmp_path):
    _write(tmp_path / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/\n") is None
    assert cgroup_cpu_limit(tmp_path / "missing", "0::/\n") is None
    assert cgroup_cpu_limit(tmp_path, "") is None
    _write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path, "3:cpu,cpuacct:/\n") is None


def test_cgroup_v1_quota_with_a_host_path_the_container_cannot_see(tmp_path):
    """Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names the host's path
    (/docker/<id>), the container's mount holds its own cgroup at the root."""
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "200000\n")
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    proc = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/system.slice\n"
    assert cgroup_cpu_limit(tmp_path, proc) == pytest.approx(2.0)


def _topology(root: Path, cores: list[int]) -> Path:
    for cpu, core in enumerate(cores):
        _write(root / f"cpu{cpu}" / "topology" / "physical_package_id", "0\n")
        _write(root / f"cpu{cpu}" / "topology" / "core_id", f"{core}\n")
    return root


def test_smt_siblings_count_once(tmp_path):
    sys_cpu = _topology(tmp_path, [0, 1, 0, 1])  # 2 cores with 2 threads each
    assert physical_cores({0, 1, 2, 3}, sys_cpu) == 2
    assert physical_cores({0, 2}, sys_cpu) == 1
    assert physical_cores({0, 9}, sys_cpu) == 2  # unreadable topology: one core per CPU


def test_budget_follows_quota_cpuset_and_workers(tmp_path):
    sys_cpu = _topology(tmp_path, list(range(64)))
    every = set(range(64))
    free = cpu_budget(quota=None, affinity=every, host_cpus=64, sys_cpu=sys_cpu)
    assert free.threads is None and "default" in free.why
    pod = cpu_budget(quota=2.0, affinity=every, host_cpus=64, sys_cpu=sys_cpu)
    assert pod.threads == 2 and "quota of 2 CPUs" in pod.why
    assert cpu_budget(quota=1.5, affinity=every, host_cpus=64, sys_cpu=sys_cpu).threads == 1  # never throttled
    assert cpu_budget(quota=0.25, affinity=every, host_cpus=64, sys_cpu=sys_cpu).threads == 1
    shared = cpu_budget(4, quota=8.0, affinity=every, host_cpus=64, sys_cpu=sys_cpu)
    assert shared.threads == 2 and "shared by 4 workers" in shared.why
    pinned = cpu_budget(quota=None, affinity={0, 1, 2}, host_cpus=64, sys_cpu=sys_cpu)
    assert pinned.threads == 3 and "3 of the machine's 64 CPUs" in pinned.why
    both = cpu_budget(quota=16.0, affinity={0, 1, 2}, host_cpus=64, sys_cpu=sys_cpu)
    assert both.threads == 3
