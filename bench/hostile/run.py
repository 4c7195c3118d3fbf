"""Hostile-load benchmark: `holoserve serve` under fuzzed requests, mixed bad/good load and slow or
stalled connections, with counts of what was tried and of every failure by kind.

Phases, each against a real server process on loopback:

1. settings: start the server with a --max-seq-length beyond the model's position table. It must
   refuse to start; if it starts anyway, the mixed load of phase 3 runs against it (long texts then
   reach the model and fail inside it).
2. fuzz: one connection per case, raw bytes (invalid JSON and UTF-8, deep nesting, oversize bodies and
   headers, request smuggling shapes, pipelining, garbage that is not HTTP, ...), each with the
   statuses it may get. A failure is a 5xx, an unexpected status, or no answer.
3. mixed: closed-loop keep-alive clients sending good requests with bad ones mixed in (900-word texts,
   invalid JSON, too many items, oversize bodies, ...). A failure is a good request not answered 200,
   a bad one answered otherwise than expected, a 5xx, or a connection the server dropped mid-request.
4. slow: slow-header ("slowloris"), slow-body, idle and huge-partial-header connections held open past
   the server's timeouts while legitimate requests are sent; then the attackers still open are counted,
   with the server's peak memory.
5. flood: more stalled connections than the server may hold (and than its open-file limit allows),
   then legitimate requests.
6. v2: malformed and edge KServe v2 requests (JSON and binary framing, duplicate outputs, non-boolean
   flags, a NaN id, data nested against its shape, compressed bodies, connection-level errors on /v2
   paths, whose bodies must be {"error": "..."}); then clients that reset a connection while
   pipelined requests are answered. Error-level lines in the server's log count as failures.
7. amplification: neighbours alone, then beside clients that loop a 0.9 MB request naming one output
   50,000 times (and clients that send it and never read), with the server's peak memory.
8. unread: connections that pipeline requests with ~0.9 MB answers and never read them, beside
   neighbours: each must be aborted (after the server's send timeout, or sooner when the stalled
   answers together pass the server's budget for them), memory staying bounded.
10. bounded (bench/hostile/bounded.py): a pair of 10 KB texts on a pair model, 1,000 unauthenticated 999 KB
   bodies to POST /healthz, 64 x 10 KB texts per request, 120 pipelined requests and part of a 121st, a
   SIGTERM with a body arriving and a full queue, a client that never reads: each on a fresh server with
   its peak and after memory, the neighbours' longest wait, statuses and counters.
9. workers: `--workers 2` with a token: duplicate Authorization headers, then a worker SIGKILLed under
   load (fresh connection per request): failures only among the requests in flight at the kill, the
   worker replaced, /metrics agreeing with /readyz within 5 s.

The server runs with a low open-file limit (--server-nofile, 1024 by default: a common soft limit) and
short header/body timeouts (--header-timeout, --body-timeout) so that a run takes about a minute.
Results go to bench/results/<today>-hostile/hostile.json and .md (--out).

    python -m bench.hostile.run                      # a tiny random checkpoint (needs the dev install)
    python -m bench.hostile.run --checkpoint runs/minilm-sst2-quick
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from bench import dated_results  # noqa: E402
from holoserve.core.files import atomic_write_json, atomic_write_text  # noqa: E402
from holoserve.core.machine import cpu_name  # noqa: E402

WORDS = ("the movie was good and the actors were great but the plot was very dull and boring "
         "i loved it she hated the story a fun film with a sad ending").split()


# --------------------------------------------------------------------------- server process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`holoserve serve` from `root` (a checkout) in a child process; settings go in as HOLOSERVE_*
    variables so that any version of the server can be measured with the same command."""

    def __init__(self, root: Path, ckpt: Path, settings: dict[str, str], log: Path, nofile: int):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOLOSERVE_")}
        env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(root),
                    "HOLOSERVE_PORT": str(self.port), "HOLOSERVE_HOST": "127.0.0.1", **settings})

        def limit_files():
            if nofile:
                import resource

                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "holoserve", "serve", str(ckpt)], env=env, cwd=root,
                                     stdout=subprocess.DEVNULL, stderr=open(log, "ab"), preexec_fn=limit_files)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120) -> bool:
        """True once /readyz answers 200; False if the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return True
            except Exception:
                time.sleep(0.2)
        raise TimeoutError(f"the server did not become ready in {timeout} s; see {self.log}")

    def memory_kb(self) -> dict[str, int]:
        out = {}
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM"):
                    out[k] = int(v.split()[0])
        except OSError:
            pass
        return out

    def metrics(self) -> dict[str, float]:
        """The connection counters, where the server has them."""
        try:
            text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        except Exception:
            return {}
        out = {}
        for line in text.splitlines():
            if line.startswith("holoserve_http_connections_closed_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] = float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------- a raw HTTP/1.1 client


class Conn:
    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port, limit=1 << 20)

    async def send(self, data: bytes) -> None:
        if self.writer is None:
            raise ConnectionError("not connected")
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
        """One response; raises ConnectionError when the server closed without (finishing) one."""
        async def read():
            line = await self.reader.readline()
            if not line:
                raise ConnectionError("closed")
            status = int(line.split()[1])
            headers = {}
            while True:
                h = await self.reader.readline()
                if h in (b"\r\n", b""):
                    break
                k, _, v = h.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            n = int(headers.get("content-length", 0))
            body = await self.reader.readexactly(n) if n else b""
            return status, headers, body

        try:
            return await asyncio.wait_for(read(), timeout)
        except asyncio.IncompleteReadError:
            raise ConnectionError("closed mid-response") from None

    async def closed(self, wait: float = 0.05) -> bool:
        """Whether the server has closed this connection (reading whatever it sent before closing)."""
        if self.reader is None:
            return True
        try:
            while True:
                data = await asyncio.wait_for(self.reader.read(65536), wait)
                if not data:
                    return True
        except asyncio.TimeoutError:
            return False
        except (ConnectionError, OSError):
            return True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def tally(self, request: bytes, statuses: dict[str, int], timeout: float) -> None:
        """Send `request` (connecting first where needed) and count its status, or the error that ended the
        connection, in `statuses`; a `Connection: close` answer closes this side too."""
        try:
            if self.writer is None:
                await self.open()
            await self.send(request)
            status, headers, _ = await self.response(timeout)
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if headers.get("connection", "").lower() == "close":
                self.close()
        except (ConnectionError, OSError, asyncio.TimeoutError) as e:
            statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
            self.close()


def post(body: bytes, path: str = "/predict", ctype: str = "application/json", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


def get(path: str, extra: str = "", version: str = "1.1") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: bench\r\n{extra}\r\n".encode()


def js(obj) -> bytes:
    return json.dumps(obj).encode()


def long_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


# --------------------------------------------------------------------------- 2. fuzz cases


def fuzz_cases(pair: bool) -> list[tuple[str, list[bytes], set, int]]:
    """(name, pieces of raw bytes to send, acceptable outcomes, responses expected). An outcome is a
    status code or 'closed' (the server closed the connection without an answer, where that is right)."""
    good = {"pairs": [["a man rides a horse", "a man is riding a horse"]]} if pair else {"text": "a fun film"}
    chunked_big = (b"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(b"100000\r\n" + b"a" * 0x100000 + b"\r\n"
                                                              for _ in range(2)) + b"0\r\n\r\n")
    big_header = [b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Big: "] + [b"b" * (1 << 20)] * 32 + [b"\r\n\r\n"]
    return [
        ("valid request", [post(js(good))], {200}, 1),
        ("invalid JSON", [post(b'{"text": "unterminated')], {422}, 1),
        ("invalid UTF-8", [post(b'{"text": "caf\xe9"}')], {400}, 1),
        ("UTF-16 garbage", [post(b"\xff\xfe\x00")], {400}, 1),
        ("JSON nested 100k deep", [post(b"[" * 100_000)], {400, 422}, 1),
        ("number 1e999999 as text", [post(b'{"text": 1e999999}')], {422}, 1),
        ("lone surrogate", [post(b'{"text": "\\ud800"}')], {422}, 1),
        ("NUL inside a text", [post(js({"texts" if not pair else "pairs": [["a\u0000b", "c"]] if pair else ["a\u0000b"]}))],
         {200}, 1),
        ("65 items", [post(js({"texts": ["a"] * 65}))], {400, 422}, 1),
        ("10,001-byte text", [post(js({"text": "a" * 10_001}))], {400, 422}, 1),
        ("5,000 emoji (20 kB)", [post(js({"text": "\U0001F600" * 5000}))], {400, 422}, 1),
        ("2 MB body with Content-Length", [post(b"[" + b"1," * 1_000_000 + b"1]")], {413}, 1),
        ("2 MB chunked body", [chunked_big], {413}, 1),
        ("Content-Length lies (says 10 MB)",
         [b"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Length: 10000000\r\n\r\n{}"], {413}, 1),
        ("Content-Length: -1", [b"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Length: -1\r\n\r\n"], {400}, 1),
        ("Content-Length and Transfer-Encoding",
         [b"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
          b"0\r\n\r\n"], {400}, 1),
        ("32 MB header", big_header, {431, "closed"}, 1),
        ("100 kB URL", [get("/healthz?" + "a" * 100_000)], {414, 431, "closed"}, 1),
        ("2,000 small headers", [get("/healthz", "".join(f"X-H{i}: v\r\n" for i in range(2000)))],
         {431, "closed"}, 1),
        ("NUL in a header value", [b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-A: a\x00b\r\n\r\n"], {400}, 1),
        ("TLS hello on the plain port", [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64)],
         {400, "closed"}, 1),
        ("unknown method", [b"BREW /predict HTTP/1.1\r\nHost: bench\r\n\r\n"], {400, 405}, 1),
        ("GET /predict", [get("/predict")], {405}, 1),
        ("path traversal", [get("/../../etc/passwd")], {404}, 1),
        ("text/plain body", [post(b"hello", ctype="text/plain")], {422}, 1),
        ("empty body", [post(b"")], {422}, 1),
        ("wrong input kind", [post(js({"text": "a"} if pair else {"pairs": [["a", "b"]]}))], {400}, 1),
        ("both text and texts", [post(js({"text": "a", "texts": ["b"]}))], {422}, 1),
        ("duplicate JSON keys", [post(b'{"text": "a", "text": "b"}') if not pair else post(js(good))], {200}, 1),
        ("HTTP/1.0", [get("/healthz", version="1.0")], {200}, 1),
        ("3 pipelined requests", [post(js(good)) * 3], {200}, 3),
        ("Expect: 100-continue", [post(js(good), extra="Expect: 100-continue\r\n")], {100, 200}, 1),
        ("hostile X-Request-Id", [get("/healthz", "X-Request-Id: ../../<script>\r\n")], {200}, 1),
    ]


def v2_error_shape(body: bytes) -> bool:
    """The Open Inference Protocol's error body: {"error": "..."}."""
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(obj) == {"error"} and isinstance(obj["error"], str)


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


