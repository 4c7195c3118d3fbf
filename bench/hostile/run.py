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

The server runs with a low open-file limit (--server-nofile, 1024 by default: a common soft limit) and
short header/body timeouts (--header-timeout, --body-timeout) so that a run takes about a minute.
Results go to bench/results/hostile.json and .md.

    python bench/hostile/run.py                      # a tiny random checkpoint (needs the dev install)
    python bench/hostile/run.py --checkpoint runs/minilm-sst2-quick
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
sys.path.insert(0, str(REPO))

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


async def run_fuzz(port: int, pair: bool) -> dict:
    cases = []
    for name, pieces, ok, n in fuzz_cases(pair):
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
    if res.get("server_counters"):
        lines += ["", f"Connections the server closed, by reason (its metrics): {res['server_counters']}"]
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
    return {"requests_tried": tried, "connections_tried": conns, "failures_total": sum(failures.values()),
            "failures_by_kind": failures}


def position_table(ckpt: Path) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 512))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="exported checkpoint folder; default: build a tiny random one")
    ap.add_argument("--server-root", default=str(REPO), help="checkout whose server to run (to compare versions)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "hostile"), help="output path without suffix")
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
                "HOLOSERVE_BODY_TIMEOUT_S": str(args.body_timeout)}
    hold = args.hold or max(args.header_timeout, args.body_timeout) + 3
    log = tmp / "server.log"
    res: dict = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "arch": platform.machine(),
                             "python": platform.python_version(), "load_avg_at_start": os.getloadavg()},
                 "checkpoint": ckpt.name if args.checkpoint else "tiny random BERT (sst2, 2 layers)",
                 "server_settings": {k.removeprefix("HOLOSERVE_").lower(): v for k, v in settings.items()},
                 "server_nofile": args.server_nofile,
                 "timeouts": {"header": args.header_timeout, "body": args.body_timeout},
                 "command": "python bench/hostile/run.py" + (" --checkpoint CKPT" if args.checkpoint else "")}

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
        res["server_alive_at_end"] = srv.proc.poll() is None
        res["server_counters"] = srv.metrics()
    finally:
        srv.stop()
    res["summary"] = summarize(res)
    out = Path(args.out)
    atomic_write_json(out.with_suffix(".json"), res)
    write_markdown(res, out.with_suffix(".md"))
    print(json.dumps(res["summary"], indent=1))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    shutil.rmtree(tmp, ignore_errors=True)  # kept when a run fails: the server log is in it
    return 0


if __name__ == "__main__":
    sys.exit(main())
