"""`--workers N`: one /metrics for the whole server (prometheus-client multiprocess mode)."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from holoserve.backends.onnxruntime import OrtBackend
from holoserve.core.artifact import load_artifact
from holoserve.server.app import create_app
from holoserve.server.config import ServerConfig
from holoserve.server.metrics import MULTIPROC_ENV, prepare_multiprocess_dir
from tests.helpers.serving import metric, serve_subprocess, tiny_checkpoint


class GatedBackend(OrtBackend):
    """The real ONNX Runtime backend whose first inference (the warm-up's) waits for `gate`."""

    def __init__(self, art, gate: threading.Event):
        super().__init__(art, threads=1)
        self.gate = gate

    def infer(self, ids, mask, types):
        if not self.gate.wait(30):
            raise TimeoutError("the test never opened the gate")
        return super().infer(ids, mask, types)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_worker_takes_connections_only_once_warm(workers):
    """One process serves /healthz (and 503 not_ready) while it warms up. One of several workers
    must not: it would take its share of the connections and refuse them while its siblings serve."""
    art = load_artifact(tiny_checkpoint("sst2"))
    gate = threading.Event()
    app = create_app(ServerConfig(artifact_dir=str(art.path), threads=1, workers=workers), artifact=art,
                     backend=GatedBackend(art, gate), decision={"picked": "test", "reason": "test"})
    service = app.state.service

    async def go():
        async with app.router.lifespan_context(app):
            status = service.status
            gate.set()
            return status

    if workers > 1:
        threading.Timer(0.5, gate.set).start()  # else the startup would wait for ever
    status = asyncio.run(go())
    # One worker: the startup returned at once and the warm-up goes on in the background. Several:
    # the startup (after which uvicorn accepts connections) waited for the warm-up.
    assert status == ("loading" if workers == 1 else "ready")


def test_prepare_multiprocess_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    assert prepare_multiprocess_dir(1) == (None, False)  # one worker, nothing set: plain in-process metrics
    path, made = prepare_multiprocess_dir(2)
    try:
        assert made and os.path.isdir(path) and os.environ[MULTIPROC_ENV] == path and not os.listdir(path)
    finally:
        os.rmdir(path)
    given = tmp_path / "metrics"
    given.mkdir()
    (given / "counter_4242.db").write_bytes(b"stale values of an earlier run")
    (given / "notes.txt").write_text("not ours")
    monkeypatch.setenv(MULTIPROC_ENV, str(given))
    assert prepare_multiprocess_dir(2) == (str(given), False)
    assert sorted(os.listdir(given)) == ["notes.txt"]  # the stale values are gone, nothing else is touched


def test_two_workers_one_set_of_metrics(monkeypatch):
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    ckpt = tiny_checkpoint("sst2")
    with serve_subprocess([str(ckpt), "--workers", "2", "--no-access-log"], timeout=120) as (url, proc):
        n = 40

        def one(i: int) -> tuple[int, str]:  # a new connection each: the kernel spreads them over the workers
            r = httpx.post(url + "/predict", json={"texts": ["loved it", f"a dull mess {i}"]}, timeout=30)
            return r.status_code, r.headers["x-request-id"][:12]  # request ids start with a per-process prefix

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(n)))
        assert [code for code, _ in answers] == [200] * n  # no worker took a request before it was warm
        workers = {prefix for _, prefix in answers}
        deadline = time.monotonic() + 60  # the second worker may still be warming up (taking no connections)
        while metric(httpx.get(url + "/metrics", timeout=10).text, "holoserve_model_ready") != 1:
            assert time.monotonic() < deadline, "the second worker never became ready"
            time.sleep(0.1)
        for _ in range(12):  # each scrape may land on either worker: all must report the whole server
            text = httpx.get(url + "/metrics", timeout=10).text
            assert metric(text, "holoserve_inference_request_success_total") == n
            assert metric(text, "holoserve_inference_count_total") == 2 * n
            assert metric(text, "holoserve_inference_request_duration_seconds_count") == n
            assert metric(text, "holoserve_model_ready") == 1  # every worker ready, not a sum of 2
            assert metric(text, "holoserve_http_requests_in_flight") == 1  # just this scrape
            http = [line for line in text.splitlines() if line.startswith("holoserve_http_request_duration_seconds_count")
                    and 'route="/predict"' in line]
            assert sum(float(line.rsplit(" ", 1)[1]) for line in http) == n
            workers.add(httpx.get(url + "/healthz", timeout=10).headers["x-request-id"][:12])
        assert len(workers) == 2, workers  # both workers answered (else the test proves nothing)
    assert proc.returncode is not None