# --------------------------------------------------------------------------- 3. mixed load


def mixed_requests(good: int, bad: int, pair: bool, seed: int = 0) -> list[tuple[str, bytes, set]]:
    rng = random.Random(seed)
    sentence = lambda: long_text(rng.randint(3, 12), rng.randint(0, 1 << 30))  # noqa: E731
    if pair:
        good_body = lambda: js({"pairs": [[sentence(), sentence()]]})  # noqa: E731
        long_body = lambda: js({"pairs": [[long_text(450, rng.randint(0, 1 << 30)), long_text(450)]]})  # noqa: E731
    else:
        good_body = lambda: js({"text": sentence()})  # noqa: E731
        long_body = lambda: js({"text": long_text(900, rng.randint(0, 1 << 30))})  # noqa: E731
    kinds = [  # (kind, body maker, acceptable statuses); the 900-word text is valid: truncated, answered
        ("900-word text", long_body, {200}),
        ("invalid JSON", lambda: b'{"text": "oops', {422}),
        ("invalid UTF-8", lambda: b'{"text": "\xff\xfe"}', {400}),
        ("65 items", lambda: js({"texts": ["a"] * 65}), {400, 422}),
        ("empty text", lambda: js({"text": "   "}), {400, 422}),
        ("wrong type", lambda: js({"text": 42}), {422}),
        ("1.5 MB body", lambda: b'{"text": "' + b"a" * 1_500_000 + b'"}', {413}),
    ]
    out = [("good", good_body(), {200}) for _ in range(good)]
    for i in range(bad):
        kind, make, ok = kinds[i % len(kinds)] if i % 2 else kinds[0]  # half the bad ones are long texts
        out.append((kind, make(), ok))
    rng.shuffle(out)
    return out


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


