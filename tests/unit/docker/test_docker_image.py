"""The CPU image for real: build docker/Dockerfile with a Docker engine, run it as users do (a checkpoint
mounted read-only at /model, the port published on loopback), and probe it over HTTP.

Needs a Docker engine that answers `docker info` and the base image (`bash .ci/container-engine` installs
and starts Debian's docker.io and builds python:3.11-slim-bookworm locally where no registry is
reachable); tests/helpers/containers.py finds the engine and builds the image.
"""
from __future__ import annotations

import json
import re
import threading
import time
import uuid

import httpx
import pytest

from tests.helpers.containers import IMAGE, MAX_IMAGE_MB, UID, Docker, wait_until_ready
from tests.helpers.serving import tiny_checkpoint, wait_metric


class Container:
    """`docker run -d` of the image with a checkpoint mounted read-only at /model and port 8000 published
    on a free loopback port; removed (forcibly) at the end."""

    def __init__(self, docker: Docker, ckpt, env: dict[str, str] | None = None, run_args: tuple[str, ...] = ()):
        self.docker = docker
        self.name = f"holoserve-test-{uuid.uuid4().hex[:10]}"
        args = ["run", "-d", "--name", self.name, "-p", "127.0.0.1::8000", "-v", f"{ckpt}:/model:ro", *run_args]
        for k, v in (env or {}).items():
            args += ["-e", f"{k}={v}"]
        docker(*args, IMAGE)
        # None where the container has already exited (a server that refuses to start)
        port = docker("port", self.name, "8000/tcp", check=False).stdout.split()
        self.url = "http://" + port[0] if port else None

    def inspect(self) -> dict:
        return json.loads(self.docker("inspect", self.name).stdout)[0]

    def logs(self) -> str:
        r = self.docker("logs", self.name, check=False)
        return r.stdout + r.stderr

    def wait_ready(self, timeout: float = 90) -> float:
        return wait_until_ready(self.docker, self.name, self.url, "/readyz", timeout)

    def wait_exit(self, timeout: float = 90) -> dict:
        """The container's State once it has stopped; fails if it still runs after `timeout` s."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            state = self.inspect()["State"]
            if not state["Running"]:
                return state
            time.sleep(0.2)
        raise AssertionError(f"the container still runs after {timeout} s:\n{self.logs()[-3000:]}")

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


def int8_exact() -> bool:
    """Whether OpenVINO's INT8 GEMMs are exact on this CPU (VNNI), as the image's server measures it."""
    from holoserve.backends.openvino import _measured_saturates

    return not _measured_saturates()


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


# The server's settings that force the 2:4 kernels on (holoserve.server.config: `serve --backend openvino
# --openvino-kernels on`), with the float ops in f32, the checkpoint's numerics, so that the predictions can
# be held against ONNX Runtime's.
KERNELS_ON = {"HOLOSERVE_BACKEND": "openvino", "HOLOSERVE_OPENVINO_KERNELS": "on",
              "HOLOSERVE_OPENVINO_PRECISION": "f32"}
# The same on the kernels' portable reference build, which the image ships too and any x86-64 CPU runs.
KERNELS_REFERENCE = {**KERNELS_ON, "HOLOSERVE_OPENVINO_KERNELS": "reference"}


@pytest.fixture(scope="module")
def sst2_checkpoint(tmp_path_factory):
    return both_cpu_exports(tmp_path_factory.mktemp("image-sst2"))


@pytest.fixture(scope="module")
def containers(docker: Docker, image: dict, sst2_checkpoint):
    """Three containers started together: an SST-2 model (single texts, exported for both CPU backends) with
    the image's defaults; an MRPC model (text pairs, ONNX Runtime only) under a CPU quota of one CPU
    (`--cpus 1`), whose long queue delay keeps a request in flight long enough to stop it under load; the
    SST-2 model with the 2:4 kernels forced on (KERNELS_ON), which serves only on a CPU that runs them and
    refuses to start elsewhere, so it is left to its test to wait for; and the SST-2 model on the kernels'
    reference build (KERNELS_REFERENCE), which serves on any CPU."""
    started = []
    try:
        started.append(Container(docker, sst2_checkpoint))
        started.append(Container(docker, tiny_checkpoint("mrpc"), {"HOLOSERVE_MAX_BATCH_SIZE": "8",
                                                                    "HOLOSERVE_MAX_QUEUE_DELAY_MS": "2000"},
                                 run_args=("--cpus", "1")))
        started.append(Container(docker, sst2_checkpoint, KERNELS_ON))
        started.append(Container(docker, sst2_checkpoint, KERNELS_REFERENCE))
        for c in started[:2]:
            c.wait_ready()
        yield {"sst2": started[0], "mrpc": started[1], "kernels_on": started[2], "kernels_reference": started[3]}
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
    if not int8_exact():  # OpenVINO's INT8 GEMMs saturate here: left out, ONNX Runtime (exact) serves
        assert backend["backend"] == "onnxruntime" and re.search(r"openvino: OpenVINO's int8 GEMMs saturate",
                                                                  selection), selection
    else:
        assert "the fastest CPU backend" in selection and "openvino" in selection and "onnxruntime" in selection
        assert re.search(r"openvino with the 2:4 kernels " + re.escape(kernels), selection), selection
    if "openvino" in backend["backend"]:  # alone, or routed with ONNX Runtime by batch size
        assert backend["kernels"]["status"].startswith(kernels), backend["kernels"]
        if kernels.startswith("on"):
            assert backend["kernels"]["Sparse24Ffn"] == 2, backend["kernels"]
    assert "building the 2:4 kernels" not in c.logs()
    r = c.docker("exec", c.name, "sh", "-c", "command -v g++ cc gcc || echo none", check=False)
    assert r.stdout.split() == ["none"], r.stdout


# Run inside the image as the server's user, on the checkpoint mounted at /model: each step of the kernels'
# path that this CPU can take, as JSON. The library is compiled for x86-64-v4, its extension entry point
# too, so only a CPU with AVX-512 (LOADER_FLAGS) can have OpenVINO load it; on any CPU the dynamic loader
# links it against the image's OpenVINO and finds that entry point. Compiling waits for a CPU that runs the
# kernels.
KERNELS_PATH = """
import ctypes, json, sys
import onnx, openvino as ov
from holoserve import kernels
from holoserve.backends.openvino import read_model
from holoserve.core.artifact import load_artifact
from holoserve.core.machine import cpu_flags
from holoserve.core.manifest import OPENVINO
from holoserve.kernels.rewrite import rewrite

