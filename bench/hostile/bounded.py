"""Phase 10 of the hostile benchmark: work and memory bounded before anything is done for a request.

Each case runs against a fresh server (a bearer token set, ONNX Runtime, one thread) beside closed-loop
neighbours sending good requests, and reports the server's idle, peak (during) and after resident memory,
the neighbours' longest wait, the statuses the attack got and the connection counters:

- pair_10kb: a text-pair model, 48 requests each holding one pair of two 10 KB texts (what a 1 MB body
  holds), from 4 clients;
- healthz_bodies: 1,000 connections without a token, each sending 999 KB of a 1,000,000-byte body to
  POST /healthz (a GET-only public route) and holding;
- long_texts: 8 clients at once, each request 64 texts of 10 KB; then 4 clients sending one 10 KB text each;
- pipelined: 120 small pipelined requests and the first 40 bytes of a 121st in one write;
- shutdown: SIGTERM while one request's body is still arriving (completed 0.3 s later) and the queue is
  full, and an idle connection accepted before the signal sends a request right after it; the exit status;
- non_reader: a client that pipelines requests with large answers, never reads, and stalls in a body:
  closed once, counted once.

Done means (issue: reliability): no neighbour waits more than 1 s because of a case, the peak under 400 MB
and the memory after within 50 MB of idle, the right statuses and counters.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

from bench.hostile.attacks import RssSampler, neighbours
from bench.hostile.cases import js, v2_inputs
from bench.lib.http import Conn, closed_connections, model_name, post
from bench.lib.server import ServerProcess, rss_mb

TOKEN = "hostile-bench-token"
AUTH = f"Authorization: Bearer {TOKEN}\r\n"


def _settings(base: dict[str, str], **extra: str) -> dict[str, str]:
    return {**base, "HOLOSERVE_API_TOKEN": TOKEN, "HOLOSERVE_MAX_ITEMS": "64", **extra}


async def _settle(pid: int, seconds: float = 3.0) -> float:
    """The server's resident memory once it has had `seconds` to give back what a case freed."""
    await asyncio.sleep(seconds)
    return round(rss_mb(pid), 1)


async def _case(srv: ServerProcess, pair: bool, attack, clients: int, seconds: float) -> dict:
    """Run `attack()` (a coroutine returning its own results) beside neighbours; memory and waits around it."""
    name = model_name(srv.url, TOKEN)
    idle = round(rss_mb(srv.proc.pid), 1)
    with RssSampler(lambda: [srv.proc.pid]) as rss:
        near_task = asyncio.ensure_future(neighbours(srv.port, pair, clients, seconds, name, TOKEN))
        got = await attack()
        near = await near_task
    after = await _settle(srv.proc.pid)
    return {**got, "neighbours": near, "rss_idle_mb": idle, "rss_peak_mb": round(rss.peak, 1),
            "rss_after_mb": after, "closed": closed_connections(srv.url, TOKEN)}


async def _send_all(port: int, requests: list[bytes], clients: int, timeout: float = 120) -> dict[str, int]:
    """Send `requests` over `clients` keep-alive connections; the statuses they got."""
    statuses: dict[str, int] = {}
    queue = list(requests)

    async def client() -> None:
        conn = Conn(port)
        while queue:
            await conn.tally(queue.pop(), statuses, timeout)
        conn.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return statuses


def pair_10kb(port: int):
    body = post(js({"pairs": [["a " * 5000, "a " * 5000]]}), extra=AUTH)

    async def attack() -> dict:
        t0 = time.monotonic()
        statuses = await _send_all(port, [body] * 48, 4)
        return {"requests": 48, "statuses": statuses, "seconds": round(time.monotonic() - t0, 2)}
    return attack


def healthz_bodies(port: int, n: int = 1000):
    head = ("POST /healthz HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000000\r\n\r\n").encode()
    chunk = b"x" * 999_000

    async def attack() -> dict:
        statuses: dict[str, int] = {}
        conns = []

        async def one() -> None:
            c = Conn(port)
            try:
                await c.open()
                c.writer.write(head + chunk)
                status, _, _ = await c.response(30)
                statuses[str(status)] = statuses.get(str(status), 0) + 1
            except (ConnectionError, OSError, asyncio.TimeoutError) as e:
                statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
            conns.append(c)

        t0 = time.monotonic()
        for i in range(0, n, 100):
            await asyncio.gather(*(one() for _ in range(min(100, n - i))))
        await asyncio.sleep(1.0)  # holding
        for c in conns:
            c.close()
        return {"connections": n, "statuses": statuses, "seconds": round(time.monotonic() - t0, 2)}
    return attack


