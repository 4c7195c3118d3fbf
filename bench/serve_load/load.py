"""What every served benchmark here does: the texts a load sends, closed-loop clients against one server,
servers taking turns round by round, and `holoserve serve` processes started and stopped around a run."""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from bench.lib.http import Conn, metric_sum, metrics
from bench.lib.server import ServerProcess, cpu_seconds

REPO = Path(__file__).resolve().parents[2]

FALLBACK = [
    "it 's a charming and often affecting journey .", "unflinchingly bleak and desperate",
    "allows us to hope that nolan is poised to embark a major career as a commercial yet inventive filmmaker .",
    "the acting , costumes , music , cinematography and sound are all astounding given the production 's austere"
    " locales .",
    "it 's slow -- very , very slow .", "although laced with humor and a few fanciful touches , the film is a "
    "refreshingly serious look at young women .",
    "a sometimes tedious film .", "or doing last year 's taxes with your ex-wife .",
]


# --------------------------------------------------------------------------- texts


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


# --------------------------------------------------------------------------- load


async def run_load(port: int, texts: list, clients: int, duration: float, max_requests: int) -> dict:
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
        conn = Conn(port)
        k = i
        while time.perf_counter() < stop_at and issued < max_requests:
            issued += 1
            body = bodies[k % len(bodies)]
            k += clients
            t0 = time.perf_counter()
            try:
                status, data = await conn.request("/predict", body)
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


async def sequential(port: int, texts: list, start: int, n: int, path: str = "/predict") -> list[float]:
    """`n` requests one after another from one client (a GET of `path` where `texts` is empty): latencies in ms."""
    conn = Conn(port)
    out = []
    for i in range(start, start + n):
        body = request_body(texts[i % len(texts)]) if texts else None
        t0 = time.perf_counter()
        status, _ = await conn.request(path, body)
        out.append((time.perf_counter() - t0) * 1000)
        assert status == 200, status
    conn.close()
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


def batch_counts(port: int) -> tuple[float, float]:
    """(sequences, executions) the server's batcher has run so far, from its metrics."""
    samples = metrics(f"http://127.0.0.1:{port}")
    return (metric_sum(samples, "holoserve_inference_batch_size_sum") or 0.0,
            metric_sum(samples, "holoserve_inference_batch_size_count") or 0.0)


def take_turns(ports: dict[str, int], texts: list, clients: int, args, rounds: int,
               pids: dict[str, int] | None = None) -> dict[str, dict]:
    """`rounds` rounds of args.duration / args.rounds seconds on each server in turn, in the reverse order
    every other round: per server the raw loads (`parts`), the sequences and executions its batcher ran
    (`seqs`), the load generator's own CPU seconds (`client_cpu`) and, with `pids`, the server's (`cpu`).
    level_summary turns one or more of these into a level."""
    got = {n: {"parts": [], "seqs": [0.0, 0.0], "cpu": 0.0, "client_cpu": 0.0} for n in ports}
    for r in range(rounds):
        for name in (list(ports) if r % 2 == 0 else list(ports)[::-1]):  # who goes first alternates too
            port, mine = ports[name], got[name]
            before = batch_counts(port)
            c0 = cpu_seconds(pids[name]) if pids else 0.0
            own = time.process_time()
            mine["parts"].append(asyncio.run(run_load(port, texts, clients, args.duration / args.rounds,
                                                      args.max_requests // args.rounds)))
            mine["client_cpu"] += time.process_time() - own
            if pids:
                mine["cpu"] += cpu_seconds(pids[name]) - c0
            after = batch_counts(port)
            for k in (0, 1):
                mine["seqs"][k] += after[k] - before[k]
    return got


def level_summary(clients: int, turns: list[dict], with_cpu: bool = False) -> dict:
    """One server's level from its take_turns results (several where the servers were restarted between
    them): summarize's numbers, the mean executed batch size, the load generator's CPU time per answer (it
    shares the machine's cores with the server) and, with_cpu, the server's."""
    lv = summarize(clients, [p for t in turns for p in t["parts"]])
    seqs, execs = sum(t["seqs"][0] for t in turns), sum(t["seqs"][1] for t in turns)
    lv["mean_batch"] = round(seqs / execs, 2) if execs else 0
    client = sum(t.get("client_cpu", 0.0) for t in turns)
    lv["client_cpu_ms_per_request"] = round(1000 * client / lv["ok"], 3) if lv["ok"] else None
    if with_cpu:
        cpu = sum(t["cpu"] for t in turns)
        lv["server_cpu_ms_per_request"] = round(1000 * cpu / lv["ok"], 3) if lv["ok"] else None
    return lv


def alternate_rounds(ports: dict[str, int], texts: list, clients: int, args,
                     pids: dict[str, int] | None = None) -> dict[str, dict]:
    """One client level on several servers taking turns round by round (args.rounds rounds of
    args.duration / rounds seconds each, in the reverse order every other round), so drifting machine load
    and whatever the server before leaves behind hit them alike; per server the
    level's summary with the mean executed batch size read from its metrics and, with `pids` (the servers'
    processes), the server's CPU time per answered request."""
    got = take_turns(ports, texts, clients, args, args.rounds, pids)
    return {name: level_summary(clients, [got[name]], pids is not None) for name in ports}


# --------------------------------------------------------------------------- servers


def serve(ckpt: Path, extra: list[str], log: Path, threads: int = 1, backend: str = "onnxruntime",
          root: Path = REPO, ready_s: float = 120.0) -> ServerProcess:
    """`holoserve serve CKPT --backend B --threads T EXTRA` from the checkout `root`, once /readyz answers 200
    (load and warm-up done); raises after `ready_s` seconds (a GPU backend that times or compiles kernels at
    start-up needs more)."""
    args = ["--backend", backend, "--threads", str(threads), *extra]
    t0 = time.perf_counter()
    srv = ServerProcess(root, ckpt, log, args=args, threads=threads).ready(ready_s)
    srv.start_s = round(time.perf_counter() - t0, 1)
    return srv


@contextmanager
def fleet(plans: dict[str, dict], log_dir: Path, stem: str, threads: int,
          ready_s: float = 120.0) -> Iterator[dict[str, ServerProcess]]:
    """Servers started one after another, each from its plan (`checkpoint`, `args`, and optionally `backend`,
    `root`), logging to log_dir/STEM.NAME.log; all stopped on leaving. The logs are removed after a run that
    ends normally and kept where it failed (they say why a server did not start)."""
    servers: dict[str, ServerProcess] = {}
    logs = {name: log_dir / f"{stem}.{name}.log" for name in plans}
    try:
        for name, plan in plans.items():
            logs[name].unlink(missing_ok=True)
            servers[name] = serve(Path(plan["checkpoint"]), list(plan["args"]), logs[name], threads,
                                  plan.get("backend", "onnxruntime"), plan.get("root", REPO), ready_s)
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()
    for log in logs.values():
        log.unlink(missing_ok=True)


def warm(port: int, texts: list, clients: int = 8, seconds: float = 1.0, requests: int = 200) -> None:
    """A short load that is not recorded: the first requests of a fresh server pay one-off costs."""
    asyncio.run(run_load(port, texts, clients, seconds, requests))
