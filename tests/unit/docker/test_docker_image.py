"""The CPU image for real: build docker/Dockerfile with a Docker engine, run it as users do (a checkpoint
mounted read-only at /model, the port published on loopback), and probe it over HTTP.

Needs a Docker engine that answers `docker info` and the base image (`bash .ci/container-engine` installs
and starts Debian's docker.io and builds python:3.11-slim-bookworm locally where no registry is
reachable). HOLOSERVE_CONTAINER_TESTS decides what a missing engine means: `1` (CI sets it): the tests
fail; `0`: they skip; unset: they run when an engine answers and skip otherwise.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid

import httpx
import pytest

from tests.helpers.serving import REPO, tiny_checkpoint, wait_metric

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


@pytest.fixture(scope="module")
def docker() -> Docker:
    want = os.environ.get("HOLOSERVE_CONTAINER_TESTS", "")
    if want == "0":
        pytest.skip("HOLOSERVE_CONTAINER_TESTS=0")
    found = Docker.find()
    if isinstance(found, str):
        if want == "1":
            pytest.fail(f"HOLOSERVE_CONTAINER_TESTS=1 but {found}: run `bash .ci/container-engine` first")
        pytest.skip(f"{found} (`bash .ci/container-engine` installs and starts one)")
    return found


@pytest.fixture(scope="module")
def image(docker: Docker) -> dict:
    """Build docker/Dockerfile from the repository (with .dockerignore) and return its inspect data."""
    before = docker("image", "inspect", "-f", "{{.Id}}", IMAGE, check=False).stdout.strip()
    t0 = time.monotonic()
    docker.build("-f", str(REPO / "docker" / "Dockerfile"), "-t", IMAGE, str(REPO), timeout=1800)
    info = json.loads(docker("image", "inspect", IMAGE).stdout)[0]
    info["build_s"] = time.monotonic() - t0
    if before and before != info["Id"]:  # the previous build of this tag, now untagged: not kept
        docker("rmi", before, check=False)
    return info


class Container:
    """`docker run -d` of the image with a checkpoint mounted read-only at /model and port 8000 published
    on a free loopback port; removed (forcibly) at the end."""

    def __init__(self, docker: Docker, ckpt, env: dict[str, str] | None = None):
        self.docker = docker
        self.name = f"holoserve-test-{uuid.uuid4().hex[:10]}"
        args = ["run", "-d", "--name", self.name, "-p", "127.0.0.1::8000", "-v", f"{ckpt}:/model:ro"]
        for k, v in (env or {}).items():
            args += ["-e", f"{k}={v}"]
        docker(*args, IMAGE)
        self.url = "http://" + docker("port", self.name, "8000/tcp").stdout.split()[0]

    def inspect(self) -> dict:
        return json.loads(self.docker("inspect", self.name).stdout)[0]

    def logs(self) -> str:
        r = self.docker("logs", self.name, check=False)
        return r.stdout + r.stderr

    def wait_ready(self, timeout: float = 90) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            state = self.inspect()["State"]
            if not state["Running"]:
                raise AssertionError(f"the container exited ({state['ExitCode']}) before /readyz:\n{self.logs()[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"/readyz not 200 after {timeout} s:\n{self.logs()[-3000:]}")

    def remove(self) -> None:
        self.docker("rm", "-f", self.name, check=False)


def both_cpu_exports(root) -> object:
    """A tiny SST-2 checkpoint whose widths the 2:4 kernels take (64, 128), exported as `holoserve export`
    exports by default where OpenVINO is installed: for ONNX Runtime and for OpenVINO."""
    from holoserve.export.onnx_export import export_checkpoint
    from tests.helpers.tiny import calibrated_tiny_checkpoint

    *_, art = calibrated_tiny_checkpoint(root, hidden=64, intermediate=128, max_seq_length=32)
    export_checkpoint(art.path, ["onnxruntime", "openvino"], progress=False, polygraphy=False)
    for p in [art.path, *art.path.iterdir()]:  # readable by the image's user
        p.chmod(0o755 if p.is_dir() else 0o644)
    return art.path


def expected_kernels() -> str:
    """How the image's OpenVINO backend must describe the 2:4 kernels on this CPU (holoserve.backends.openvino)."""
    from holoserve.core.machine import cpu_flags
    from holoserve.kernels import REQUIRED_FLAGS

    flags = cpu_flags()
    if "amx_int8" in flags:
        return "off: this CPU has AMX"
    if not set(REQUIRED_FLAGS) <= flags:
        return "off: this CPU lacks"
    return "on (HoloServe's 2:4 INT8 kernels"


