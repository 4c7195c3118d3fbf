"""A Docker engine for the image tests: the client that answers, how to build with it, and the test image
built from the repository (tests/unit/docker/conftest.py makes the fixtures of it).

HOLOSERVE_CONTAINER_TESTS decides what a missing engine means: `1` (CI sets it): the tests fail; `0`: they
skip; unset: they run when an engine answers and skip otherwise.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid

import pytest

from tests.helpers.serving import REPO

IMAGE = "holoserve-test:cpu"
BASE = "python:3.11-slim-bookworm"
UID = 10001
# The image's size, base image included, as `docker image inspect` reports it (the stand-in base built by
# .ci/container-engine is 120 MB, about the official one's size). OpenVINO's CPU parts are about 115 MB of
# it; a torch, a CUDA library or a compiler slipping into the final stage would blow far past the limit.
MAX_IMAGE_MB = 480


def _run(cmd: list[str], timeout: float = 60, env: dict[str, str] | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def _clients() -> list[str]:
    """Every `docker` executable on PATH, in PATH order."""
    seen, out = set(), []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        exe = shutil.which("docker", path=d) if d else None
        if exe and os.path.realpath(exe) not in seen:
            seen.add(os.path.realpath(exe))
            out.append(exe)
    return out


class Docker:
    """A docker client that answers, and how to build with it: BuildKit through the buildx plugin where
    the client has it, else through a client that has BuildKit built in (docker < 23, e.g. Debian's
    20.10), else the classic builder."""

    def __init__(self, exe: str, build_env: dict[str, str]):
        self.exe, self.build_env = exe, build_env

    def __call__(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        return _run([self.exe, *args], timeout=timeout, check=check)

    def build(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return _run([self.exe, "build", *args], timeout=timeout, env={**os.environ, **self.build_env})

    @classmethod
    def find(cls) -> "Docker | str":
        """A Docker, or why there is none."""
        clients = _clients()
        if not clients:
            return "no docker client on PATH"
        answering, why = [], ""
        for exe in clients:
            try:
                r = _run([exe, "version", "--format", "{{.Client.Version}} {{.Server.Version}}"], timeout=20,
                         check=False)
            except (OSError, subprocess.TimeoutExpired) as e:
                why = why or f"{exe} version: {e}"
                continue
            if r.returncode == 0:
                answering.append((exe, r.stdout.split()[0]))
            else:
                why = why or f"{exe} version: {r.stderr.strip()[-300:]}"
        if not answering:
            return f"no docker engine answers ({why})"
        for exe, _ in answering:
            if _run([exe, "buildx", "version"], timeout=20, check=False).returncode == 0:
                return cls(exe, {"DOCKER_BUILDKIT": "1"})
        for exe, version in answering:
            if version.split(".")[0].isdigit() and int(version.split(".")[0]) < 23:
                return cls(exe, {"DOCKER_BUILDKIT": "1"})
        return cls(answering[0][0], {"DOCKER_BUILDKIT": "0"})


def find_docker() -> Docker:
    want = os.environ.get("HOLOSERVE_CONTAINER_TESTS", "")
    if want == "0":
        pytest.skip("HOLOSERVE_CONTAINER_TESTS=0")
    found = Docker.find()
    if isinstance(found, str):
        if want == "1":
            pytest.fail(f"HOLOSERVE_CONTAINER_TESTS=1 but {found}: run `bash .ci/container-engine` first")
        pytest.skip(f"{found} (`bash .ci/container-engine` installs and starts one)")
    return found


def build_image(docker: Docker) -> dict:
    """Build docker/Dockerfile from the repository (with .dockerignore) and return its inspect data."""
    before = docker("image", "inspect", "-f", "{{.Id}}", IMAGE, check=False).stdout.strip()
    t0 = time.monotonic()
    docker.build("-f", str(REPO / "docker" / "Dockerfile"), "-t", IMAGE, str(REPO), timeout=1800)
    info = json.loads(docker("image", "inspect", IMAGE).stdout)[0]
    info["build_s"] = time.monotonic() - t0
    if before and before != info["Id"]:  # the previous build of this tag, now untagged: not kept
        docker("rmi", before, check=False)
    return info


# ------------------------------------------------------------------ a Kubernetes container spec, run by Docker


def cpu_quantity(cpu: str) -> float:
    """A Kubernetes CPU quantity ("2", "500m") in CPUs."""
    return float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def kubelet_run_args(container: dict, mounts: list[tuple[str, str]], name: str) -> list[str]:
    """`docker run` arguments for what the kubelet does with a container spec: the test image (IMAGE) with the
    spec's args after the image's entrypoint (Kubernetes keeps it when the spec gives no command), its
    environment, user, read-only root, privilege and capability settings, CPU and memory limits and first
    port (published on loopback), and `mounts` (host path, container path) read-only."""
    sc, limits = container.get("securityContext", {}), container["resources"]["limits"]
    port = container["ports"][0]["containerPort"]
    args = ["run", "-d", "--name", name, "-p", f"127.0.0.1::{port}",
            "--cpus", f"{cpu_quantity(limits['cpu']):g}",
            "--memory", limits["memory"].replace("Gi", "g").replace("Mi", "m")]
    for host, path in mounts:
        args += ["-v", f"{host}:{path}:ro"]
    if "runAsUser" in sc:
        args += ["--user", str(sc["runAsUser"])]
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    args += [f"--cap-drop={cap}" for cap in sc.get("capabilities", {}).get("drop", [])]
    for k, v in env_of(container).items():
        args += ["-e", f"{k}={v}"]
    return [*args, IMAGE, *container.get("args", [])]


def wait_until_ready(docker: Docker, name: str, url: str | None, path: str = "/readyz",
                     timeout: float = 90) -> float:
    """Seconds until GET url+path answers 200; fails with the container's logs if it exits first or the
    time runs out (`url` None: a container whose port was never published, which can only exit)."""
    import httpx

    def logs() -> str:
        r = docker("logs", name, check=False)
        return (r.stdout + r.stderr)[-3000:]

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if url and httpx.get(url + path, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        state = json.loads(docker("inspect", name).stdout)[0]["State"]
        if not state["Running"]:
            raise AssertionError(f"the container exited ({state['ExitCode']}) before {path}:\n{logs()}")
        time.sleep(0.2)
    raise AssertionError(f"{path} not 200 after {timeout} s:\n{logs()}")


@contextlib.contextmanager
def run_as_kubelet(docker: Docker, container: dict, mounts: list[tuple[str, str]], timeout: float = 120):
    """The container spec run as kubelet_run_args says, until its readiness probe answers 200: yields
    (container name, base URL of its first port); removed at the end."""
    name = f"holoserve-k8s-{uuid.uuid4().hex[:10]}"
    docker(*kubelet_run_args(container, mounts, name))
    try:
        port = docker("port", name, f"{container['ports'][0]['containerPort']}/tcp").stdout.split()[0]
        url = "http://" + port
        wait_until_ready(docker, name, url, container["readinessProbe"]["httpGet"]["path"], timeout)
        yield name, url
    finally:
        docker("rm", "-f", name, check=False)
