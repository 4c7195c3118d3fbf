"""Helpers for the server tests: a tiny exported checkpoint and a real uvicorn server on loopback."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def export_onnx(model, out: Path, opset: int = 17) -> Path:
    """Plain torch.onnx.export with the contract's inputs/outputs and dynamic axes."""
    import torch

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits

    # Eager attention and a padded example: the traced graph must keep the attention-mask path.
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:
        model.config._attn_implementation = "eager"
    ids = torch.ones(2, 8, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    axes = {0: "batch", 1: "sequence"}
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Wrap(model.eval()).eval(), (ids, mask, torch.zeros_like(ids)), str(out),
            input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["logits"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes, "logits": {0: "batch"}},
            opset_version=opset, dynamo=False,
        )
    return out


def make_tiny_checkpoint(root: Path, task_name: str = "sst2", max_seq_length: int = 32, onnx: bool = True) -> Path:
    """A tiny random BERT, projected to 2:4 + INT8 grid and calibrated, saved as a checkpoint and exported to ONNX."""
    import torch
    from holoserve.compress.checkpoint import CheckpointContents, save_checkpoint
    from holoserve.compress.layers import encoder_linear_names
    from holoserve.compress.sparsify import project_layers
    from holoserve.core.artifact import add_files
    from holoserve.data.tasks import get_task
    from tests.helpers.tiny import make_tiny_bert
    from transformers import AutoModelForSequenceClassification

    task = get_task(task_name)
    src = make_tiny_bert(root / f"src-{task_name}", num_labels=task.num_labels)
    model = AutoModelForSequenceClassification.from_pretrained(str(src), local_files_only=True)
    names = encoder_linear_names(model)
    scales = project_layers(model, names)
    from holoserve.compress.quant import calibrate_amax
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.enable_padding()
    encs = tok.encode_batch(["the movie was good", "a dog is playing with the cat", "i hated it"])
    batch = {"input_ids": torch.tensor([e.ids for e in encs]),
             "attention_mask": torch.tensor([e.attention_mask for e in encs]),
             "token_type_ids": torch.tensor([e.type_ids for e in encs])}
    amax = calibrate_amax(model, names, [batch])
    out = root / f"ckpt-{task_name}"
    art = save_checkpoint(model, src, out, CheckpointContents(task=task, base_model="tiny-random-bert",
        max_seq_length=max_seq_length, sparse_layers=names, weight_scales=scales, act_amax=amax,
        metrics={"primary": task.primary_metric, "dense": {}, "compressed": {}}))
    if onnx:
        try:  # the product's exporter (QDQ, int8 weights) when the export package is installed
            from holoserve.export.onnx_export import export_checkpoint
        except ImportError:
            export_checkpoint = None
        if export_checkpoint is not None:
            export_checkpoint(out, ("onnxruntime",), polygraphy=False, progress=False, check_predictions=False)
        else:  # plain fp32 torch.onnx.export with the contract's inputs and outputs
            tmp = out / "model.onnx.partial"
            export_onnx(model, tmp)
            add_files(art, {"model.onnx": tmp}, exports={"onnxruntime": {"file": "model.onnx", "opset": 17}})
            tmp.unlink(missing_ok=True)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 60.0, path: str = "/readyz", proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: "
                               f"{proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} not ready after {timeout}s")