# --------------------------------------------------------------------------- 4./5. slow and stalled connections


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


async def run_slow(server: Server, port: int, pair: bool, slowloris: int, slow_body: int, idle: int,
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


# --------------------------------------------------------------------------- 6.-9. KServe v2, output size, workers


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


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


def model_name(url: str, token: str = "") -> str:
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {token}"} if token else {})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())["models"][0]["name"]


def v2_inputs(texts: list[str], pair: bool) -> list[dict]:
    inputs = [{"name": "TEXT", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]
    if pair:
        inputs.append({"name": "TEXT_PAIR", "shape": [len(texts)], "datatype": "BYTES", "data": texts})
    return inputs


def v2_binary(texts: list[str], pair: bool) -> tuple[bytes, int]:
    """A binary-tensor request as tritonclient sends it: the JSON header, then each BYTES element."""
    blob = b"".join(len(t.encode()).to_bytes(4, "little") + t.encode() for t in texts)
    inputs = [{"name": "TEXT", "shape": [len(texts)], "datatype": "BYTES",
               "parameters": {"binary_data_size": len(blob)}}]
    if pair:
        inputs.append({**inputs[0], "name": "TEXT_PAIR"})
    head = js({"inputs": inputs, "outputs": [{"name": "LOGITS", "parameters": {"binary_data": True}},
                                             {"name": "LABEL", "parameters": {"binary_data": True}}]})
    return head + blob * (2 if pair else 1), len(head)


def amplification_body(pair: bool) -> bytes:
    """64 texts and one output named 50,000 times: 0.9 MB that asked for a 125 MB answer."""
    return json.dumps({"inputs": v2_inputs([long_text(12, i) for i in range(64)], pair),
                       "outputs": [{"name": "LOGITS"}] * 50_000}, separators=(",", ":")).encode()


def v2_cases(name: str, pair: bool) -> list[tuple[str, list[bytes], set, int]]:
    """Malformed and edge KServe v2 requests; every 4xx answer must carry the protocol's {"error": "..."}."""
    import gzip
    import zlib

    infer = f"/v2/models/{name}/infer"
    one = v2_inputs(["a fun film"], pair)
    good = js({"inputs": one})
    binary, head_len = v2_binary(["a fun film", "a dull mess"], pair)
    out = lambda outputs, **kw: js({"inputs": one, "outputs": outputs, **kw})  # noqa: E731
    return [
        ("v2: JSON request", [post(good, infer)], {200}, 1),
        ("v2: binary request (tritonclient's framing)",
         [post(binary, infer, "application/octet-stream", f"Inference-Header-Content-Length: {head_len}\r\n")],
         {200}, 1),
        ("v2: one output 50,000 times (0.9 MB)", [post(amplification_body(pair), infer)], {400}, 1),
        ("v2: an output listed twice", [post(out([{"name": "LABEL"}, {"name": "LABEL"}]), infer)], {400}, 1),
        ('v2: binary_data "no"', [post(out([{"name": "LOGITS", "parameters": {"binary_data": "no"}}]), infer)],
         {400}, 1),
        ('v2: binary_data_output "false"', [post(js({"inputs": one, "parameters": {"binary_data_output": "false"}}),
                                                 infer)], {400}, 1),
        ("v2: id NaN", [post(b'{"id": NaN, "inputs": ' + js(one) + b"}", infer)], {400}, 1),
        ("v2: id a number", [post(js({"id": 5, "inputs": one}), infer)], {400}, 1),
        ("v2: shape [2] with data [[a, b]]",
         [post(js({"inputs": [{"name": "TEXT", "shape": [2], "datatype": "BYTES", "data": [["a", "b"]]}]}), infer)],
         {400}, 1),
        ("v2: answer over the body limit (0.8 MB non-ASCII id)",
         [post(json.dumps({"id": "\u00e9" * 400_000, "inputs": one}, ensure_ascii=False).encode(), infer)], {400}, 1),
        ("v2: gzip request", [post(gzip.compress(good), infer, extra="Content-Encoding: gzip\r\n")], {200}, 1),
        ("v2: deflate request", [post(zlib.compress(good), infer, extra="Content-Encoding: deflate\r\n")], {200}, 1),
        ("v2: Content-Encoding br", [post(good, infer, extra="Content-Encoding: br\r\n")], {415}, 1),
        ("v2: gzip bomb (5 MB in 5 kB)", [post(gzip.compress(b" " * 5_000_000), infer,
                                               extra="Content-Encoding: gzip\r\n")], {413}, 1),
        ("v2: gzip header, plain body", [post(good, infer, extra="Content-Encoding: gzip\r\n")], {400}, 1),
        ("v2: head over the limit", [post(good, infer, extra=f"X-Pad: {'a' * 20_000}\r\n")], {431}, 1),
        ("v2: NUL in a header value", [f"GET /v2/models/{name} HTTP/1.1\r\nHost: bench\r\nX-A: a".encode()
                                       + b"\x00b\r\n\r\n"], {400}, 1),
        ("v2: head never completed", [f"POST {infer} HTTP/1.1\r\nHost: bench\r\n".encode()], {408}, 1),
        ("v2: body never completed",
         [f"POST {infer} HTTP/1.1\r\nHost: bench\r\nContent-Length: 100\r\n\r\n{{".encode()], {408}, 1),
        ("v2: unknown model", [post(good, "/v2/models/nope/infer")], {404}, 1),
    ]


async def run_leavers(port: int, pair: bool, n: int) -> dict:
    """Clients that send three pipelined requests and reset the connection while the first is answered."""
    import struct

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


async def run_amplification(server: Server, port: int, pair: bool, name: str, attackers: int, non_readers: int,
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


async def run_unread(server: Server, port: int, pair: bool, name: str, conns: int, pipelined: int, clients: int,
                     send_timeout: float) -> dict:
    """Connections that pipeline requests with ~0.9 MB answers (a long id, echoed) and never read them,
    beside neighbours; the server must stop writing to them and abort each: after its send timeout, or
    earlier when the stalled answers together pass the server's budget for them. Waits (up to 60 s more)
    until every one is aborted, with the server's memory sampled throughout."""
    reasons = ("send_timeout", "send_budget")
    body = js({"id": "r" * 900_000, "inputs": v2_inputs(["a fun film"], pair)})
    req = post(body, f"/v2/models/{name}/infer")
    counters = server.metrics()
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
            counters = server.metrics()
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


def scrape(url: str, token: str) -> dict[str, float]:
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for key in ("holoserve_model_ready", "holoserve_workers_ready", "holoserve_http_requests_in_flight",
                    "holoserve_http_connections"):
            if line.startswith(key + "{") or line.startswith(key + " "):
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def ready_workers(scraped: dict[str, float]) -> float:
    """Warm workers, from holoserve_workers_ready (or, from a server without it, model_ready as the least
    over workers: 1 when both are)."""
    if "holoserve_workers_ready" in scraped:
        return scraped["holoserve_workers_ready"]
    return 2.0 if scraped.get("holoserve_model_ready") == 1 else 0.0


def readyz(url: str) -> int:
    try:
        return urllib.request.urlopen(url + "/readyz", timeout=10).status
    except Exception:
        return 0


async def run_worker_kill(root: Path, ckpt: Path, settings: dict, log: Path, nofile: int, pair: bool,
                          clients: int, tmp: Path) -> dict:
    """`--workers 2` with a token: neighbours on fresh connections, one worker SIGKILLed mid-load."""
    token = "bench-" + os.urandom(8).hex()
    metrics_dir = tmp / "metrics"
    srv = Server(root, ckpt, {**settings, "HOLOSERVE_WORKERS": "2", "HOLOSERVE_API_TOKEN": token,
                              "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}, log, nofile)
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


# --------------------------------------------------------------------------- report


def write_markdown(res: dict, path: Path) -> None:
    m, s = res["machine"], res["summary"]
    lines = [
        f"# Hostile load: {res['checkpoint']} on {m['cores']}-core {m['arch']} CPU",
        "",
        f"{res['date']} · {m['cpu']} · server settings {res['server_settings']} · server open-file limit "
        f"{res['server_nofile'] or 'inherited'} · `{res['command']}`",
        "",
        f"**{s['requests_tried']} requests and {s['connections_tried']} hostile connections tried; "
        f"{s['failures_total']} failures.**",
        "",
        "| failure kind | count |",
        "| --- | ---: |",
    ]
    lines += [f"| {k} | {v} |" for k, v in sorted(s["failures_by_kind"].items())] or ["| (none) | 0 |"]
    st = res["settings"]
    lines += ["", "## 1. Settings the model cannot honour",
              f"`--max-seq-length {st['max_seq_length']}` (the position table holds {st['position_table']}): "
              + ("refused at start (exit code {}): {}".format(st["exit_code"], st["message"]) if st["refused"]
                 else "**the server started**; the mixed load below ran against it.")]
    lines += ["", "## 2. Fuzz cases", "", "| case | outcome | expected | failure |", "| --- | --- | --- | --- |"]
    for c in res["fuzz"]["cases"]:
        lines.append(f"| {c['case']} | {', '.join(map(str, c['outcomes']))} | {', '.join(c['expected'])} | "
                     f"{c['failure'] or '-'} |")
    mx = res["mixed"]
    lines += ["", "## 3. Mixed bad/good load",
              f"{mx['good']} good and {mx['bad']} bad requests from {mx['clients']} keep-alive clients in "
              f"{mx['wall_s']} s.", "", "| kind | statuses |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in sorted(mx["status_by_kind"].items())]
    sl = res["slow"]
    lines += ["", "## 4. Slow connections",
              f"Held {sl['held_s']} s (the server's timeouts: header {res['timeouts']['header']} s, body "
              f"{res['timeouts']['body']} s); legitimate requests meanwhile: {sl['legit_ok']}/{sl['legit_tried']} "
              f"answered 200. Server memory: {sl['server_rss_mb_before']} MB before, peak "
              f"{sl['server_peak_rss_mb']} MB.", "", "| attack | connections | still open after the hold |",
              "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v} | {sl['still_open_after_hold'][k]} |" for k, v in sl["attack_connections"].items()]
    fl = res["flood"]
    lines += ["", "## 5. Connection flood",
              f"{fl['stalled_connections']} stalled connections: {fl['closed_by_server']} closed by the server; "
              f"legitimate requests meanwhile: {fl['legit_ok']}/{fl['legit_tried']} answered 200."]
    if "v2" in res:
        lines += ["", "## 6. KServe v2 edges",
                  "Every 4xx answer on a /v2 path must carry the protocol's `{\"error\": \"...\"}` body.", "",
                  "| case | outcome | expected | failure |", "| --- | --- | --- | --- |"]
        for c in res["v2"]["cases"]:
            lines.append(f"| {c['case']} | {', '.join(map(str, c['outcomes']))} | {', '.join(c['expected'])} | "
                         f"{c['failure'] or '-'} |")
        lv = res["leavers"]
        lines += ["", f"{lv['connections']} clients sent three pipelined 64-text requests each and reset the "
                  f"connection while the first was answered; error-level lines in the server's log over phases 2-8: "
                  f"{res['server_log_errors']}."]
    if "amplification" in res:
        am = res["amplification"]
        b, u = am["baseline"], am["under_attack"]
        lines += ["", "## 7. Output amplification",
                  f"{am['attackers']} clients sending a 0.9 MB v2 request with 64 texts and one output named 50,000 "
                  f"times, in a loop, and {am['non_readers']} that send it twice and never read, for "
                  f"{am['seconds']} s beside {am['clients']} neighbours (keep-alive, /predict and v2 in turn). "
                  f"Attack answers: {am['attack_statuses']}. Server peak RSS during the attack: "
                  f"{am['server_peak_rss_mb']} MB.", "",
                  "| neighbours | requests | failed | p50 ms | p99 ms | max ms |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |",
                  f"| alone | {b['tried']} | {b['failed']} | {b['p50_ms']} | {b['p99_ms']} | {b['max_ms']} |",
                  f"| beside the attack | {u['tried']} | {u['failed']} | {u['p50_ms']} | {u['p99_ms']} | "
                  f"{u['max_ms']} |"]
    if "unread" in res:
        ur = res["unread"]
        nb = ur["neighbours"]
        lines += ["", "## 8. Answers nobody reads",
                  f"{ur['connections']} connections each pipelined {ur['pipelined']} v2 requests whose answers are "
                  f"~{ur['answer_bytes'] // 1000} kB (a long id, echoed) and never read them (4 kB receive buffer); "
                  f"send timeout {ur['send_timeout_s']} s. Aborted by the server: "
                  f"{ur['aborted_by_server']}/{ur['connections']} ({ur.get('aborted_by_reason')}, the last "
                  f"{ur.get('all_aborted_after_s')} s after they connected). Neighbours in the first "
                  f"{ur['held_s']} s: {nb['tried'] - nb['failed']}/"
                  f"{nb['tried']} answered 200 (p99 {nb['p99_ms']} ms, max {nb['max_ms']} ms). Server peak RSS: "
                  f"{ur['server_peak_rss_mb']} MB."]
    if "workers" in res:
        wk = res["workers"]
        nb = wk.get("neighbours", {})
        lines += ["", "## 9. `--workers 2` with a token: a worker SIGKILLed under load", "",
                  "| auth case | status | expected | failure |", "| --- | ---: | ---: | --- |"]
        lines += [f"| {c['case']} | {c['status']} | {c['expected']} | {c['failure'] or '-'} |"
                  for c in wk.get("auth_cases", [])]
        lines += ["", f"{wk.get('clients')} neighbours on fresh connections for 6 s; one worker SIGKILLed at 2 s. "
                  f"Neighbour requests: {nb.get('tried')}, failed {nb.get('failed')} (in flight at the kill: "
                  f"{wk.get('in_flight_at_kill')}; failed among those sent after it: "
                  f"{wk.get('failed_after_kill_sent')}). "
                  f"Replacement worker running after {wk.get('replaced_after_s')} s. /metrics agreed with /readyz "
                  f"(ready, 1 request and 1 connection open: the scrape's) {wk.get('metrics_consistent_after_s')} s "
                  f"after the load ended; last scrape {wk.get('last_scrape')}. Workers' peak RSS (sum): "
                  f"{wk.get('workers_peak_rss_mb')} MB."]
    if res.get("server_counters"):
        lines += ["", f"Connections the server closed, by reason (its metrics): {res['server_counters']}"]
    if "bounded" in res:
        from bench.hostile.bounded import bounded_rows

        lines += ["", "## 10. Work and memory bounded before anything is done", ""] + bounded_rows(res["bounded"])
    atomic_write_text(path, "\n".join(lines) + "\n")


def summarize(res: dict) -> dict:
    failures: dict[str, int] = {}

    def add(kind: str, n: int = 1) -> None:
        if n:
            failures[kind] = failures.get(kind, 0) + n

    if not res["settings"]["refused"]:
        add("settings: started with a sequence length the model cannot take")
    for k, v in res["fuzz"]["failures"].items():
        add(f"fuzz: {k}", v)
    for k, v in res["mixed"]["failures"].items():
        add(f"mixed: {k}", v)
    sl = res["slow"]
    for k, v in sl["still_open_after_hold"].items():
        add(f"slow: {k} connection still open after {sl['held_s']} s", v)
    add("slow: legitimate request failed", sl["legit_tried"] - sl["legit_ok"])
    fl = res["flood"]
    add("flood: legitimate request failed", fl["legit_tried"] - fl["legit_ok"])
    tried = res["fuzz"]["tried"] + res["mixed"]["tried"] + sl["legit_tried"] + fl["legit_tried"]
    conns = sum(sl["attack_connections"].values()) + fl["stalled_connections"]
    if "v2" in res:
        for k, v in res["v2"]["failures"].items():
            add(f"v2: {k}", v)
        add("server log: error-level lines", res["server_log_errors"])
        tried += res["v2"]["tried"]
        conns += res["leavers"]["connections"]
    if "amplification" in res:
        am = res["amplification"]
        add("amplification: attack request not refused with 400",
            sum(v for k, v in am["attack_statuses"].items() if k != "400"))
        add("amplification: neighbour request failed", am["baseline"]["failed"] + am["under_attack"]["failed"])
        tried += am["baseline"]["tried"] + am["under_attack"]["tried"] + sum(am["attack_statuses"].values())
        conns += am["non_readers"]
    if "unread" in res:
        ur = res["unread"]
        add("unread: neighbour request failed", ur["neighbours"]["failed"])
        add("unread: connection not aborted after the send timeout", ur["connections"] - ur["aborted_by_server"])
        tried += ur["neighbours"]["tried"]
        conns += ur["connections"]
    if "workers" in res:
        wk = res["workers"]
        if "error" in wk:
            add(f"workers: {wk['error']}")
        else:
            for c in wk["auth_cases"]:
                add(f"workers: auth case {c['case']!r}", c["failure"] is not None)
            nb = wk["neighbours"]
            add("workers: neighbour failures beyond the requests in flight at the kill",
                max(0, nb["failed"] - wk["in_flight_at_kill"]))
            add("workers: a request sent after the kill failed", wk["failed_after_kill_sent"])
            add("workers: /metrics not consistent with /readyz within 5 s", wk["metrics_consistent_after_s"] is None)
            add("workers: the dead worker was not replaced", wk["replaced_after_s"] is None)
            tried += nb["tried"] + len(wk["auth_cases"])
    if "bounded" in res:
        from bench.hostile.bounded import bounded_failures

        for kind, n in bounded_failures(res["bounded"]).items():
            add(f"bounded: {kind}", n)
    return {"requests_tried": tried, "connections_tried": conns, "failures_total": sum(failures.values()),
            "failures_by_kind": failures}


def position_table(ckpt: Path) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 512))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hostile.run", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="exported checkpoint folder; default: build a tiny random one")
    ap.add_argument("--server-root", default=str(REPO), help="checkout whose server to run (to compare versions)")
    ap.add_argument("--out", help="output path without suffix (default bench/results/<today>-hostile/hostile)")
    ap.add_argument("--good", type=int, default=1200)
    ap.add_argument("--bad", type=int, default=80)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--slowloris", type=int, default=300)
    ap.add_argument("--slow-body", type=int, default=50)
    ap.add_argument("--idle", type=int, default=50)
    ap.add_argument("--huge-headers", type=int, default=20)
    ap.add_argument("--stalled", type=int, default=1100)
    ap.add_argument("--legit", type=int, default=10)
    ap.add_argument("--header-timeout", type=float, default=3.0)
    ap.add_argument("--body-timeout", type=float, default=3.0)
    ap.add_argument("--hold", type=float, default=0.0, help="seconds to hold slow connections; default timeouts + 3")
    ap.add_argument("--server-nofile", type=int, default=1024, help="the server's open-file limit; 0: inherit")
    ap.add_argument("--send-timeout", type=float, default=3.0, help="the server's --send-timeout")
    ap.add_argument("--leavers", type=int, default=20, help="clients that reset a connection with pipelined requests")
    ap.add_argument("--amp-attackers", type=int, default=4)
    ap.add_argument("--amp-non-readers", type=int, default=4)
    ap.add_argument("--amp-seconds", type=float, default=6.0)
    ap.add_argument("--neighbours", type=int, default=8, help="good clients beside the attacks of phases 7-9")
    ap.add_argument("--unread", type=int, default=16, help="connections that never read their answers")
    ap.add_argument("--unread-pipelined", type=int, default=4)
    ap.add_argument("--no-workers", action="store_true", help="skip phase 9 (--workers 2, a worker killed)")
    ap.add_argument("--pair-checkpoint", default=None,
                    help="a text-pair checkpoint for phase 10's pair case; default: a tiny random MRPC one")
    ap.add_argument("--no-bounded", action="store_true", help="skip phase 10 (work and memory bounded)")
    args = ap.parse_args()

    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this client holds thousands of sockets
    tmp = Path(tempfile.mkdtemp(prefix="holoserve-hostile-"))
    if args.checkpoint:
        ckpt = Path(args.checkpoint).resolve()
    else:
        from tests.helpers.serving import make_tiny_checkpoint

        ckpt = make_tiny_checkpoint(tmp, "sst2")
    pair = json.loads((ckpt / "manifest.json").read_text()).get("task", {}).get("name") in (
        "mrpc", "qqp", "qnli", "rte", "stsb", "wnli", "mnli")
    root = Path(args.server_root).resolve()
    settings = {"HOLOSERVE_BACKEND": "onnxruntime", "HOLOSERVE_THREADS": "1", "HOLOSERVE_ACCESS_LOG": "0",
                "HOLOSERVE_HEADER_TIMEOUT_S": str(args.header_timeout),
                "HOLOSERVE_BODY_TIMEOUT_S": str(args.body_timeout),
                "HOLOSERVE_SEND_TIMEOUT_S": str(args.send_timeout)}
    hold = args.hold or max(args.header_timeout, args.body_timeout) + 3
    log = tmp / "server.log"
    res: dict = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "arch": platform.machine(),
                             "python": platform.python_version(), "load_avg_at_start": os.getloadavg()},
                 "checkpoint": ckpt.name if args.checkpoint else "tiny random BERT (sst2, 2 layers)",
                 "server_settings": {k.removeprefix("HOLOSERVE_").lower(): v for k, v in settings.items()},
                 "server_nofile": args.server_nofile,
                 "timeouts": {"header": args.header_timeout, "body": args.body_timeout},
                 "command": "python -m bench.hostile.run" + (" --checkpoint CKPT" if args.checkpoint else "")}

    # 1. a sequence length beyond the position table
    table = position_table(ckpt)
    too_long = max(1000, table + 1)
    srv = Server(root, ckpt, {**settings, "HOLOSERVE_MAX_SEQ_LENGTH": str(too_long)}, log, args.server_nofile)
    started = srv.wait_ready()
    msg = ""
    if not started:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "max-seq-length" in ln]
        msg = lines[-1].strip()[:400] if lines else ""
    res["settings"] = {"max_seq_length": too_long, "position_table": table, "refused": not started,
                       "exit_code": srv.proc.returncode, "message": msg}
    log_start = log.stat().st_size if log.exists() else 0
    if not started:
        srv = Server(root, ckpt, settings, log, args.server_nofile)
        srv.wait_ready()
    try:
        res["fuzz"] = asyncio.run(run_fuzz(srv.port, pair))
        print(f"fuzz: {res['fuzz']['tried']} cases, failures {res['fuzz']['failures']}", flush=True)
        res["mixed"] = asyncio.run(run_mixed(srv.port, args.good, args.bad, args.clients, pair))
        print(f"mixed: {res['mixed']['tried']} requests, failures {res['mixed']['failures']}", flush=True)
        res["slow"] = asyncio.run(run_slow(srv, srv.port, pair, args.slowloris, args.slow_body, args.idle,
                                           args.huge_headers, hold))
        print(f"slow: {res['slow']}", flush=True)
        res["flood"] = asyncio.run(run_flood(srv.port, pair, args.stalled, args.legit))
        print(f"flood: {res['flood']}", flush=True)
        name = model_name(srv.url)
        res["v2"] = asyncio.run(run_fuzz(srv.port, pair, v2_cases(name, pair), v2=True))
        print(f"v2: {res['v2']['tried']} cases, failures {res['v2']['failures']}", flush=True)
        res["leavers"] = asyncio.run(run_leavers(srv.port, pair, args.leavers))
        res["amplification"] = asyncio.run(run_amplification(srv, srv.port, pair, name, args.amp_attackers,
                                                             args.amp_non_readers, args.neighbours, args.amp_seconds))
        print(f"amplification: {res['amplification']}", flush=True)
        res["unread"] = asyncio.run(run_unread(srv, srv.port, pair, name, args.unread, args.unread_pipelined,
                                               args.neighbours, args.send_timeout))
        print(f"unread: {res['unread']}", flush=True)
        res["server_alive_at_end"] = srv.proc.poll() is None
        res["server_counters"] = srv.metrics()
    finally:
        srv.stop()
    res["server_log_errors"] = sum('"level": "error"' in line for line in
                                   log.read_bytes()[log_start:].decode(errors="replace").splitlines())
    if not args.no_workers:
        try:
            res["workers"] = asyncio.run(run_worker_kill(root, ckpt, settings, log, args.server_nofile, pair,
                                                         args.neighbours, tmp))
        except Exception as e:  # a failure to report, not a crash of the benchmark
            res["workers"] = {"error": f"{type(e).__name__}: {e}"}
        print(f"workers: {res['workers']}", flush=True)
    if not args.no_bounded:
        from bench.hostile.bounded import run_bounded
        from tests.helpers.serving import make_tiny_checkpoint

        pair_ckpt = Path(args.pair_checkpoint).resolve() if args.pair_checkpoint else make_tiny_checkpoint(tmp, "mrpc")
        res["bounded"] = run_bounded(root, ckpt, pair_ckpt, settings, log, args.server_nofile, args.neighbours, 6.0)
    res["summary"] = summarize(res)
    out = Path(args.out) if args.out else dated_results("hostile") / "hostile"
    atomic_write_json(out.with_suffix(".json"), res)
    write_markdown(res, out.with_suffix(".md"))
    print(json.dumps(res["summary"], indent=1))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    shutil.rmtree(tmp, ignore_errors=True)  # kept when a run fails: the server log is in it
    return 0


if __name__ == "__main__":
    sys.exit(main())