@pytest.fixture(scope="module")
def containers(docker: Docker, image: dict, tmp_path_factory):
    """Two containers started together: an SST-2 model (single texts, exported for both CPU backends) with the
    image's defaults, and an MRPC model (text pairs, ONNX Runtime only) whose long queue delay keeps a
    request in flight long enough to stop it under load."""
    sst2, mrpc = both_cpu_exports(tmp_path_factory.mktemp("image-sst2")), tiny_checkpoint("mrpc")
    started = []
    try:
        started.append(Container(docker, sst2))
        started.append(Container(docker, mrpc, {"HOLOSERVE_MAX_BATCH_SIZE": "8",
                                                 "HOLOSERVE_MAX_QUEUE_DELAY_MS": "2000"}))
        for c in started:
            c.wait_ready()
        yield {"sst2": started[0], "mrpc": started[1]}
    finally:
        for c in started:
            c.remove()


def test_image_is_small_and_configured(image):
    size_mb = image["Size"] / 1e6
    assert size_mb < MAX_IMAGE_MB, f"the image is {size_mb:.0f} MB (limit {MAX_IMAGE_MB} MB)"
    cfg = image["Config"]
    assert cfg["User"] == f"{UID}:{UID}"
    assert cfg["Entrypoint"] == ["holoserve", "serve"] and "8000/tcp" in cfg["ExposedPorts"]
    assert cfg["Healthcheck"]["Test"] == ["CMD", "python", "-m", "holoserve.server.healthcheck"]


def test_probes_and_models(containers):
    url = containers["sst2"].url
    assert httpx.get(url + "/healthz").status_code == 200
    r = httpx.get(url + "/readyz")
    assert r.status_code == 200 and "ready" in r.text
    models = httpx.get(url + "/v1/models").json()["models"]
    assert len(models) == 1
    m = models[0]
    assert m["name"] == "model" and m["task"]["name"] == "sst2"
    assert m["sparsity"]["pattern"] == "2:4" and m["precision"] == "int8"


def test_auto_serves_the_fastest_cpu_backend_with_the_prebuilt_kernels(containers):
    """No backend flags: `auto` timed OpenVINO (with the image's prebuilt 2:4 kernels where this CPU runs
    them) against ONNX Runtime and says so; the image has no compiler, so the kernels were not built here."""
    c = containers["sst2"]
    backend = httpx.get(c.url + "/v1/models").json()["models"][0]["backend"]
    selection, kernels = backend["selection"], expected_kernels()
    assert "the fastest CPU backend" in selection and "openvino" in selection and "onnxruntime" in selection
    assert re.search(r"openvino with the 2:4 kernels " + re.escape(kernels), selection), selection
    if "openvino" in backend["backend"]:  # alone, or routed with ONNX Runtime by batch size
        assert backend["kernels"]["status"].startswith(kernels), backend["kernels"]
        if kernels.startswith("on"):
            assert backend["kernels"]["Sparse24Ffn"] == 2, backend["kernels"]
    assert "building the 2:4 kernels" not in c.logs()
    r = c.docker("exec", c.name, "sh", "-c", "command -v g++ cc gcc || echo none", check=False)
    assert r.stdout.split() == ["none"], r.stdout


