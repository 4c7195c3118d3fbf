"""Run the tritonserver that the `nvidia-pytriton` wheel ships (Triton 2.51, with the Python backend and
no onnxruntime or TensorRT backend) on a model repository written by export/triton.py, for running
the Python model on one machine. Its Python backend is built with a pybind11 that predates NumPy 2,
so the Python that runs model.py must import numpy<2 (see `stub_environment`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from holoserve.core.files import atomic_write_text

from .triton import TritonRepoError


@dataclass(frozen=True)
class Listen:
    """Where tritonserver listens: HTTP always; gRPC and metrics only when given a port."""

    http_port: int
    host: str = "127.0.0.1"
    grpc_port: int | None = None
    metrics_port: int | None = None


@dataclass
class LocalTriton:
    """What it takes to run the tritonserver of the nvidia-pytriton wheel on a model repository."""

    argv: list[str]
    env: dict[str, str]
    backends: Path  # the --backend-directory assembled for this Python


def pytriton_dist() -> Path:
    """The folder of pytriton's bundled Triton (bin/tritonserver, backends/python, python_backend_stubs)."""
    spec = importlib.util.find_spec("pytriton")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        raise TritonRepoError("no tritonserver here: install the wheel that bundles one, "
                              "`pip install nvidia-pytriton` (Linux x86-64/aarch64, glibc 2.35 or newer)")
    dist = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (dist / "bin" / "tritonserver").is_file():
        raise TritonRepoError(f"{dist} holds no bin/tritonserver; reinstall nvidia-pytriton")
    return dist


# What model.py needs from the Python backend's environment, and where that Python's libpython is (the
# stub links it) and its site-packages.
_PROBE = """import json, site, sys, sysconfig, numpy, holoserve, onnxruntime, tokenizers
print(json.dumps({"version": "%d.%d" % sys.version_info[:2], "numpy": numpy.__version__,
                  "site": site.getsitepackages(), "prefix": sys.prefix,
                  "libdir": sysconfig.get_config_var("LIBDIR"), "ldlibrary": sysconfig.get_config_var("LDLIBRARY")}))"""