def long_texts(port: int):
    many = post(js({"texts": [("word " * 2000)[:10_000]] * 64}), extra=AUTH)
    one = post(js({"text": ("word " * 2000)[:10_000]}), extra=AUTH)

    async def attack() -> dict:
        t0 = time.monotonic()
        heavy = await _send_all(port, [many] * 8, 8)
        t1 = time.monotonic()
        single = await _send_all(port, [one] * 40, 4)
        return {"64x10kb_statuses": heavy, "64x10kb_seconds": round(t1 - t0, 2), "10kb_statuses": single,
                "10kb_seconds": round(time.monotonic() - t1, 2)}
    return attack


def pipelined(port: int):
    # about 150 bytes each: the 120 pass the server's 16 KB head limit together, never alone
    req = b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Pad: " + b"p" * 100 + b"\r\n\r\n"
    last = req

    async def attack() -> dict:
        c = Conn(port)
        await c.open()
        statuses: dict[str, int] = {}
        try:
            await c.send(req * 120 + last[:40])
            for _ in range(120):
                status, _, _ = await c.response(10)
                statuses[str(status)] = statuses.get(str(status), 0) + 1
            await c.send(last[40:])
            status, _, _ = await c.response(10)
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        except (ConnectionError, OSError, asyncio.TimeoutError) as e:
            statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
        c.close()
        return {"requests": 121, "statuses": statuses}
    return attack


def non_reader(port: int, name: str):
    payload = json.dumps({"id": "r" * 400_000, "inputs": v2_inputs(["x"], False)}).encode()
    req = post(payload, f"/v2/models/{name}/infer", extra=AUTH)
    stall = post(b'{"text": ', extra=AUTH).replace(b"Content-Length: 9", b"Content-Length: 100")

    async def attack() -> dict:
        c = Conn(port)
        await c.open()
        c.writer.write(req * 3 + stall)  # never read
        t0 = time.monotonic()
        while not await c.closed(0.2) and time.monotonic() - t0 < 30:
            pass
        c.close()
        return {"closed_after_s": round(time.monotonic() - t0, 2)}
    return attack


async def shutdown_case(srv: ServerProcess, pair: bool) -> dict:
    """SIGTERM while a body is arriving and the queue is full; a request on a new connection right after."""
    text = {"pairs": [["a man rides a horse", "a man is riding a horse"]]} if pair else {"text": "a fun film"}
    body = js(text)
    arriving, late = Conn(srv.port), Conn(srv.port)
    await arriving.open()
    await late.open()  # accepted before the signal, idle until just after it
    await arriving.send(post(body, extra=AUTH)[:-5])
    queue = asyncio.ensure_future(_send_all(srv.port, [post(js({"texts": ["word " * 30] * 64}), extra=AUTH)] * 16, 16))
    await asyncio.sleep(0.3)
    srv.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.05)
    out: dict = {}
    try:
        await late.send(post(body, extra=AUTH))
        status, headers, _ = await late.response(30)
        out["idle_connection_after_signal"] = status
    except (ConnectionError, OSError, asyncio.TimeoutError) as e:
        out["idle_connection_after_signal"] = type(e).__name__
    await asyncio.sleep(0.25)
    try:
        await arriving.send(post(body, extra=AUTH)[-5:])
        status, headers, payload = await arriving.response(30)
        out["body_completed_after_signal"] = status
        if status != 200:
            out["body_completed_after_signal_error"] = json.loads(payload).get("error")
    except (ConnectionError, OSError, asyncio.TimeoutError) as e:
        out["body_completed_after_signal"] = type(e).__name__
    out["full_queue_statuses"] = await queue
    arriving.close()
    late.close()
    loop = asyncio.get_running_loop()
    out["exit_status"] = await loop.run_in_executor(None, srv.proc.wait, 60)
    return out


