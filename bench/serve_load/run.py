"""Serving load benchmark: latency percentiles and throughput of `holoserve serve` on loopback.

For each mode (dynamic batching off = --max-batch-size 1, on = --max-batch-size 32) the server runs
in its own process and closed-loop clients (each sends its next request as soon as the previous
answer arrives) post single SST-2 dev sentences at 1, 8, 32 and 128 concurrent connections. The
server's own overhead is the batch-1 p50 over HTTP minus the p50 of the bare backend (tokenize +
ONNX Runtime at batch 1, same sentences, same threads, no server). A final overload run with a
small queue checks that everything beyond capacity is a 503, never another error.

The client is a minimal asyncio HTTP/1.1 keep-alive client: a general-purpose client library
costs more CPU per request than the server does, and both share this machine's cores.
Bounded: every level stops after --duration seconds or --max-requests answers, whichever is first.

    python -m bench.serve_load.run --checkpoint runs/minilm-sst2-quick --data-dir "$GLUE_DIR"

`--token-budgets 256,512` runs the token-budget comparison instead: count-based batching (batch 32)
against the same server closing batches on padded tokens (--max-batch-tokens B), at --clients
(default 32) with the SST-2 dev sentences' own mixed lengths, modes alternating round by round;
it writes NAME_tokens.{json,md}.

    python -m bench.serve_load.run --data-dir "$GLUE_DIR" --token-budgets 256,512 --clients 32 --duration 16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

from bench import dated_results  # noqa: E402
from holoserve import HoloServeError  # noqa: E402
from holoserve.core.artifact import load_artifact, read_manifest  # noqa: E402

from holoserve.core.files import atomic_savefig, atomic_write_json, atomic_write_text
from holoserve.core.machine import cpu_name  # noqa: E402

FALLBACK = [
    "it 's a charming and often affecting journey .", "unflinchingly bleak and desperate",
    "allows us to hope that nolan is poised to embark a major career as a commercial yet inventive filmmaker .",
    "the acting , costumes , music , cinematography and sound are all astounding given the production 's austere locales .",
    "it 's slow -- very , very slow .", "although laced with humor and a few fanciful touches , the film is a refreshingly serious look at young women .",
    "a sometimes tedious film .", "or doing last year 's taxes with your ex-wife .",
]


def sst2_sentences(data_dir: str | None, limit: int = 872) -> tuple[list[str], str]:
    if data_dir:
        from holoserve.data.glue import read_split

        texts = [ex.text for ex in read_split("sst2", "dev", data_dir, limit=limit)]
        return texts, f"SST-2 dev ({len(texts)} sentences)"
    return FALLBACK, "built-in SST-2-like sentences (no data dir)"


def load_texts(kind: str, data_dir: str | None) -> tuple[list, str]:
    """The texts a load sends: `short` SST-2 dev sentences; `long` three consecutive dev sentences joined (about
    64 to 128 tokens, where truncation to the model's length bites); `pairs` MRPC dev sentence pairs."""
    if kind == "short":
        return sst2_sentences(data_dir)
    if kind == "long":
        texts, source = sst2_sentences(data_dir)
        return [" ".join(texts[i:i + 3]) for i in range(0, len(texts) - 2, 3)], f"three joined sentences of {source}"
    if kind == "pairs":
        if not data_dir:
            raise SystemExit("--texts pairs needs --data-dir (the GLUE folder with MRPC/dev.tsv)")
        from holoserve.data.glue import read_split

        rows = read_split("mrpc", "dev", data_dir)
        return [(ex.text, ex.text_pair) for ex in rows], f"MRPC dev ({len(rows)} pairs)"
    raise SystemExit(f"unknown --texts {kind!r}: choose short, long or pairs")


def request_body(item) -> bytes:
    """The /predict body for one text or one (text, text) pair."""
    return json.dumps({"pairs": [list(item)]} if isinstance(item, tuple) else {"text": item}).encode()


# --------------------------------------------------------------------------- client


class Conn:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def open(self):
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def post(self, path: str, body: bytes | None) -> tuple[int, bytes]:
        """POST `body` to `path` (GET when body is None); returns (status, response body)."""
        if self.writer is None:
            await self.open()
        if body is None:
            self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        else:
            head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            self.writer.write(head + body)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("server closed the connection")
        status = int(status_line.split()[1])
        length, close = 0, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "connection" and v.strip().lower() == "close":
                close = True
        data = await self.reader.readexactly(length) if length else b""
        if close:
            self.close()
        return status, data

    def close(self):
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def run_load(port: int, texts: list[str], clients: int, duration: float, max_requests: int) -> dict:
    """Closed-loop clients for `duration` s (or `max_requests` answers); raw latencies and statuses."""
    bodies = [request_body(t) for t in texts]
    lat: list[float] = []
    statuses: dict[int, int] = {}
    server_ms: list[dict] = []
    errors: list[str] = []
    stop_at = time.perf_counter() + duration
    issued = 0

    async def client(i: int):
        nonlocal issued
        conn = Conn("127.0.0.1", port)
        k = i
        while time.perf_counter() < stop_at and issued < max_requests:
            issued += 1
            body = bodies[k % len(bodies)]
            k += clients
            t0 = time.perf_counter()
            try:
                status, data = await conn.post("/predict", body)
            except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
                errors.append(f"{type(e).__name__}: {e}")
                conn.close()
                await asyncio.sleep(0.01)
                continue
            dt = time.perf_counter() - t0
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200:
                lat.append(dt * 1000)
                if len(server_ms) < 20000:
                    server_ms.append(json.loads(data)["timing_ms"])
            elif status == 503:
                await asyncio.sleep(0.005)  # a polite client backs off a little
        conn.close()

    t_start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return {"lat": lat, "statuses": statuses, "server": server_ms, "errors": errors,
            "wall": time.perf_counter() - t_start}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def alternate_rounds(ports: dict[str, int], texts: list[str], clients: int, args,
                     pids: dict[str, int] | None = None) -> dict[str, dict]:
    """One client level on several servers taking turns round by round (args.rounds rounds of
    args.duration / rounds seconds each), so drifting machine load hits them alike; per server the
    level's summary with the mean executed batch size read from its metrics and, with `pids` (the servers'
    processes), the server's CPU time per answered request."""
    parts: dict[str, list[dict]] = {n: [] for n in ports}
    seqs = {n: [0.0, 0.0] for n in ports}
    cpu = {n: 0.0 for n in ports}
    for _ in range(args.rounds):
        for name, port in ports.items():
            before = scrape_batch_sizes(port)
            c0 = cpu_seconds(pids[name]) if pids else 0.0
            parts[name].append(asyncio.run(run_load(port, texts, clients, args.duration / args.rounds,
                                                    args.max_requests // args.rounds)))
            if pids:
                cpu[name] += cpu_seconds(pids[name]) - c0
            after = scrape_batch_sizes(port)
            for k, key in enumerate(("sequences", "executions")):
                seqs[name][k] += after.get(key, 0) - before.get(key, 0)
    out = {}
    for name in ports:
        lv = summarize(clients, parts[name])
        lv["mean_batch"] = round(seqs[name][0] / seqs[name][1], 2) if seqs[name][1] else 0
        if pids:
            lv["server_cpu_ms_per_request"] = round(1000 * cpu[name] / lv["ok"], 3) if lv["ok"] else None
        out[name] = lv
    return out


def summarize(clients: int, parts: list[dict]) -> dict:
    """One level's numbers from its (interleaved) rounds."""
    lat = np.asarray([x for p in parts for x in p["lat"]])
    statuses: dict[int, int] = {}
    for p in parts:
        for k, v in p["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    errors = [e for p in parts for e in p["errors"]]
    server = [x for p in parts for x in p["server"]]
    wall = sum(p["wall"] for p in parts)
    out = {
        "clients": clients,
        "rounds": len(parts),
        "requests": int(sum(statuses.values())),
        "ok": int(statuses.get(200, 0)),
        "status_counts": {str(k): v for k, v in sorted(statuses.items())},
        "transport_errors": len(errors),
        "transport_error_examples": errors[:3],
        "wall_s": round(wall, 3),
        "throughput_rps": round(statuses.get(200, 0) / wall, 2) if wall else 0.0,
    }
    if len(lat):
        out.update({f"p{q}_ms": round(float(np.percentile(lat, q)), 3) for q in (50, 95, 99)})
        out["mean_ms"] = round(float(lat.mean()), 3)
        for key in ("tokenize", "queue", "inference", "total"):
            out[f"server_{key}_p50_ms"] = round(statistics.median(x[key] for x in server), 3)
    return out


async def sequential(port: int, texts: list[str], start: int, n: int) -> list[float]:
    """`n` requests one after another from one client: latencies in ms."""
    conn = Conn("127.0.0.1", port)
    out = []
    for i in range(start, start + n):
        body = json.dumps({"text": texts[i % len(texts)]}).encode()
        t0 = time.perf_counter()
        status, _ = await conn.post("/predict", body)
        out.append((time.perf_counter() - t0) * 1000)
        assert status == 200, status
    conn.close()
    return out


# --------------------------------------------------------------------------- server process


async def http_floor(port: int, n: int) -> dict:
    """p50 of GET /healthz from one client: the HTTP stack + client + loopback with no model work."""
    conn = Conn("127.0.0.1", port)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        status, _ = await conn.post("/healthz", None)
        ts.append((time.perf_counter() - t0) * 1000)
        assert status == 200
    conn.close()
    return {"n": n, "p50_ms": round(float(np.median(ts)), 3), "p95_ms": round(float(np.percentile(ts, 95)), 3)}


def asgi_overhead(log: Path, offset: int) -> dict:
    """From the server's JSON access log: time inside the ASGI app per /predict minus its inference time."""
    with open(log, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", "replace").splitlines()
    over, dur, infer = [], [], []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("path") == "/predict" and rec.get("status") == 200 and "timing_ms" in rec:
            dur.append(rec["duration_ms"])
            over.append(rec["duration_ms"] - rec["timing_ms"]["inference"])
            infer.append(rec["timing_ms"]["inference"])
    if not over:
        return {"n": 0, "inference_ms": []}
    return {"n": len(over), "app_p50_ms": round(float(np.median(dur)), 3),
            "app_minus_inference_p50_ms": round(float(np.median(over)), 3),
            "inference_p50_ms": round(float(np.median(infer)), 3), "inference_ms": infer}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, port: int, threads: int, extra: list[str], log: Path,
                 backend: str = "onnxruntime", ready_s: float = 120.0, root: Path = REPO) -> subprocess.Popen:
    """`holoserve serve` from the checkout `root` in its own process; returns once /readyz answers 200 (load and
    warm-up done), or raises after `ready_s` seconds (a GPU backend that times or compiles kernels at start-up
    needs more)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOLOSERVE_")}
    env.update(OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "holoserve", "serve", str(ckpt), "--backend", backend, "--host", "127.0.0.1",
           "--port", str(port), "--threads", str(threads), *extra]
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=open(log, "ab"))
    import urllib.request

    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return proc
        except Exception:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"server did not become ready in {ready_s:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def scrape_batch_sizes(port: int) -> dict:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    vals = {}
    for line in text.splitlines():
        if line.startswith("holoserve_inference_batch_size_sum"):
            vals["sequences"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("holoserve_inference_batch_size_count"):
            vals["executions"] = float(line.rsplit(" ", 1)[1])
    return vals


# --------------------------------------------------------------------------- bare backend


class Bare:
    """The backend without the server: tokenize + the backend at batch 1, in this process."""

    def __init__(self, ckpt: Path, threads: int, backend: str = "onnxruntime"):
        from holoserve.backends import load_backend
        from holoserve.core.tokenizer import TextEncoder

        art = load_artifact(ckpt)
        self.be = load_backend(backend, art, threads=threads, max_batch=32)
        self.enc = TextEncoder(ckpt / "tokenizer.json", art.max_seq_length)

    def chunk(self, texts: list[str], start: int, n: int) -> tuple[list[float], list[float]]:
        from holoserve.core.tokenizer import pad_batch

        total, infer = [], []
        for i in range(start, start + n):
            t0 = time.perf_counter()
            batch = pad_batch(self.enc.encode([texts[i % len(texts)]]))
            t1 = time.perf_counter()
            self.be.infer(*batch)
            t2 = time.perf_counter()
            total.append((t2 - t0) * 1000)
            infer.append((t2 - t1) * 1000)
        return total, infer

    def scaling(self, texts: list[str], seconds: float = 3.0) -> dict:
        """The ceiling for dynamic batching: the backend's own throughput at batch 1 vs 32 (consecutive
        dev sentences, so lengths are mixed as in a merged batch), padded to the longest or length-grouped."""
        from holoserve.server.batcher import split_by_length
        from holoserve.core.tokenizer import pad_batch

        encs = self.enc.encode(texts)
        out = {}
        for label, bs, waste in (("batch1", 1, -1.0), ("batch32_pad_longest", 32, -1.0),
                                 ("batch32_grouped", 32, 0.25)):
            done, t0, i = 0, time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                b = encs[i:i + bs] or encs[:bs]
                i = (i + bs) % len(encs)
                for g in split_by_length([e.length for e in b], waste):
                    self.be.infer(*pad_batch([b[j] for j in g]))
                done += len(b)
            out[label] = round(done / (time.perf_counter() - t0), 1)
        return out


# --------------------------------------------------------------------------- report


def backend_desc(name: str) -> str:
    if name == "onnxruntime":
        return "ONNX Runtime CPU"
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "no torch"
    return {"torch-cuda": "PyTorch CUDA 2:4 INT8", "tensorrt": "TensorRT", "torch": "PyTorch"}[name] + f" ({gpu})"


def machine() -> dict:
    cpu = cpu_name()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "arch": platform.machine(), "python": platform.python_version(),
            "uptime_at_start": uptime, "load_avg_at_start": os.getloadavg()}


def _gpu_of(desc: str) -> str | None:
    """The GPU named in a backend description such as "PyTorch CUDA 2:4 INT8 (NVIDIA H100 80GB HBM3)"."""
    inner = desc[desc.rfind("(") + 1:-1] if desc.endswith(")") else ""
    return inner if inner and inner not in ("no GPU", "no torch") else None


def write_markdown(res: dict, path: Path) -> None:
    m = res["machine"]
    lines = [
        f"# Serving load: {res['checkpoint']['name']} on "
        + (f"{gpu} + " if (gpu := _gpu_of(res.get("backend_desc", ""))) else "") + f"{m['cores']}-core {m['arch']} CPU",
        "",
        f"{res['date']} · {m['cpu']} · {res.get('backend_desc', 'ONNX Runtime CPU')}, {res['threads']} intra-op thread(s) · "
        f"{res['texts']} · one text per request, closed-loop clients on loopback, "
        f"{res['duration_s']} s (max {res['max_requests']} requests) per level and mode, in "
        f"{res['rounds']} rounds that alternate batching off and on.",
        f"The cores are shared with other work: load average at start {m['load_avg_at_start'][0]:.2f} "
        f"(`{m['uptime_at_start']}`), so absolute numbers are noisy; ratios were measured in one run.",
        "",
        "| batching | clients | req/s | p50 ms | p95 ms | p99 ms | mean batch | non-200 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for mode in ("off", "on"):
        for lv in res["modes"][mode]["levels"]:
            non200 = {k: v for k, v in lv["status_counts"].items() if k != "200"}
            lines.append(f"| {mode} | {lv['clients']} | {lv['throughput_rps']:.1f} | {lv.get('p50_ms', float('nan')):.2f} | "
                         f"{lv.get('p95_ms', float('nan')):.2f} | {lv.get('p99_ms', float('nan')):.2f} | "
                         f"{lv.get('mean_batch', 1):.1f} | {non200 or '-'}"
                         + (f", {lv['transport_errors']} transport errors" if lv['transport_errors'] else "") + " |")
    s = res["summary"]
    b = res["bare_backend"]
    lines += [
        "",
        f"- Bare backend at batch 1 (tokenize + {res.get('backend_desc', 'ONNX Runtime')}, no server, back to back): "
        f"p50 {b['p50_ms']:.2f} ms "
        f"(inference alone {b['infer_p50_ms']:.2f} ms). Its own throughput: "
        f"{b['throughput_seq_per_s']['batch1']:.0f} seq/s at batch 1, "
        f"{b['throughput_seq_per_s']['batch32_pad_longest']:.0f} at batch 32 padded to the longest, "
        f"{b['throughput_seq_per_s']['batch32_grouped']:.0f} at batch 32 in length groups (what the server does): "
        f"the most batching can buy on this CPU is about "
        f"{b['throughput_seq_per_s']['batch32_grouped'] / b['throughput_seq_per_s']['batch1']:.2f}x.",
        f"- Overhead at batch 1, batching off, 1 client, {res['batch1_http']['n']} requests alternating in chunks with "
        f"the bare backend: HTTP p50 {res['batch1_http']['p50_ms']:.2f} ms. End to end (HTTP p50 minus the bare p50; "
        f"includes the client, loopback TCP and the process/thread wake-ups of a shared CPU): "
        f"**{s['overhead_p50_ms']:.2f} ms** (≤ 1 ms: {'met' if s['overhead_target_met'] else 'NOT met'}). "
        f"Per request, HTTP time minus the model time the server measured for that same request (everything but "
        f"the model call, client and TCP included; unlike the line before, not inflated by the model running "
        f"slower after the CPU idled between requests than back to back): "
        f"**{s['overhead_vs_own_inference_p50_ms']:.2f} ms** "
        f"(≤ 1 ms: {'met' if s['overhead_vs_own_inference_p50_ms'] <= 1.0 else 'NOT met'}). "
        f"Inside the server (ASGI app time from the access log minus the request's inference time, p50; "
        f"body read, routing, validation, tokenization, queueing, softmax, JSON, logging, metrics; a lone request runs on the event loop, see --inline-single): "
        f"**{s['in_server_overhead_p50_ms']:.2f} ms** (≤ 1 ms: {'met' if s['in_server_overhead_target_met'] else 'NOT met'}). "
        f"For scale, a GET /healthz round trip through the same client and HTTP stack takes "
        f"{res['http_floor']['p50_ms']:.2f} ms at p50.",
        f"- Throughput at 32 clients, batching on vs off: **{s['speedup_32']:.2f}x** "
        f"(target ≥ 2x: {'met' if s['speedup_target_met'] else 'NOT met'}).",
        f"- Overload ({res['overload']['clients']} clients, queue of {res['overload']['max_queue_size']} sequences): "
        f"{res['overload']['status_counts']}, {res['overload']['transport_errors']} transport errors "
        f"(target: only 200 and 503: {'met' if s['overload_only_503'] else 'NOT met'}).",
        f"- Errors other than 503 across all levels: {s['non_503_errors']}.",
    ]
    atomic_write_text(path, "\n".join(lines) + "\n")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, color in (("off", "tab:gray"), ("on", "tab:blue")):
        lv = res["modes"][mode]["levels"]
        x = [v["clients"] for v in lv]
        ax1.plot(x, [v["throughput_rps"] for v in lv], "o-", color=color, label=f"batching {mode}")
        for q, style in (("p50_ms", "-"), ("p99_ms", "--")):
            ax2.plot(x, [v.get(q, np.nan) for v in lv], style, marker="o", color=color, label=f"{q[:3]} batching {mode}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("requests / s")
    ax2.set_ylabel("latency (ms)")
    ax2.set_yscale("log")
    m = res["machine"]
    fig.suptitle(f"holoserve serve, {res['checkpoint']['name']}, ONNX Runtime on {m['cores']}-core {m['arch']} CPU "
                 f"({res['date']})", fontsize=10)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)


def token_lengths(ckpt: Path, texts: list[str]) -> dict:
    from holoserve.core.tokenizer import TextEncoder

    art = load_artifact(ckpt)
    lens = np.asarray([e.length for e in TextEncoder(ckpt / "tokenizer.json", art.max_seq_length).encode(texts)])
    return {"n": int(len(lens)), "min": int(lens.min()), "p50": float(np.median(lens)), "mean": round(float(lens.mean()), 1),
            "p90": float(np.percentile(lens, 90)), "max": int(lens.max()), "max_seq_length": art.max_seq_length}


def token_budget_main(args, ckpt: Path, texts: list[str], text_source: str, out_dir: Path) -> int:
    """Count-based batching against token-budget batching, same server otherwise, modes alternating."""
    budgets = [int(x) for x in args.token_budgets.split(",")]
    levels = [int(x) for x in args.clients.split(",")] if args.clients != "1,8,32,128" else [32]
    base = ["--max-batch-size", str(args.batch_size), "--max-queue-delay-ms", str(args.queue_delay_ms),
            "--max-padding-waste", str(args.max_padding_waste), "--max-queue-size", "512"]
    modes = {"count": base, **{f"tokens_{b}": [*base, "--max-batch-tokens", str(b)] for b in budgets}}
    res: dict = {"benchmark": "serve_load_tokens", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine(), "checkpoint": {"name": ckpt.name, "max_seq_length": load_artifact(ckpt).max_seq_length},
                 "texts": text_source, "lengths": token_lengths(ckpt, texts), "threads": args.threads,
                 "duration_s": args.duration, "rounds": args.rounds, "max_requests": args.max_requests,
                 "client": "asyncio HTTP/1.1 keep-alive, one process, closed loop, one text per request",
                 "modes": {m: {"server_args": a, "levels": []} for m, a in modes.items()}}
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for mode, extra in modes.items():
            port = free_port()
            log = out_dir / f"{args.name}_tokens.{mode}.log.tmp"
            servers[mode] = (start_server(ckpt, port, args.threads, [*extra, "--no-access-log"], log, args.backend), port)
            asyncio.run(run_load(port, texts, 8, 1.0, 200))  # warm-up, not recorded
        for c in levels:
            levels_now = alternate_rounds({m: servers[m][1] for m in modes}, texts, c, args)
            for mode in modes:
                lv = levels_now[mode]
                res["modes"][mode]["levels"].append(lv)
                print(f"{mode:12s} clients {c:4d}: {lv['throughput_rps']:8.1f} req/s  p50 {lv.get('p50_ms')} "
                      f"p99 {lv.get('p99_ms')} ms  mean batch {lv['mean_batch']}  {lv['status_counts']}", flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
        for mode in modes:
            (out_dir / f"{args.name}_tokens.{mode}.log.tmp").unlink(missing_ok=True)
    res["machine"]["uptime_at_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    atomic_write_json(out_dir / f"{args.name}_tokens.json", res)
    m = res["machine"]
    L = res["lengths"]
    lines = [f"# Token-budget batching: {ckpt.name} on a {m['cores']}-core {m['arch'].replace('_', '-')} CPU", "",
             f"{res['date']} · {m['cpu']} · ONNX Runtime CPU, {res['threads']} intra-op thread(s) · {res['texts']}, "
             f"tokens per text: min {L['min']}, median {L['p50']:.0f}, mean {L['mean']}, p90 {L['p90']:.0f}, "
             f"max {L['max']} (truncated at {L['max_seq_length']}) · one text per request, closed-loop clients on "
             f"loopback, {res['duration_s']} s per mode and level in {res['rounds']} alternating rounds. "
             f"Every mode: --max-batch-size {args.batch_size}, --max-queue-delay-ms {args.queue_delay_ms}, "
             f"--max-padding-waste {args.max_padding_waste} "
             + ("(the default: a batch is run in length groups)." if args.max_padding_waste >= 0 else
                "(no length groups: every batch is padded to its longest)."),
             f"The cores are shared with other work (load average at start {m['load_avg_at_start'][0]:.2f}, "
             f"`{m['uptime_at_end']}` at the end): absolute numbers are noisy; the modes ran interleaved.", "",
             "| batching | clients | req/s | p50 ms | p95 ms | p99 ms | mean batch | non-200 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for mode in modes:
        label = "count (32)" if mode == "count" else f"--max-batch-tokens {mode.split('_')[1]}"
        for lv in res["modes"][mode]["levels"]:
            non200 = {k: v for k, v in lv["status_counts"].items() if k != "200"}
            lines.append(f"| {label} | {lv['clients']} | {lv['throughput_rps']:.1f} | {lv.get('p50_ms', float('nan')):.2f} | "
                         f"{lv.get('p95_ms', float('nan')):.2f} | {lv.get('p99_ms', float('nan')):.2f} | "
                         f"{lv['mean_batch']:.1f} | {non200 or '-'} |")
    atomic_write_text(out_dir / f"{args.name}_tokens.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _docker(*args: str, timeout: float = 120) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])} failed: {r.stderr.strip()[-500:]}")
    return r.stdout.strip()


def start_container(image: str, ckpt: Path, env: dict[str, str]) -> tuple[str, int, dict]:
    """`docker run -d` of `image` as a user runs it (checkpoint read-only at /model, port on loopback):
    (container id, host port, its /v1/models backend entry) once ready."""
    import urllib.request

    args = ["run", "-d", "-p", "127.0.0.1::8000", "-v", f"{ckpt.resolve()}:/model:ro"]
    for k, v in env.items():
        args += ["-e", f"{k}={v}"]
    cid = _docker(*args, image)
    port = int(_docker("port", cid, "8000/tcp").splitlines()[0].rsplit(":", 1)[1])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as m:
                        return cid, port, json.loads(m.read())["models"][0]["backend"]
        except Exception:
            if _docker("inspect", "-f", "{{.State.Running}}", cid) != "true":
                raise RuntimeError(f"the container exited: {_docker('logs', cid)[-2000:]}")
            time.sleep(0.5)
    raise TimeoutError("the container did not become ready in 300 s")


def docker_main(args, ckpt: Path, texts: list[str], text_source: str, out_dir: Path) -> int:
    """The image as `docker run` serves it (no backend flags) against the same image with
    HOLOSERVE_BACKEND=onnxruntime: p50 latency at 1 client and throughput at 32, the two containers
    taking turns round by round on the same texts."""
    levels = [int(x) for x in args.clients.split(",")]
    variants = {"default": {}, "onnxruntime": {"HOLOSERVE_BACKEND": "onnxruntime"}}
    size = int(_docker("image", "inspect", "-f", "{{.Size}}", args.docker))
    res: dict = {"benchmark": "serve_load_docker", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine(), "image": args.docker, "image_mb": round(size / 1e6),
                 "checkpoint": ckpt.name, "texts": text_source, "duration_s": args.duration, "rounds": args.rounds,
                 "client": "asyncio HTTP/1.1 keep-alive, one process, closed loop", "variants": {}}
    running: dict[str, tuple[str, int]] = {}
    try:
        for name, env in variants.items():
            cid, port, backend = start_container(args.docker, ckpt, env)
            running[name] = (cid, port)
            res["variants"][name] = {"env": env, "backend": backend.get("backend"),
                                     "selection": backend.get("selection"),
                                     "kernels": (backend.get("kernels") or {}).get("status"), "levels": []}
            print(f"{name}: {backend.get('backend')} ({backend.get('selection')})", flush=True)
            asyncio.run(run_load(port, texts, 8, 2.0, 400))  # warm-up, not recorded
        for c in levels:
            parts: dict[str, list[dict]] = {n: [] for n in variants}
            for _ in range(args.rounds):
                for name in variants:
                    parts[name].append(asyncio.run(run_load(running[name][1], texts, c, args.duration / args.rounds,
                                                            args.max_requests // args.rounds)))
            for name in variants:
                lv = summarize(c, parts[name])
                res["variants"][name]["levels"].append(lv)
                print(f"{name:11s} clients {c:3d}: {lv['throughput_rps']:8.1f} req/s  p50 {lv.get('p50_ms')} ms  "
                      f"{lv['status_counts']}", flush=True)
    finally:
        for cid, _ in running.values():
            subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=60)
    by = {n: {lv["clients"]: lv for lv in v["levels"]} for n, v in res["variants"].items()}
    res["summary"] = {}
    if 32 in levels:
        res["summary"]["throughput_ratio_32"] = round(by["default"][32]["throughput_rps"]
                                                      / by["onnxruntime"][32]["throughput_rps"], 3)
    if 1 in levels:
        res["summary"]["p50_ratio_1"] = round(by["default"][1]["p50_ms"] / by["onnxruntime"][1]["p50_ms"], 3)
    res["machine"]["uptime_at_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    name = f"{args.name}_docker"
    atomic_write_json(out_dir / f"{name}.json", res)
    lines = [f"# `docker run` defaults vs ONNX Runtime, same image ({res['date']})", "",
             f"Machine: {res['machine'].get('cpu', '')}; image `{args.docker}`, {res['image_mb']} MB; checkpoint "
             f"{ckpt.name}; {text_source}; {args.rounds} alternating rounds, {args.duration} s per level and variant.",
             "", "| variant | backend | clients | req/s | p50 ms | p99 ms | statuses |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, v in res["variants"].items():
        for lv in v["levels"]:
            lines.append(f"| {n} | {v['backend']} | {lv['clients']} | {lv['throughput_rps']} | {lv.get('p50_ms')} | "
                         f"{lv.get('p99_ms')} | {lv['status_counts']} |")
    lines += ["", f"Load average at the start and end: {res['machine']['uptime_at_start'].split('load average: ')[-1]}; "
              f"{res['machine']['uptime_at_end'].split('load average: ')[-1]}.",
              "", f"Default's selection: {res['variants']['default']['selection']}", "",
              f"Summary: {json.dumps(res['summary'])}", ""]
    atomic_write_text(out_dir / f"{name}.md", "\n".join(lines))
    print(json.dumps(res["summary"], indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_load.run", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None,
                    help="default: runs/minilm-sst2-quick if present, else runs/minilm-sst2-standin")
    ap.add_argument("--data-dir", default=os.environ.get("HOLOSERVE_DATA_DIR"))
    ap.add_argument("--clients", default="1,8,32,128")
    ap.add_argument("--texts", default="short", choices=("short", "long", "pairs"),
                    help="short: SST-2 dev sentences; long: three of them joined (64 to 128 tokens); pairs: MRPC dev")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds per level and mode, split over --rounds")
    ap.add_argument("--rounds", type=int, default=4, help="alternating off/on rounds per level")
    ap.add_argument("--max-requests", type=int, default=20000, help="answers per level, at most")
    ap.add_argument("--threads", type=int, default=1, help="backend intra-op threads (CPU backends)")
    ap.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "torch-cuda", "tensorrt", "torch"),
                    help="the server's backend (torch-cuda on a GPU machine; onnxruntime needs an export)")
    ap.add_argument("--batch-size", type=int, default=32, help="--max-batch-size with batching on")
    ap.add_argument("--queue-delay-ms", type=float, default=0.0, help="--max-queue-delay-ms with batching on")
    ap.add_argument("--bare-n", type=int, default=1000)
    ap.add_argument("--out", help="output folder (default bench/results/<today>-<name>)")
    ap.add_argument("--name", default="serve_load")
    ap.add_argument("--docker", metavar="IMAGE", default=None,
                    help="compare two containers of IMAGE instead: its defaults (no backend flags) and "
                         "HOLOSERVE_BACKEND=onnxruntime, at --clients (e.g. 1,32); writes NAME_docker.{json,md}")
    ap.add_argument("--token-budgets", default=None,
                    help="comma-separated --max-batch-tokens values: compare them with count-based batching "
                         "(clients default to 32) instead of the full benchmark")
    ap.add_argument("--max-padding-waste", type=float, default=0.25,
                    help="the servers' --max-padding-waste in the token-budget comparison (-1: pad to the longest)")
    args = ap.parse_args(argv)

    def exported(p: Path) -> bool:
        try:
            return args.backend != "onnxruntime" or read_manifest(p).exports.onnxruntime is not None
        except HoloServeError:
            return False

    ckpt = Path(args.checkpoint) if args.checkpoint else next(
        (p for p in (REPO / "runs" / "minilm-sst2-quick", REPO / "runs" / "minilm-sst2-standin") if exported(p)), None)
    if ckpt is None or not exported(ckpt):
        sys.exit("no checkpoint with an ONNX Runtime export: pass --checkpoint DIR (after `holoserve export DIR`) "
                 "or build a stand-in with python -m bench.serve_load.standin")
    art = load_artifact(ckpt)
    texts, text_source = load_texts(args.texts, args.data_dir)
    levels = [int(x) for x in args.clients.split(",")]
    out_dir = Path(args.out) if args.out else dated_results(args.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.token_budgets:
        return token_budget_main(args, ckpt, texts, text_source, out_dir)
    if args.docker:
        return docker_main(args, ckpt, texts, text_source, out_dir)
    res: dict = {
        "benchmark": "serve_load",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "checkpoint": {"name": ckpt.name, "base_model": art.base_model,
                       "task": art.task_name, "max_seq_length": art.max_seq_length,
                       "training": art.manifest.training.get("method"),
                       "export": art.manifest.exports.onnxruntime.file if art.manifest.exports.onnxruntime else None},
        "texts": text_source, "threads": args.threads, "duration_s": args.duration, "rounds": args.rounds, "max_requests": args.max_requests,
        "client": "asyncio HTTP/1.1 keep-alive, one process, closed loop",
        "modes": {},
    }
    modes = {"off": ["--max-batch-size", "1", "--max-queue-delay-ms", "0"],
             "on": ["--max-batch-size", str(args.batch_size), "--max-queue-delay-ms", str(args.queue_delay_ms)]}
    servers: dict[str, tuple[subprocess.Popen, int, Path]] = {}
    try:
        # Both servers stay up (an idle server costs nothing) and the modes take turns at every level,
        # so drifting background load on the shared cores hits both alike.
        for mode, extra in modes.items():
            port = free_port()
            log = out_dir / f"{args.name}.{mode}.log.tmp"
            log.unlink(missing_ok=True)
            extra = [*extra, "--max-queue-size", "512"]
            servers[mode] = (start_server(ckpt, port, args.threads, extra, log, args.backend), port, log)
            res["modes"][mode] = {"server_args": extra, "levels": []}
            asyncio.run(run_load(port, texts, 8, 1.0, 200))  # warm-up, not recorded
        port_off, log_off = servers["off"][1], servers["off"][2]
        res["http_floor"] = asyncio.run(http_floor(port_off, 500))
        print("GET /healthz floor:", res["http_floor"], flush=True)

        # Overhead at batch 1: bare backend and server (batching off, 1 client) in alternating chunks.
        bare = Bare(ckpt, args.threads, args.backend)
        res["backend"] = bare.be.info()
        res["backend_desc"] = backend_desc(args.backend)
        bare.chunk(texts, 0, 20)
        mark = log_off.stat().st_size
        chunks = 10
        per = max(1, args.bare_n // chunks)
        b_tot, b_inf, srv = [], [], []
        for r in range(chunks):
            t, i = bare.chunk(texts, r * per, per)
            b_tot += t
            b_inf += i
            srv += asyncio.run(sequential(port_off, texts, r * per, per))
        res["bare_backend"] = {"n": len(b_tot), "p50_ms": round(float(np.median(b_tot)), 3),
                               "infer_p50_ms": round(float(np.median(b_inf)), 3),
                               "p95_ms": round(float(np.percentile(b_tot, 95)), 3),
                               "throughput_seq_per_s": bare.scaling(texts)}
        asgi = asgi_overhead(log_off, mark)
        own = asgi.pop("inference_ms")
        res["batch1_http"] = {"n": len(srv), "p50_ms": round(float(np.median(srv)), 3),
                              "p95_ms": round(float(np.percentile(srv, 95)), 3), "asgi": asgi}
        if len(own) == len(srv):  # the same requests in the same order: per-request HTTP time minus model time
            res["batch1_http"]["minus_own_inference_p50_ms"] = round(float(np.median(np.subtract(srv, own))), 3)
        print("bare:", res["bare_backend"], "\nhttp batch 1:", res["batch1_http"], flush=True)

        rounds = args.rounds
        for c in levels:
            parts: dict[str, list[dict]] = {m: [] for m in modes}
            mb: dict[str, list[float]] = {m: [0.0, 0.0] for m in modes}
            for _ in range(rounds):
                for mode in modes:
                    port = servers[mode][1]
                    before = scrape_batch_sizes(port)
                    parts[mode].append(asyncio.run(run_load(port, texts, c, args.duration / rounds,
                                                            args.max_requests // rounds)))
                    after = scrape_batch_sizes(port)
                    mb[mode][0] += after.get("sequences", 0) - before.get("sequences", 0)
                    mb[mode][1] += after.get("executions", 0) - before.get("executions", 0)
            for mode in modes:
                lv = summarize(c, parts[mode])
                lv["mean_batch"] = round(mb[mode][0] / mb[mode][1], 2) if mb[mode][1] else 0
                lv["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
                res["modes"][mode]["levels"].append(lv)
                print(f"batching {mode:3s} clients {c:4d}: {lv['throughput_rps']:8.1f} req/s  p50 {lv.get('p50_ms')} "
                      f"p99 {lv.get('p99_ms')} ms  mean batch {lv['mean_batch']}  {lv['status_counts']}", flush=True)
    finally:
        for proc, _, _ in servers.values():
            stop_server(proc)

    # Overload: a small queue and many clients; everything beyond capacity must be a 503.
    port = free_port()
    log = out_dir / f"{args.name}.overload.log.tmp"
    ov_extra = ["--max-batch-size", str(args.batch_size), "--max-queue-delay-ms", str(args.queue_delay_ms),
                "--max-queue-size", "16", "--max-items", "16"]
    proc = start_server(ckpt, port, args.threads, ov_extra, log, args.backend)
    try:
        ov = summarize(128, [asyncio.run(run_load(port, texts, 128, min(args.duration, 5.0), args.max_requests))])
    finally:
        stop_server(proc)
    ov.update({"max_queue_size": 16, "server_args": ov_extra})
    res["overload"] = ov
    print("overload:", ov["status_counts"], "transport errors", ov["transport_errors"], flush=True)
    for m in (*modes, "overload"):
        (out_dir / f"{args.name}.{m}.log.tmp").unlink(missing_ok=True)

    b1 = res["batch1_http"]
    by_c = {m: {lv["clients"]: lv for lv in res["modes"][m]["levels"]} for m in modes}
    non503 = sum(v for lv in [*res["modes"]["off"]["levels"], *res["modes"]["on"]["levels"], ov]
                 for k, v in lv["status_counts"].items() if k not in ("200", "503"))
    non503 += sum(lv["transport_errors"] for lv in [*res["modes"]["off"]["levels"], *res["modes"]["on"]["levels"], ov])
    overhead = b1["p50_ms"] - res["bare_backend"]["p50_ms"]
    sp = (by_c["on"][32]["throughput_rps"] / by_c["off"][32]["throughput_rps"]) if 32 in by_c["on"] else float("nan")
    res["summary"] = {
        "overhead_p50_ms": round(overhead, 3),
        "overhead_target_met": overhead <= 1.0,
        "overhead_vs_own_inference_p50_ms": b1.get("minus_own_inference_p50_ms", float("nan")),
        "in_server_overhead_p50_ms": b1["asgi"].get("app_minus_inference_p50_ms", float("nan")),
        "in_server_overhead_target_met": b1["asgi"].get("app_minus_inference_p50_ms", 99) <= 1.0,
        "speedup_32": round(sp, 3),
        "speedup_target_met": sp >= 2.0,
        "overload_only_503": set(ov["status_counts"]) <= {"200", "503"} and ov["transport_errors"] == 0,
        "non_503_errors": int(non503),
    }
    res["machine"]["uptime_at_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    atomic_write_json(out_dir / f"{args.name}.json", res)
    write_markdown(res, out_dir / f"{args.name}.md")
    plot(res, out_dir / f"{args.name}.png")
    print(json.dumps(res["summary"], indent=2))
    print((out_dir / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