def server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOLOSERVE_")}
    env.update({"OMP_NUM_THREADS": "1", "HOLOSERVE_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@contextlib.contextmanager
def serve_subprocess(args: list[str], env: dict[str, str] | None = None, timeout: float = 60.0, cmd=None):
    """`holoserve serve ...` in a child process on a free loopback port; yields (url, proc)."""
    port = free_port()
    env = server_env(**(env or {}))
    env.setdefault("HOLOSERVE_PORT", str(port))
    port = int(env["HOLOSERVE_PORT"])
    cmd = cmd or [sys.executable, "-m", "holoserve", "serve"]
    proc = subprocess.Popen([*cmd, *args], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout, proc=proc)
        yield url, proc
    finally:
        stop(proc)


_CACHE: dict[tuple[str, bool], Path] = {}
_ROOT: list[Path] = []


def tiny_checkpoint(task_name: str = "sst2", onnx: bool = True) -> Path:
    """Build (once per test process) a tiny exported checkpoint; removed when the process exits."""
    import atexit
    import shutil
    import tempfile

    key = (task_name, onnx)
    if key not in _CACHE:
        if not _ROOT:
            _ROOT.append(Path(tempfile.mkdtemp(prefix="holoserve-serve-tests-")))
            atexit.register(shutil.rmtree, _ROOT[0], True)
        root = _ROOT[0] / f"{task_name}-{'onnx' if onnx else 'plain'}"
        root.mkdir()
        _CACHE[key] = make_tiny_checkpoint(root, task_name, onnx=onnx)
    return _CACHE[key]


class ThreadServer:
    """uvicorn serving an app object on a loopback port from a background thread.

    An app made by create_app is served with the connection limits of its ServerConfig, as
    `holoserve serve` serves it."""

    def __init__(self, app, port: int | None = None, graceful_timeout_s: float = 10):
        import threading

        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        service = getattr(getattr(app, "state", None), "service", None)
        opts = {}
        if service is not None:
            from holoserve.server.connections import server_options

            opts = server_options(service.config)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                                    access_log=False, timeout_graceful_shutdown=graceful_timeout_s,
                                                    **opts))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_ready(self.url, 60)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


class RawHTTP:
    """One HTTP/1.1 connection on a raw socket: send any bytes, read one response at a time, and see
    whether (and when) the server closed the connection. For what an HTTP client library would not send."""

    def __init__(self, url: str, timeout: float = 10.0):
        host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> None:
        head = [f"{method} {path} HTTP/1.1", "Host: test"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        self.send(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        """The next response: (status, headers with lower-case names, body); ConnectionError if the
        server closed first."""
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                raise ConnectionError("the server closed the connection without a (whole) response")
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", 0))
        while len(self.buf) < n:
            if not self._fill():
                raise ConnectionError("the server closed the connection in the middle of a response")
        body, self.buf = self.buf[:n], self.buf[n:]
        return status, headers, body

    def closed_within(self, seconds: float) -> bool:
        """True when the server closes the connection within `seconds` (whatever it sends first stays in
        the buffer for response())."""
        deadline = time.monotonic() + seconds
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.sock.settimeout(left)
                if not self._fill():
                    return True
        except socket.timeout:
            return False
        except (ConnectionResetError, BrokenPipeError):
            return True
        finally:
            self.sock.settimeout(10.0)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def stop(proc: "subprocess.Popen", timeout: float = 30) -> None:
    """Terminate a child process, killing it if it does not exit within `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running(ckpt, backend=None, graceful_timeout_s: float = 10, **overrides):
    """A real server (uvicorn on loopback) for a checkpoint, with ServerConfig overrides; `backend` replaces
    the one the server would load. The app is at `srv.app`."""
    from holoserve.core.artifact import load_artifact
    from holoserve.server.app import create_app
    from holoserve.server.config import ServerConfig

    cfg = ServerConfig(artifact_dir=str(ckpt), threads=1, **overrides)
    if backend is None:
        app = create_app(cfg)
    else:
        app = create_app(cfg, artifact=load_artifact(ckpt), backend=backend,
                         decision={"picked": "test", "reason": "test"})
    with ThreadServer(app, graceful_timeout_s=graceful_timeout_s) as srv:
        srv.app = app
        yield srv


def metric(text: str, name: str, **labels) -> float:
    """The sum of a Prometheus metric's samples in an exposition `text`, over those with these labels."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def wait_metric(url: str, name: str, until, timeout: float = 10.0, **labels) -> float:
    """Poll `url`/metrics until `until(value)` holds for the metric's sum over samples with `labels`."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        value = metric(httpx.get(url + "/metrics", timeout=10).text, name, **labels)
        if until(value):
            return value
        assert time.monotonic() < deadline, f"{name} is {value} after {timeout} s"
        time.sleep(0.02)