library = kernels.library_path()
if library is None:
    sys.exit(f"no prebuilt library of the 2:4 kernels in {kernels.cache_dir()} matches this image")
out = {"library": str(library)}
ctypes.CDLL(out["library"]).create_extensions
out["links"] = True
art = load_artifact("/model")
path = art.path / art.export(OPENVINO).file
out["counts"] = rewrite(onnx.load(str(path)))[1]
if set(sys.argv[1].split(",")) <= cpu_flags():
    core = ov.Core()
    core.add_extension(out["library"])
    out["loaded"] = True
    if not kernels.cpu_missing():
        model, _ = read_model(core, path, library)
        ops = [op.get_type_name() for op in model.get_ordered_ops()]
        out["ops"] = {name: ops.count(name) for name in ("Sparse24Gemm", "Sparse24Ffn")}
        core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        out["compiled"] = True
print(json.dumps(out))
"""
# x86-64-v4's AVX-512 subsets: what the kernels' library, compiled with -march=x86-64-v4, may use anywhere
LOADER_FLAGS = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


def test_the_kernels_path_works_in_the_image_on_this_cpu(containers):
    """What the server does to put the 2:4 Linears on the kernels, step by step inside the image: the prebuilt
    library found through HOLOSERVE_KERNEL_CACHE (no compiler), the export rewritten (onnx, which the
    rewrite needs, is in the base install), the library added to an OpenVINO Core where the CPU has AVX-512,
    and the rewritten model read and compiled where the CPU runs the kernels. The same on every CPU up to
    where the CPU stops it, so a missing module fails here even on a CPU that never runs the kernels."""
    from holoserve.core.machine import cpu_flags
    from holoserve.kernels import cpu_missing

    c = containers["sst2"]
    r = c.docker("exec", c.name, "python", "-c", KERNELS_PATH, ",".join(LOADER_FLAGS), timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["library"].startswith("/opt/holoserve/kernels/") and got["links"], got
    counts = got["counts"]
    assert counts.get("Sparse24Gemm", 0) > 0 and counts.get("Sparse24Ffn", 0) > 0, counts
    assert got.get("loaded", False) == (set(LOADER_FLAGS) <= cpu_flags()), got
    if not cpu_missing():
        assert got.get("compiled") and got["ops"]["Sparse24Gemm"] > 0 and got["ops"]["Sparse24Ffn"] > 0, got
    else:
        assert "compiled" not in got, got


def test_kernels_forced_on_serve_where_the_cpu_runs_them_and_refuse_to_start_elsewhere(containers,
                                                                                          sst2_checkpoint):
    """`--backend openvino --openvino-kernels on`: on a CPU with AVX-512 VNNI and VBMI (AMX or not) the server
    runs the 2:4 Linears on the prebuilt kernels and predicts as ONNX Runtime does; on any other CPU it
    refuses to start, naming the flags this CPU lacks and how to serve without them."""
    from holoserve.kernels import cpu_missing

    c, missing = containers["kernels_on"], cpu_missing()
    if missing:
        state = c.wait_exit()
        logs = c.logs()
        assert state["ExitCode"] != 0 and not state["OOMKilled"], (state, logs[-3000:])
        error = next((line for line in logs.splitlines() if line.startswith("error: ")), None)
        assert error is not None and "Traceback" not in logs, logs[-3000:]
        assert all(flag in error for flag in missing) and "--openvino-kernels off" in error, error
        return
    serves_on_the_kernels_as_onnxruntime_does(c, sst2_checkpoint, "on (HoloServe's 2:4 INT8 kernels, f32 in and out)")


def test_the_kernels_reference_build_serves_on_any_cpu(containers, sst2_checkpoint):
    """`--openvino-kernels reference`: the image's prebuilt portable build of the kernels serves on every CPU,
    so the kernels' ops, the rewrite and their numbers are checked in the image wherever CI runs."""
    c = containers["kernels_reference"]
    serves_on_the_kernels_as_onnxruntime_does(
        c, sst2_checkpoint, "reference (HoloServe's 2:4 INT8 kernels from their portable reference build, f32")