def probe_python(python: str | os.PathLike) -> dict[str, Any]:
    """Run `python` and report what the Python backend would see: its version, numpy, site-packages and
    libpython; TritonRepoError if holoserve, onnxruntime, tokenizers or numpy cannot be imported."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        res = subprocess.run([str(python), "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise TritonRepoError(f"cannot run {python} to check the Python backend's environment: {e}") from None
    if res.returncode != 0:
        raise TritonRepoError(f"the Python backend's environment ({python}) cannot import what model.py needs "
                              f"(holoserve, onnxruntime, tokenizers, numpy): {res.stderr.strip()[-400:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def stub_environment(python: str | os.PathLike, folder: str | os.PathLike,
                     first: list[str | os.PathLike] | None = None) -> tuple[Path, dict[str, Any]]:
    """A Python environment for the Python backend stub: a venv (no packages of its own) whose site-packages
    pulls in those of `python`'s environment, with the folders `first` ahead of everything on sys.path.

    The stub embeds Python, finds its environment through `python3` on PATH and ignores PYTHONPATH, so
    this is how a folder holding numpy<2 gets ahead of an environment's NumPy 2: the Python backend of
    Triton 2.51 (nvidia-pytriton 0.7) is built with a pybind11 that predates NumPy 2 and reads NumPy 2
    arrays wrong (inputs come back empty or garbled). Returns (the venv's bin/python3, its probe).
    """
    import subprocess

    base = probe_python(python)
    folder = Path(folder)
    try:
        subprocess.run([str(python), "-m", "venv", "--without-pip", "--clear", str(folder)], check=True,
                       capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.CalledProcessError, subprocess.SubprocessError) as e:
        raise TritonRepoError(f"cannot create the Python backend's environment in {folder}: "
                              f"{getattr(e, 'stderr', '') or e}") from None
    site_dir = folder / "lib" / f"python{base['version']}" / "site-packages"
    lines = []
    if first:
        dirs = [str(Path(f).resolve()) for f in first]
        lines.append(f"import sys; sys.path[:0] = [d for d in {dirs!r} if d not in sys.path]")
    lines += [f"import site; site.addsitedir({d!r})" for d in base["site"]]
    atomic_write_text(site_dir / "00-holoserve-triton.pth", "\n".join(lines) + "\n")
    stub_python = folder / "bin" / "python3"
    info = probe_python(stub_python)
    if int(info["numpy"].split(".")[0]) >= 2:
        raise TritonRepoError(
            f"the Python backend would import numpy {info['numpy']}, but the stub of this tritonserver (Triton "
            "2.51) is built with a pybind11 that predates NumPy 2 and reads its arrays wrong; put numpy<2 ahead "
            "of it: `pip install --target DIR \"numpy<2\"` and pythonpath=[DIR]")
    return stub_python, info


def local_tritonserver(
    repo: str | os.PathLike,
    workdir: str | os.PathLike,
    listen: Listen,
    *,
    models: list[str] | None = None,
    python: str | os.PathLike | None = None,
    pythonpath: list[str | os.PathLike] | None = None,
    exit_timeout_s: int = 30,
) -> LocalTriton:
    """The command and environment that run pytriton's tritonserver on `repo`, its Python backend running
    model.py with the packages of `python`'s environment (default: the running interpreter's), which must
    have holoserve.

    `workdir` receives the backend folder (the Python backend with the stub built for that Python version)
    and the stub's environment (stub_environment). `pythonpath`: folders ahead of everything on the Python
    backend's sys.path; where the environment has NumPy 2, one holding numpy<2 (`pip install --target DIR
    "numpy<2"`). `listen`: the address and ports (gRPC and metrics stay off unless given a port);
    `models` loads only those (explicit model control).
    """
    host, http_port, grpc_port, metrics_port = listen.host, listen.http_port, listen.grpc_port, listen.metrics_port
    dist = pytriton_dist()
    workdir = Path(workdir)
    stub_python, info = stub_environment(python or sys.executable, workdir / "python-env", pythonpath)
    stubs = dist / "python_backend_stubs"
    stub = stubs / info["version"] / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in stubs.iterdir()) if stubs.is_dir() else []
        raise TritonRepoError(f"nvidia-pytriton has no Python backend stub for Python {info['version']} "
                              f"(it ships {', '.join(have) or 'none'}); use an environment with one of those")
    backends = workdir / "backends"
    py = backends / "python"
    py.mkdir(parents=True, exist_ok=True)
    for src in (dist / "backends" / "python").iterdir():
        if src.is_file():
            shutil.copy2(src, py / src.name)
    shutil.copy2(stub, py / "triton_python_backend_stub")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join([str(stub_python.parent), env.get("PATH", "")])
    # The environment's own libpython first (the stub would otherwise load the system's), then the
    # libraries the wheel ships for tritonserver.
    lib = Path(info["libdir"] or "") / (info["ldlibrary"] or "")
    libpython = info["libdir"] if ".so" in (info["ldlibrary"] or "") and lib.exists() else None
    if libpython is None:
        import ctypes.util

        if ctypes.util.find_library(f"python{info['version']}") is None:
            raise TritonRepoError(
                f"the Python backend stub links libpython{info['version']}.so.1.0, which {python or sys.executable} "
                "does not ship (a statically linked build) and the system lacks: use an interpreter built with "
                f"--enable-shared, or install the system's libpython{info['version']}")
    libs = dist.parent.parent / "nvidia_pytriton.libs"
    paths = [p for p in (libpython, str(libs) if libs.is_dir() else None) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*paths, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    argv = [str(dist / "bin" / "tritonserver"), "--model-repository", str(Path(repo).resolve()),
            "--backend-directory", str(backends.resolve()), "--http-address", host, "--http-port", str(http_port),
            "--disable-auto-complete-config", "--strict-readiness", "true", "--exit-on-error", "true",
            "--exit-timeout-secs", str(exit_timeout_s)]
    argv += ["--allow-grpc", "true", "--grpc-address", host, "--grpc-port", str(grpc_port)] if grpc_port \
        else ["--allow-grpc", "false"]
    argv += ["--allow-metrics", "true", "--metrics-address", host, "--metrics-port", str(metrics_port)] \
        if metrics_port else ["--allow-metrics", "false"]
    if models:
        argv += ["--model-control-mode", "explicit", *(f"--load-model={m}" for m in models)]
    return LocalTriton(argv, env, backends)
