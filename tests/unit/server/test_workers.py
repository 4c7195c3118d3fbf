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
from tests.helpers.serving import RawHTTP, metric, serve_subprocess, tiny_checkpoint


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
    # empty reads as unset; unlike delenv of an unset variable, setenv restores the environment afterwards,
    # so the folder exported below does not leak into later tests' servers
    monkeypatch.setenv(MULTIPROC_ENV, "")
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
            http = [line for line in text.splitlines()
                    if line.startswith("holoserve_http_request_duration_seconds_count")
                    and 'route="/predict"' in line]
            assert sum(float(line.rsplit(" ", 1)[1]) for line in http) == n
            workers.add(httpx.get(url + "/healthz", timeout=10).headers["x-request-id"][:12])
        assert len(workers) == 2, workers  # both workers answered (else the test proves nothing)
    assert proc.returncode is not None


def test_reap_dead_workers(tmp_path, monkeypatch):
    """Live-gauge files of a process that exited, is a zombie, or is not a worker of this server (a
    reused pid) are removed; a live worker's files, and every counter, stay."""
    import signal
    import subprocess
    import sys

    from holoserve.server.metrics import reap_dead_workers

    def child():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    live, zombie, gone = child(), child(), child()
    gone.kill()
    gone.wait()
    zombie.kill()  # killed, not yet waited for: a zombie until its parent reaps it
    deadline = time.monotonic() + 10
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # This test's children play the workers: siblings share the parent, which here is this process.
    monkeypatch.setattr(os, "getppid", os.getpid)
    try:
        names = []
        for pid in (os.getpid(), live.pid, zombie.pid, gone.pid, 1):
            for kind in ("gauge_livesum", "gauge_livemax", "counter", "histogram"):
                names.append(f"{kind}_{pid}.db")
                (tmp_path / names[-1]).write_bytes(b"")
        (tmp_path / "gauge_livesum_notapid.db").write_bytes(b"")
        assert reap_dead_workers(str(tmp_path)) == sorted([zombie.pid, gone.pid, 1])
        left = set(os.listdir(tmp_path))
        for pid in (zombie.pid, gone.pid, 1):
            assert f"gauge_livesum_{pid}.db" not in left and f"gauge_livemax_{pid}.db" not in left
            assert f"counter_{pid}.db" in left and f"histogram_{pid}.db" in left  # what dead workers did stays
        for pid in (os.getpid(), live.pid):
            assert {f"gauge_livesum_{pid}.db", f"gauge_livemax_{pid}.db"} <= left
        assert "gauge_livesum_notapid.db" in left
        assert reap_dead_workers(str(tmp_path)) == []
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
        zombie.wait()


def _worker_pids(metrics_dir) -> set[int]:
    """The live workers: the pids whose live-gauge files are in the metrics folder and that still run."""
    pids = set()
    for name in os.listdir(metrics_dir):
        if name.startswith("gauge_live"):
            pid = int(name.rsplit("_", 1)[1].removesuffix(".db"))
            try:
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            if state != "Z":
                pids.add(pid)
    return pids


def test_a_worker_killed_under_load(tmp_path, monkeypatch):
    """SIGKILL one of two workers while clients send requests: only requests in flight at the kill
    may fail, uvicorn starts a replacement, and /metrics agrees with /readyz within 5 s: ready, the
    requests in flight and the open connections of the live workers only (the dead one's last values
    stayed in the totals for ever before)."""
    import signal

    metrics_dir = tmp_path / "metrics"
    monkeypatch.setenv(MULTIPROC_ENV, str(metrics_dir))  # the server uses it (and the test can read it)
    ckpt = tiny_checkpoint("sst2")
    env = {MULTIPROC_ENV: str(metrics_dir)}
    with serve_subprocess([str(ckpt), "--workers", "2", "--no-access-log"], env=env, timeout=120) as (url, proc):
        deadline = time.monotonic() + 60
        while metric(httpx.get(url + "/metrics", timeout=10).text, "holoserve_workers_ready") != 2:
            assert time.monotonic() < deadline, "the workers never became ready"
            time.sleep(0.1)
        workers = _worker_pids(metrics_dir)
        assert len(workers) == 2, workers
        log: list[tuple[float, float, bool]] = []  # (start, end, answered 200) of every neighbour request
        stop = threading.Event()

        def neighbour(i: int) -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                try:  # a new connection each time: a kept one to the killed worker would fail when next used
                    ok = httpx.post(url + "/predict", json={"texts": ["loved it", f"a dull mess {i}"]},
                                    timeout=30).status_code == 200
                except httpx.HTTPError:
                    ok = False
                log.append((t0, time.monotonic(), ok))

        threads = [threading.Thread(target=neighbour, args=(i,)) for i in range(4)]
        idle: list[RawHTTP] = []
        for t in threads:
            t.start()
        try:
            while len(log) < 40:  # both workers busy
                time.sleep(0.05)
            # Idle keep-alive connections on both workers (told apart by their request-id prefix), so the
            # victim certainly dies with open connections in its gauges.
            prefixes: set[str] = set()
            while len(prefixes) < 2 or len(idle) < 4:
                assert len(idle) < 40, "the kernel gave every connection to one worker"
                conn = RawHTTP(url)
                conn.request("GET", "/healthz")
                prefixes.add(conn.response()[1]["x-request-id"][:12])
                idle.append(conn)
            victim = sorted(workers)[0]
            t_kill = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            time.sleep(2.0)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        for conn in idle:
            conn.close()
        in_flight_at_kill = [x for x in log if x[0] <= t_kill <= x[1]]
        failed = [x for x in log if not x[2]]
        assert all(start <= t_kill for start, _, _ in failed), "a request sent after the kill failed"
        assert len(failed) <= len(in_flight_at_kill), (len(failed), len(in_flight_at_kill))
        assert sum(ok for start, _, ok in log if start > t_kill) > 0  # the survivor served meanwhile

        # Within 5 s /metrics agrees with /readyz and with the requests and connections really open.
        deadline = time.monotonic() + 5
        while True:
            ready = httpx.get(url + "/readyz", timeout=10).status_code
            text = httpx.get(url + "/metrics", timeout=10).text
            seen = (ready, metric(text, "holoserve_model_ready"), metric(text, "holoserve_http_requests_in_flight"),
                    metric(text, "holoserve_http_connections"))
            if seen == (200, 1, 1, 1):
                break
            assert time.monotonic() < deadline, f"(readyz, model_ready, in flight, connections) = {seen}"
            time.sleep(0.1)
        assert f"_{victim}.db" not in " ".join(n for n in os.listdir(metrics_dir) if n.startswith("gauge_live"))
        # Counters keep what the dead worker did: every 200 the clients saw is counted.
        assert metric(text, "holoserve_inference_request_success_total") >= sum(ok for *_, ok in log)
        # uvicorn replaces the dead worker; once it is warm both count again.
        deadline = time.monotonic() + 60
        while metric(httpx.get(url + "/metrics", timeout=10).text, "holoserve_workers_ready") != 2:
            assert time.monotonic() < deadline, "the replacement worker never became ready"
            time.sleep(0.1)
        now = _worker_pids(metrics_dir)
        assert len(now) == 2 and victim not in now, now