def serves_on_the_kernels_as_onnxruntime_does(c, checkpoint, status: str) -> None:
    """Container `c` serves OpenVINO with its 2:4 Linears on the prebuilt kernels (`status` says which build),
    built nowhere at start-up, and predicts as ONNX Runtime does on `checkpoint`."""
    from holoserve.backends import load_backend
    from holoserve.core.artifact import load_artifact
    from tests.helpers.serving import running

    c.wait_ready()
    backend = httpx.get(c.url + "/v1/models").json()["models"][0]["backend"]
    assert backend["backend"] == "openvino", backend
    kernels = backend["kernels"]
    assert kernels["status"].startswith(status), kernels
    assert kernels["Sparse24Ffn"] == 2 and kernels["Sparse24Gemm"] > 0, kernels
    assert "building the 2:4 kernels" not in c.logs()
    texts = ["loved it", "a dull mess", "the movie was good", "i hated it", "not bad at all, really"]
    r = httpx.post(c.url + "/predict", json={"texts": texts}, timeout=30)
    assert r.status_code == 200, r.text
    ours = r.json()["predictions"]
    ort = load_backend("onnxruntime", load_artifact(checkpoint), threads=1)
    with running(checkpoint, backend=ort) as srv:
        theirs = httpx.post(srv.url + "/predict", json={"texts": texts}, timeout=30).json()["predictions"]
    # The tiny model's scores sit close to 0.5 and move little even when a Linear's weights are scrambled,
    # so the bound is tight: the kernels compute the Linears' integer products exactly, as ONNX Runtime
    # does, and quantize and apply GELU as ONNX does, so only float rounding is left between them.
    for text, a, b in zip(texts, ours, theirs, strict=True):
        assert a["label"] == b["label"] and a["scores"] == pytest.approx(b["scores"], abs=2e-5), (text, a, b)


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


