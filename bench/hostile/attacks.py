"""Phases 2 to 8 of the hostile benchmark: each sends its attack to a running server and counts what came back
(see bench/hostile/run.py for what each phase does and what counts as a failure)."""
from __future__ import annotations

import asyncio
import socket
import struct
import time

from bench.hostile.cases import amplification_body, fuzz_cases, js, mixed_requests, v2_error_shape, v2_inputs
from bench.lib.http import Conn, closed_connections, post
from bench.lib.server import ServerProcess, rss_mb


async def run_fuzz(port: int, pair: bool, todo: list | None = None, v2: bool = False) -> dict:
    """Each case on its own connection. `v2`: every 4xx answer must also have the v2 error body."""
    cases = []
    for name, pieces, ok, n in (fuzz_cases(pair) if todo is None else todo):
        bad_shape = False
        conn = Conn(port)
        outcomes: list = []
        sent = 0
        try:
            await conn.open()
            for piece in pieces:
                try:
                    await conn.send(piece)
                    sent += len(piece)
                except (ConnectionError, OSError):
                    break  # the server stopped reading (e.g. a header over its limit)
            for _ in range(n):
                try:
                    status, headers, body = await conn.response(15)
                    if status == 100:  # an interim answer: the real one follows
                        status, headers, body = await conn.response(15)
                    outcomes.append(status)
                    bad_shape |= v2 and 400 <= status < 500 and not v2_error_shape(body)
                except ConnectionError:
                    outcomes.append("closed")
                    break
                except asyncio.TimeoutError:
                    outcomes.append("timeout")
                    break
        except (ConnectionError, OSError) as e:
            outcomes.append("reset" if isinstance(e, ConnectionResetError) else "closed")
        finally:
            conn.close()
        kind = None
        if any(isinstance(o, int) and o >= 500 for o in outcomes):
            kind = "5xx"
        elif "timeout" in outcomes:
            kind = "no answer (timeout)"
        elif len(outcomes) < n or any(o not in ok for o in outcomes):
            kind = "unexpected outcome" if all(isinstance(o, int) for o in outcomes) else "no answer (closed)"
        elif bad_shape:
            kind = "error body not {\"error\": ...}"
        cases.append({"case": name, "outcomes": outcomes, "expected": sorted(map(str, ok)),
                      "bytes_sent": sent, "failure": kind})
    failures: dict[str, int] = {}
    for c in cases:
        if c["failure"]:
            failures[c["failure"]] = failures.get(c["failure"], 0) + 1
    return {"tried": len(cases), "failures": failures, "cases": cases}


async def run_mixed(port: int, good: int, bad: int, clients: int, pair: bool) -> dict:
    work = mixed_requests(good, bad, pair)
    queue = list(reversed(work))
    statuses: dict[str, dict[str, int]] = {}
    failures: dict[str, int] = {}
    t0 = time.perf_counter()

    def fail(kind: str) -> None:
        failures[kind] = failures.get(kind, 0) + 1

    async def client():
        conn = Conn(port)
        while queue:
            kind, body, ok = queue.pop()
            try:
                if conn.writer is None:
                    await conn.open()
                await conn.send(post(body))
                status, headers, _ = await conn.response(30)
            except (ConnectionError, OSError, asyncio.TimeoutError) as e:
                fail(f"{'good' if kind == 'good' else 'bad'} request: connection dropped "
                     f"({type(e).__name__})")
                conn.close()
                continue
            bucket = statuses.setdefault(kind, {})
            bucket[str(status)] = bucket.get(str(status), 0) + 1
            who = "good" if kind == "good" else "bad"
            if status >= 500:
                fail(f"{who} request: {status}")
            elif status not in ok:
                fail(f"{who} request: unexpected {status}")
            if headers.get("connection", "").lower() == "close":
                conn.close()
        conn.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return {"tried": len(work), "good": good, "bad": bad, "clients": clients,
            "wall_s": round(time.perf_counter() - t0, 2), "status_by_kind": statuses, "failures": failures}


async def legit(port: int, pair: bool, timeout: float = 5.0) -> bool:
    body = js({"pairs": [["a man rides a horse", "a man is riding a horse"]]} if pair else {"text": "a fun film"})
    conn = Conn(port)
    try:
        await asyncio.wait_for(conn.open(), timeout)
        await conn.send(post(body))
        status, _, _ = await conn.response(timeout)
        return status == 200
    except (ConnectionError, OSError, asyncio.TimeoutError):
        return False
    finally:
        conn.close()