def run_bounded(root: Path, ckpt: Path, pair_ckpt: Path, settings: dict[str, str], log: Path, nofile: int,
                clients: int, seconds: float) -> dict:
    """Every case above, each on a fresh server; the pair case on `pair_ckpt` (a text-pair model)."""
    out: dict = {}
    cases = [("pair_10kb", pair_ckpt, True, pair_10kb), ("healthz_bodies", ckpt, False, healthz_bodies),
             ("long_texts", ckpt, False, long_texts), ("pipelined", ckpt, False, pipelined),
             ("non_reader", ckpt, False, None)]
    for name, model, pair, make in cases:
        srv = ServerProcess(root, model, log, env=_settings(settings), nofile=nofile)
        try:
            srv.wait_ready()
            attack = make(srv.port) if make is not None else non_reader(srv.port, model_name(srv.url, TOKEN))
            out[name] = asyncio.run(_case(srv, pair, attack, clients, seconds))
        except Exception as e:  # a failure to report, not a crash of the benchmark
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            srv.stop()
        print(f"bounded/{name}: {out[name]}", flush=True)
    srv = ServerProcess(root, ckpt, log, nofile=nofile,
                        env=_settings(settings, HOLOSERVE_MAX_QUEUE_SIZE="64", HOLOSERVE_MAX_QUEUE_DELAY_MS="200"))
    try:
        srv.wait_ready()
        out["shutdown"] = asyncio.run(shutdown_case(srv, False))
    except Exception as e:
        out["shutdown"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        srv.stop()
    print(f"bounded/shutdown: {out['shutdown']}", flush=True)
    return out


def bounded_rows(res: dict) -> list[str]:
    """Markdown rows for the phase: one per case."""
    rows = ["| case | statuses | neighbours: tried / failed / max ms | RSS idle / peak / after (MB) | closed |",
            "| --- | --- | --- | --- | --- |"]
    for name, r in res.items():
        if name == "shutdown" or "error" in r:
            continue
        statuses = {k: v for k, v in r.items() if k.endswith("statuses")}
        n = r.get("neighbours", {})
        rows.append(f"| {name} | {json.dumps(statuses)} | {n.get('tried')} / {n.get('failed')} / {n.get('max_ms')} | "
                    f"{r.get('rss_idle_mb')} / {r.get('rss_peak_mb')} / {r.get('rss_after_mb')} | "
                    f"{json.dumps(r.get('closed', {}))} |")
    errors = {k: v["error"] for k, v in res.items() if "error" in v}
    if errors:
        rows.append("")
        rows += [f"- {k}: error {v}" for k, v in errors.items()]
    if "shutdown" in res:
        rows += ["", f"shutdown: {json.dumps(res['shutdown'])}"]
    return rows


# what each case must answer (statuses other than these are failures)
# (long_texts: 503 is the tokenizer's or the batcher's queue bound refusing what does not fit, with Retry-After)
EXPECTED = {"pair_10kb": {"200"}, "healthz_bodies": {"405"}, "long_texts": {"200", "503"}, "pipelined": {"200"}}
MAX_WAIT_MS, MAX_PEAK_MB, MAX_AFTER_MB = 1000.0, 400.0, 50.0


def bounded_failures(res: dict) -> dict[str, int]:
    """Failures by kind against the targets in the module docstring."""
    out: dict[str, int] = {}

    def add(kind: str, n: int = 1) -> None:
        if n:
            out[kind] = out.get(kind, 0) + n

    for name, r in res.items():
        if "error" in r:
            add(f"{name}: {r['error']}")
            continue
        if name == "shutdown":
            add("shutdown: the body completed after the signal was not answered 200",
                r.get("body_completed_after_signal") != 200)
            add("shutdown: the request sent right after the signal was not answered",
                not isinstance(r.get("idle_connection_after_signal"), int))
            add("shutdown: exit status not 0", r.get("exit_status") != 0)
            add("shutdown: a queued request got no answer", sum(v for k, v in r["full_queue_statuses"].items()
                                                                 if not k.isdigit()))
            continue
        if name == "long_texts" and not r["64x10kb_statuses"].get("200"):
            add("long_texts: no 64 x 10 KB request answered 200")
        for key, statuses in r.items():
            if key.endswith("statuses"):
                add(f"{name}: unexpected status", sum(v for k, v in statuses.items() if k not in EXPECTED[name]))
        n = r["neighbours"]
        add(f"{name}: neighbour request failed", n["failed"])
        add(f"{name}: a neighbour waited over {MAX_WAIT_MS:g} ms", n["max_ms"] > MAX_WAIT_MS)
        add(f"{name}: peak RSS over {MAX_PEAK_MB:g} MB", r["rss_peak_mb"] > MAX_PEAK_MB)
        add(f"{name}: RSS after more than {MAX_AFTER_MB:g} MB over idle",
            r["rss_after_mb"] - r["rss_idle_mb"] > MAX_AFTER_MB)
        if name == "non_reader":
            add("non_reader: closed more or less than once", sum(r["closed"].values()) != 1)
    return out