def test_threads_follow_the_containers_cpu_quota(containers):
    """`docker run --cpus 1` with no thread settings: ONNX Runtime gets one thread (its own default is one per
    physical core of the machine, whatever the quota), and /v1/models says it came from the quota; without a
    quota the runtime's default stands."""
    backend = httpx.get(containers["mrpc"].url + "/v1/models").json()["models"][0]["backend"]
    assert backend["intra_op_threads"] == 1, backend
    assert backend["threads_why"].startswith("1 thread: a CPU quota of 1 CPU (cgroup)"), backend
    backend = httpx.get(containers["sst2"].url + "/v1/models").json()["models"][0]["backend"]
    assert backend["threads_why"].startswith("the runtime's default"), backend


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


# Run inside the image on the checkpoint at /model: whether AMX is the server's to use, and what OpenVINO and
# the 2:4 kernels then run, as JSON.
AMX_PROBE = """
import json
from holoserve.backends import load_backend
from holoserve.backends.openvino import amx_permitted, amx_withheld, cpu_has_amx
from holoserve.core.artifact import load_artifact
info = load_backend("openvino", load_artifact("/model"), threads=1).info()
print(json.dumps({"permitted": amx_permitted(), "withheld": amx_withheld(), "amx": cpu_has_amx(),
                  "kernels": info["kernels"]["status"], "gemms": info["gemm_kernels"]}))
"""


def test_a_container_refused_amx_is_served_as_a_cpu_without_it(docker: Docker, image, sst2_checkpoint, tmp_path):
    """bench.serve_load's --deny-amx (a seccomp rule refusing the AMX request oneDNN and ONNX Runtime make):
    in such a container OpenVINO runs no AMX kernel and the image's `auto` puts the 2:4 Linears on the kernels
    wherever the CPU has AVX-512 VNNI + VBMI; in a plain container of the same image on a CPU with AMX, the
    server sees AMX and OpenVINO's GEMMs use it. On a CPU without AMX both containers see none."""
    from bench.serve_load.modes import docker_options
    from holoserve.core.machine import cpu_flags
    from holoserve.kernels import cpu_missing

    has_amx = "amx_int8" in cpu_flags()

    def probe(*options: str) -> dict:
        r = docker("run", "--rm", *options, "-v", f"{sst2_checkpoint}:/model:ro", "--entrypoint", "python", IMAGE,
                   "-c", AMX_PROBE, timeout=300, check=False)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return json.loads(r.stdout.splitlines()[-1])

    plain = probe()
    assert plain["permitted"] is has_amx and plain["amx"] is has_amx and plain["withheld"] is None, plain
    assert any("amx" in k for k in plain["gemms"]) is has_amx, plain["gemms"]
    assert plain["kernels"].startswith(expected_kernels()), plain

    denied = probe(*docker_options(None, True, tmp_path))
    assert denied["permitted"] is False and denied["amx"] is False, denied
    assert not any("amx" in k for k in denied["gemms"]), denied["gemms"]
    if has_amx:
        assert "the OS refuses AMX" in denied["withheld"], denied
    expected = "off: this CPU lacks" if cpu_missing() else "on (HoloServe's 2:4 INT8 kernels"
    assert denied["kernels"].startswith(expected), denied