def test_predict_single_and_batch(containers):
    url = containers["sst2"].url
    r = httpx.post(url + "/predict", json={"text": "a gripping, funny film"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"]["backend"] in ("openvino", "onnxruntime") and len(body["predictions"]) == 1
    assert body["predictions"][0]["label"] in ("negative", "positive")
    texts = ["loved it", "a dull mess", "the movie was good", "i hated it"]
    r = httpx.post(url + "/predict", json={"texts": texts})
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert len(preds) == len(texts) and all(abs(sum(p["scores"].values()) - 1) < 1e-4 for p in preds)
    # The same text alone and in a batch: the same scores.
    alone = httpx.post(url + "/predict", json={"text": texts[2]}).json()["predictions"][0]
    assert alone["scores"] == pytest.approx(preds[2]["scores"], abs=1e-4)
    r = httpx.post(url + "/predict", json={"pairs": [["a", "b"]]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "wrong_input_kind"


def test_predict_pairs(containers):
    url = containers["mrpc"].url
    pairs = [["a man is riding a horse", "a man rides a horse"], ["the cat sat", "stocks fell sharply"]]
    r = httpx.post(url + "/predict", json={"pairs": pairs}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["predictions"]) == 2 and body["model"]["backend"] == "onnxruntime"
    r = httpx.post(url + "/predict", json={"text": "one text"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "wrong_input_kind"


def test_runs_as_non_root(containers):
    c = containers["sst2"]
    # The server process itself (PID 1), not just what `docker exec` would run as.
    status = c.docker("exec", c.name, "cat", "/proc/1/status").stdout
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    gids = next(line for line in status.splitlines() if line.startswith("Gid:")).split()[1:]
    assert set(uids) == {str(UID)} and set(gids) == {str(UID)}
    # The mount is read-only and the image's files are not the user's to change.
    r = c.docker("exec", c.name, "sh", "-c", "touch /model/x || echo refused; "
                 "touch \"$(python -c 'import holoserve; print(holoserve.__file__)')\" || echo refused", check=False)
    assert r.stdout.split() == ["refused", "refused"], r.stdout + r.stderr


def test_healthcheck_turns_healthy(containers):
    """The image's own HEALTHCHECK (every 15 s, the first one 15 s after the start) as the engine runs it."""
    c = containers["sst2"]
    deadline = time.monotonic() + 60
    while True:
        health = c.inspect()["State"]["Health"]
        if health["Status"] == "healthy":
            break
        assert health["Status"] == "starting", health
        assert time.monotonic() < deadline, f"not healthy after 60 s: {health}"
        time.sleep(0.5)
    assert health["Log"] and health["Log"][-1]["ExitCode"] == 0


def test_docker_stop_drains_in_flight_requests_and_exits_0(containers):
    c = containers["mrpc"]
    out: dict[str, object] = {}

    def ask():
        try:
            out["r"] = httpx.post(c.url + "/predict", json={"pairs": [["the movie was good", "it was fine"]]},
                                  timeout=60)
        except Exception as e:  # reported by the assertion below
            out["r"] = e

    t = threading.Thread(target=ask)
    t.start()
    wait_metric(c.url, "holoserve_inference_pending_request_count", lambda v: v >= 1)  # it waits in the queue
    t0 = time.monotonic()
    c.docker("stop", "-t", "30", c.name, timeout=60)
    stop_s = time.monotonic() - t0
    t.join(60)
    r = out.get("r")
    assert isinstance(r, httpx.Response), f"the in-flight request failed: {r!r}\n{c.logs()[-3000:]}"
    assert r.status_code == 200, r.text
    assert r.json()["timing_ms"]["queue"] > 1000  # it was in flight when the signal came
    state = c.inspect()["State"]
    assert state["ExitCode"] == 0 and not state["OOMKilled"], (state, c.logs()[-3000:])
    assert stop_s < 20, f"docker stop took {stop_s:.1f} s (the engine kills at 30 s)"
    msgs = [json.loads(line).get("msg") for line in c.logs().splitlines() if line.startswith("{")]
    assert "stopped" in msgs and msgs[-1].startswith("Finished server process")


def test_docker_stop_of_an_idle_server_exits_0(containers):
    c = containers["sst2"]
    t0 = time.monotonic()
    c.docker("stop", "-t", "30", c.name, timeout=60)
    assert time.monotonic() - t0 < 10
    assert c.inspect()["State"]["ExitCode"] == 0, c.logs()[-3000:]