async def open_many(port: int, n: int, first: bytes) -> list[Conn]:
    conns = []
    for i in range(n):
        c = Conn(port)
        try:
            await asyncio.wait_for(c.open(), 5)
            if first:
                await c.send(first)
        except (ConnectionError, OSError, asyncio.TimeoutError):
            pass  # refused or reset at once: counted as closed below
        conns.append(c)
        if i % 50 == 49:
            await asyncio.sleep(0)
    return conns


async def run_slow(server: ServerProcess, port: int, pair: bool, slowloris: int, slow_body: int, idle: int,
                   huge: int, hold: float) -> dict:
    mem_before = server.memory_kb()
    groups = {
        "slow header": await open_many(port, slowloris, b"GET /healthz HTTP/1.1\r\nHost: bench\r\n"),
        "slow body": await open_many(port, slow_body, b"POST /predict HTTP/1.1\r\nHost: bench\r\n"
                                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"),
        "idle": await open_many(port, idle, b""),
        "16 MB partial header": await open_many(port, huge, b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Big: "),
    }
    for c in groups["16 MB partial header"]:  # 16 MB of one header that never ends
        for _ in range(16):
            try:
                await c.send(b"b" * (1 << 20))
            except (ConnectionError, OSError, AttributeError):
                break
    ok = 0
    t0 = time.monotonic()
    tick = 0
    while time.monotonic() - t0 < hold:
        tick += 1
        for name, piece in (("slow header", b"X-Slow: 1\r\n"), ("slow body", b"a")):
            for c in groups[name]:
                if c.writer is not None and not c.writer.is_closing():
                    try:
                        c.writer.write(piece)  # a trickle: one piece per second per connection
                    except (ConnectionError, OSError):
                        pass
        ok += await legit(port, pair)
        await asyncio.sleep(max(0.0, t0 + tick - time.monotonic()))
    still_open = {name: 0 for name in groups}
    for name, conns in groups.items():
        for c in conns:
            if not await c.closed(0.02):
                still_open[name] += 1
            c.close()
    mem_after = server.memory_kb()
    return {"attack_connections": {k: len(v) for k, v in groups.items()}, "held_s": hold,
            "still_open_after_hold": still_open, "legit_tried": tick, "legit_ok": ok,
            "server_rss_mb_before": round(mem_before.get("VmRSS", 0) / 1024, 1),
            "server_peak_rss_mb": round(mem_after.get("VmHWM", 0) / 1024, 1)}


async def run_flood(port: int, pair: bool, stalled: int, legit_n: int) -> dict:
    conns = await open_many(port, stalled, b"GET /healthz HTTP/1.1\r\nHost: bench\r\n")
    await asyncio.sleep(0.5)
    results = await asyncio.gather(*(legit(port, pair) for _ in range(legit_n)))
    closed = 0
    for c in conns:
        closed += await c.closed(0.01)
        c.close()
    return {"stalled_connections": stalled, "closed_by_server": closed, "legit_tried": legit_n,
            "legit_ok": int(sum(results))}


class RssSampler:
    """The largest resident memory of a set of processes (their sum), sampled every 50 ms."""

    def __init__(self, pids):
        self.pids = pids  # a callable: the pids to sample now (workers come and go)
        self.peak = 0.0
        self.task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, sum(rss_mb(p) for p in self.pids()))
            await asyncio.sleep(0.05)

    def __enter__(self):
        self.peak = sum(rss_mb(p) for p in self.pids())
        self.task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc):
        self.task.cancel()


async def run_leavers(port: int, pair: bool, n: int) -> dict:
    """Clients that send three pipelined requests and reset the connection while the first is answered."""
    body = js({"pairs": [["a man rides a horse", "a man is riding a horse"]] * 64} if pair
              else {"texts": ["a fun film"] * 64})
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(post(body) * 3)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    await asyncio.sleep(1.0)  # let the server finish what it took
    return {"connections": n}


