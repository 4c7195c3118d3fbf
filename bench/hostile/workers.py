"""Phase 9 of the hostile benchmark: `--workers 2` with a token, a worker SIGKILLed under load."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

from bench.hostile.attacks import RssSampler, neighbours
from bench.hostile.cases import js, v2_inputs
from bench.lib.http import Conn, metric_sum, metrics, model_name, post, readyz
from bench.lib.server import ServerProcess


def live_workers(metrics_dir: Path) -> list[int]:
    """The running workers: pids with live-gauge files in the metrics folder that are not zombies."""
    pids = set()
    for f in metrics_dir.glob("gauge_live*_*.db"):
        pid = int(f.stem.rsplit("_", 1)[1])
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            pids.add(pid)
    return sorted(pids)


GAUGES = ("holoserve_model_ready", "holoserve_workers_ready", "holoserve_http_requests_in_flight",
          "holoserve_http_connections")


def scrape(url: str, token: str) -> dict[str, float]:
    """The readiness and connection gauges, each summed over its label sets (absent where the server has none)."""
    samples = metrics(url, token)
    return {k: v for k in GAUGES if (v := metric_sum(samples, k)) is not None}


def ready_workers(scraped: dict[str, float]) -> float:
    """Warm workers, from holoserve_workers_ready (or, from a server without it, model_ready as the least
    over workers: 1 when both are)."""
    if "holoserve_workers_ready" in scraped:
        return scraped["holoserve_workers_ready"]
    return 2.0 if scraped.get("holoserve_model_ready") == 1 else 0.0


async def run_worker_kill(root: Path, ckpt: Path, settings: dict, log: Path, nofile: int, pair: bool,
                          clients: int, tmp: Path) -> dict:
    """`--workers 2` with a token: neighbours on fresh connections, one worker SIGKILLed mid-load."""
    token = "bench-" + os.urandom(8).hex()
    metrics_dir = tmp / "metrics"
    srv = ServerProcess(root, ckpt, log, env={**settings, "HOLOSERVE_WORKERS": "2", "HOLOSERVE_API_TOKEN": token,
                                             "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}, nofile=nofile)
    out: dict = {}
    try:
        srv.wait_ready()
        deadline = time.monotonic() + 120
        while ready_workers(scrape(srv.url, token)) < 2 or len(live_workers(metrics_dir)) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("the two workers did not become ready")
            await asyncio.sleep(0.2)
        name = model_name(srv.url, token)
        infer = f"/v2/models/{name}/infer"
        good = js({"inputs": v2_inputs(["a fun film"], pair)})
        auth_cases = []
        for label, headers, ok in (
                ("right token", ["Bearer " + token], 200), ("wrong token", ["Bearer nope"], 401),
                ("wrong, then right", ["Bearer nope", "Bearer " + token], 400),
                ("right, then wrong", ["Bearer " + token, "Bearer nope"], 400),
                ("right twice", ["Bearer " + token] * 2, 400)):
            conn = Conn(srv.port)
            await conn.open()
            await conn.send(post(good, infer, extra="".join(f"Authorization: {h}\r\n" for h in headers)))
            status, _, body = await conn.response(10)
            conn.close()
            shape_ok = status == 200 or isinstance(json.loads(body).get("error"), str)
            auth_cases.append({"case": label, "status": status, "expected": ok,
                               "failure": None if status == ok and shape_ok else "unexpected outcome"})
        out["auth_cases"] = auth_cases
        workers = live_workers(metrics_dir)
        log_: list = []
        with RssSampler(lambda: live_workers(metrics_dir)) as rss:
            load = asyncio.ensure_future(neighbours(srv.port, pair, clients, 6.0, name, token, fresh=True, log=log_))
            await asyncio.sleep(2.0)
            victim = workers[0]
            t_kill = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            replaced_s = None
            while not load.done():
                now = live_workers(metrics_dir)
                if replaced_s is None and len(now) == 2 and victim not in now:
                    replaced_s = round(time.monotonic() - t_kill, 2)
                await asyncio.sleep(0.05)
            near = await load
        in_flight = sum(1 for s, e, _ in log_ if s <= t_kill <= e)
        failed_after = sum(1 for s, _, ok in log_ if not ok and s > t_kill)
        t_end = time.monotonic()
        consistent_s, seen = None, {}
        while time.monotonic() - t_end < 5.0:
            seen = {"readyz": readyz(srv.url), **scrape(srv.url, token)}
            if (seen["readyz"] == 200 and seen.get("holoserve_model_ready") == 1
                    and seen.get("holoserve_http_requests_in_flight") == 1
                    and seen.get("holoserve_http_connections") == 1):
                consistent_s = round(time.monotonic() - t_end, 2)
                break
            await asyncio.sleep(0.1)
        while replaced_s is None and time.monotonic() - t_kill < 60:
            now = live_workers(metrics_dir)
            if len(now) == 2 and victim not in now:
                replaced_s = round(time.monotonic() - t_kill, 2)
            await asyncio.sleep(0.05)
        out.update({"clients": clients, "neighbours": near, "in_flight_at_kill": in_flight,
                    "failed_after_kill_sent": failed_after, "replaced_after_s": replaced_s,
                    "metrics_consistent_after_s": consistent_s, "last_scrape": seen,
                    "workers_peak_rss_mb": round(rss.peak, 1)})
    finally:
        srv.stop()
    return out
