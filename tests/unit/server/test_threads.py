"""The threads the server gives its backend: `--threads` when set, else the CPUs a container's quota or a
cpuset leaves the process (holoserve.core.machine.cpu_budget), else the runtime's default; /v1/models says
which and why."""
from __future__ import annotations

import os
import shutil
import sys

import httpx
import pytest

from holoserve.core.artifact import load_artifact
from holoserve.core.machine import CpuBudget
from holoserve.server import service
from holoserve.server.config import ServerConfig
from tests.helpers.serving import serve_subprocess, tiny_checkpoint


@pytest.fixture(scope="module")
def sst2():
    return tiny_checkpoint("sst2")


def _options(ckpt, **cfg):
    return service.backend_options(ServerConfig(artifact_dir=str(ckpt), **cfg), load_artifact(ckpt))


def test_the_budget_sets_threads_unless_they_are_given(sst2, monkeypatch):
    seen = []

    def budget(workers):
        seen.append(workers)
        return CpuBudget(3, "3 threads: a CPU quota of 3 CPUs (cgroup), 8 physical cores")

    monkeypatch.delenv("HOLOSERVE_ORT_THREADS", raising=False)
    monkeypatch.setattr(service, "cpu_budget", budget)
    assert _options(sst2)["threads"] == 3 and seen == [1]
    _options(sst2, workers=2)
    assert seen[-1] == 2  # the budget is shared out between the workers
    assert _options(sst2, threads=5)["threads"] == 5 and len(seen) == 2  # --threads wins, unasked
    monkeypatch.setattr(service, "cpu_budget", lambda workers: CpuBudget(None, "the runtime's default"))
    assert "threads" not in _options(sst2)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not shutil.which("taskset"),
                    reason="needs two CPUs to pin the server to one of them, and taskset")
def test_a_server_pinned_to_one_cpu_runs_one_thread(sst2):
    """`taskset -c N holoserve serve` with no thread settings: the cpuset limits the process, so ONNX Runtime
    gets one thread (its default would be one per physical core of the machine) and /v1/models says why."""
    cpu = str(min(os.sched_getaffinity(0)))
    cmd = ["taskset", "-c", cpu, sys.executable, "-m", "holoserve", "serve"]
    with serve_subprocess([str(sst2), "--backend", "onnxruntime"], env={"HOLOSERVE_THREADS": "0"}, cmd=cmd) as (url, _):
        backend = httpx.get(url + "/v1/models").json()["models"][0]["backend"]
    assert backend["intra_op_threads"] == 1, backend
    assert backend["threads_why"].startswith("1 thread: 1 of the machine's"), backend