async def neighbours(port: int, pair: bool, clients: int, seconds: float, name: str, token: str = "",
                     fresh: bool = False, log: list | None = None) -> dict:
    """Closed-loop clients sending good /predict and v2 requests for `seconds`; each request's (start, end,
    ok) goes to `log`. `fresh`: a new connection per request (as a load balancer's health-checked pool)."""
    log = [] if log is None else log
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    good_predict = post(js({"pairs": [["a man rides a horse", "a man is riding a horse"]]} if pair else
                           {"text": "a fun film"}), extra=auth)
    good_v2 = post(js({"inputs": v2_inputs(["a fun film", "a dull mess"], pair)}), f"/v2/models/{name}/infer",
                   extra=auth)
    deadline = time.monotonic() + seconds

    async def client(i: int) -> None:
        conn = Conn(port)
        k = 0
        while time.monotonic() < deadline:
            k += 1
            t0 = time.monotonic()
            ok = False
            try:
                if conn.writer is None:
                    await conn.open()
                await conn.send(good_v2 if (i + k) % 2 else good_predict)
                status, headers, _ = await conn.response(30)
                ok = status == 200
                if fresh or headers.get("connection", "").lower() == "close":
                    conn.close()
            except (ConnectionError, OSError, asyncio.TimeoutError):
                conn.close()
            log.append((t0, time.monotonic(), ok))
        conn.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    lat = sorted(e - s for s, e, _ in log)
    pick = lambda q: round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else 0.0  # noqa: E731
    return {"tried": len(log), "failed": sum(not ok for *_, ok in log), "p50_ms": pick(0.5), "p99_ms": pick(0.99),
            "max_ms": round(1000 * lat[-1], 1) if lat else 0.0}


async def run_amplification(server: ServerProcess, port: int, pair: bool, name: str, attackers: int, non_readers: int,
                            clients: int, seconds: float) -> dict:
    """Neighbours alone, then beside clients that send the 0.9 MB amplification request in a loop and
    clients that send it and never read the answer."""
    base = await neighbours(port, pair, clients, seconds / 2, name)
    body = post(amplification_body(pair), f"/v2/models/{name}/infer")
    statuses: dict[str, int] = {}
    deadline = time.monotonic() + seconds

    async def attacker() -> None:
        conn = Conn(port)
        while time.monotonic() < deadline:
            await conn.tally(body, statuses, 30)
        conn.close()

    silent = []
    for _ in range(non_readers):  # send it (twice, pipelined) and never read
        c = Conn(port)
        await c.open()
        c.writer.write(body * 2)
        silent.append(c)
    with RssSampler(lambda: [server.proc.pid]) as rss:
        attack = asyncio.gather(*(attacker() for _ in range(attackers)))
        near = await neighbours(port, pair, clients, seconds, name)
        await attack
    for c in silent:
        c.close()
    return {"attackers": attackers, "non_readers": non_readers, "clients": clients, "seconds": seconds,
            "attack_statuses": statuses, "baseline": base, "under_attack": near,
            "server_peak_rss_mb": round(rss.peak, 1)}


async def run_unread(server: ServerProcess, port: int, pair: bool, name: str, conns: int, pipelined: int, clients: int,
                     send_timeout: float) -> dict:
    """Connections that pipeline requests with ~0.9 MB answers (a long id, echoed) and never read them,
    beside neighbours; the server must stop writing to them and abort each: after its send timeout, or
    earlier when the stalled answers together pass the server's budget for them. Waits (up to 60 s more)
    until every one is aborted, with the server's memory sampled throughout."""
    reasons = ("send_timeout", "send_budget")
    body = js({"id": "r" * 900_000, "inputs": v2_inputs(["a fun film"], pair)})
    req = post(body, f"/v2/models/{name}/infer")
    counters = closed_connections(server.url)
    before = {r: counters.get(r, 0.0) for r in reasons}
    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    silent = []
    for _ in range(conns):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing, small window
        s.setblocking(False)
        await loop.sock_connect(s, ("127.0.0.1", port))
        _, writer = await asyncio.open_connection(sock=s)
        writer.write(req * pipelined)  # never drained: the server stops reading once it stops writing
        silent.append(writer)
    hold = send_timeout + 3.0
    with RssSampler(lambda: [server.proc.pid]) as rss:
        near = await neighbours(port, pair, clients, hold, name)
        while True:
            counters = closed_connections(server.url)
            closed = {r: int(counters.get(r, 0.0) - before[r]) for r in reasons}
            if sum(closed.values()) >= conns or time.monotonic() - t0 > hold + 60:
                break
            await asyncio.sleep(0.2)
    all_closed_s = round(time.monotonic() - t0, 1)
    for w in silent:
        w.transport.abort()
    return {"connections": conns, "pipelined": pipelined, "answer_bytes": len(body) + 200, "held_s": hold,
            "send_timeout_s": send_timeout, "aborted_by_server": sum(closed.values()), "aborted_by_reason": closed,
            "all_aborted_after_s": all_closed_s, "neighbours": near, "server_peak_rss_mb": round(rss.peak, 1)}
