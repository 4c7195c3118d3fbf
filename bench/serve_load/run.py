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
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench import dated_results
from bench.lib.report import machine, uptime_text, write_record
from bench.serve_load.load import REPO, alternate_rounds, fleet, load_texts, run_load, sequential, summarize, warm
from bench.serve_load.modes import docker_main, token_budget_main
from bench.serve_load.report import backend_desc, markdown, plot
from holoserve import HoloServeError
from holoserve.core.artifact import load_artifact, read_manifest

__all__ = ["REPO", "main"]

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
        from holoserve.core.tokenizer import pad_batch, split_by_length

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


def build_parser() -> argparse.ArgumentParser:
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
                    help="compare two containers of IMAGE instead: its defaults (no backend flags) and --versus, "
                         "at --clients (e.g. 1,32); writes NAME_docker.{json,md}")
    ap.add_argument("--versus", default="onnxruntime",
                    help="with --docker, the second container: onnxruntime (the same image forced to it), "
                         "runtime-threads (given the threads the runtimes would pick by themselves, one per physical "
                         "core), one-instance (one batch at a time: --instances 1, on what the checkpoint's "
                         "serving profile decides), image:NAME (another image, "
                         "e.g. an earlier build, with its defaults) or env:HOLOSERVE_X=V[,...] (the same image with "
                         "those settings)")
    ap.add_argument("--env", default=None, metavar="HOLOSERVE_X=V[,...]",
                    help="with --docker: settings given to both containers (the default one too), e.g. to hold two "
                         "images (--versus image:NAME) to the same pinned backend")
    ap.add_argument("--cpus", type=float, default=None,
                    help="with --docker: run both containers under a CPU quota (docker run --cpus)")
    ap.add_argument("--deny-amx", action="store_true",
                    help="with --docker: run both containers under a seccomp rule that refuses AMX, so that on a "
                         "CPU with AMX both runtimes run their AVX-512 VNNI kernels (a stand-in for a CPU without)")
    ap.add_argument("--token-budgets", default=None,
                    help="comma-separated --max-batch-tokens values: compare them with count-based batching "
                         "(clients default to 32) instead of the full benchmark")
    ap.add_argument("--max-padding-waste", type=float, default=0.25,
                    help="the servers' --max-padding-waste in the token-budget comparison (-1: pad to the longest)")
    return ap


def pick_checkpoint(args) -> Path:
    """--checkpoint, else the first of the usual run folders with what --backend needs."""
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
    return ckpt


def batch1_overhead(args, ckpt: Path, texts: list, port: int, log: Path) -> dict:
    """The bare backend and the server (batching off, 1 client) in alternating chunks, the server's own time
    per request from its access log, and the HTTP floor (GET /healthz)."""
    out: dict = {"http_floor": asyncio.run(http_floor(port, 500))}
    print("GET /healthz floor:", out["http_floor"], flush=True)
    bare = Bare(ckpt, args.threads, args.backend)
    out["backend"] = bare.be.info()
    out["backend_desc"] = backend_desc(args.backend)
    bare.chunk(texts, 0, 20)
    mark = log.stat().st_size
    chunks = 10
    per = max(1, args.bare_n // chunks)
    b_tot, b_inf, srv = [], [], []
    for r in range(chunks):
        t, i = bare.chunk(texts, r * per, per)
        b_tot += t
        b_inf += i
        srv += asyncio.run(sequential(port, texts, r * per, per))
    out["bare_backend"] = {"n": len(b_tot), "p50_ms": round(float(np.median(b_tot)), 3),
                           "infer_p50_ms": round(float(np.median(b_inf)), 3),
                           "p95_ms": round(float(np.percentile(b_tot, 95)), 3),
                           "throughput_seq_per_s": bare.scaling(texts)}
    asgi = asgi_overhead(log, mark)
    own = asgi.pop("inference_ms")
    out["batch1_http"] = {"n": len(srv), "p50_ms": round(float(np.median(srv)), 3),
                          "p95_ms": round(float(np.percentile(srv, 95)), 3), "asgi": asgi}
    if len(own) == len(srv):  # the same requests in the same order: per-request HTTP time minus model time
        out["batch1_http"]["minus_own_inference_p50_ms"] = round(float(np.median(np.subtract(srv, own))), 3)
    print("bare:", out["bare_backend"], "\nhttp batch 1:", out["batch1_http"], flush=True)
    return out


async def http_floor(port: int, n: int) -> dict:
    """p50 of GET /healthz from one client: the HTTP stack + client + loopback with no model work."""
    ts = await sequential(port, [], 0, n, path="/healthz")
    return {"n": n, "p50_ms": round(float(np.median(ts)), 3), "p95_ms": round(float(np.percentile(ts, 95)), 3)}


def overload(args, ckpt: Path, texts: list, out_dir: Path) -> dict:
    """A small queue and many clients: everything beyond capacity must be a 503."""
    extra = ["--max-batch-size", str(args.batch_size), "--max-queue-delay-ms", str(args.queue_delay_ms),
             "--max-queue-size", "16", "--max-items", "16"]
    plans = {"overload": {"checkpoint": ckpt, "args": extra, "backend": args.backend}}
    with fleet(plans, out_dir, args.name, args.threads) as servers:
        ov = summarize(128, [asyncio.run(run_load(servers["overload"].port, texts, 128, min(args.duration, 5.0),
                                                  args.max_requests))])
    ov.update({"max_queue_size": 16, "server_args": extra})
    print("overload:", ov["status_counts"], "transport errors", ov["transport_errors"], flush=True)
    return ov


def summary(res: dict) -> dict:
    """The overhead, batching speed-up and overload figures against their targets."""
    b1, ov = res["batch1_http"], res["overload"]
    levels = [*res["modes"]["off"]["levels"], *res["modes"]["on"]["levels"], ov]
    non503 = sum(v for lv in levels for k, v in lv["status_counts"].items() if k not in ("200", "503"))
    non503 += sum(lv["transport_errors"] for lv in levels)
    by_c = {m: {lv["clients"]: lv for lv in res["modes"][m]["levels"]} for m in res["modes"]}
    overhead = b1["p50_ms"] - res["bare_backend"]["p50_ms"]
    sp = (by_c["on"][32]["throughput_rps"] / by_c["off"][32]["throughput_rps"]) if 32 in by_c["on"] else float("nan")
    return {
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


def full_benchmark(args, ckpt: Path, texts: list, text_source: str, out_dir: Path) -> dict:
    """Batching off and on side by side at every --clients level, the overhead at batch 1, and overload."""
    art = load_artifact(ckpt)
    res: dict = {
        "benchmark": "serve_load", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "checkpoint": {"name": ckpt.name, "base_model": art.base_model, "task": art.task_name,
                       "max_seq_length": art.max_seq_length, "training": art.manifest.training.get("method"),
                       "export": art.manifest.exports.onnxruntime.file if art.manifest.exports.onnxruntime else None},
        "texts": text_source, "threads": args.threads, "duration_s": args.duration, "rounds": args.rounds,
        "max_requests": args.max_requests, "client": "asyncio HTTP/1.1 keep-alive, one process, closed loop",
        "modes": {}}
    modes = {"off": ["--max-batch-size", "1", "--max-queue-delay-ms", "0"],
             "on": ["--max-batch-size", str(args.batch_size), "--max-queue-delay-ms", str(args.queue_delay_ms)]}
    # Both servers write the JSON access log: the in-server overhead at batch 1 is read from it.
    plans = {m: {"checkpoint": ckpt, "args": [*a, "--max-queue-size", "512", "--access-log"], "backend": args.backend}
             for m, a in modes.items()}
    # Both servers stay up (an idle server costs nothing) and the modes take turns at every level,
    # so drifting background load on the shared cores hits both alike.
    with fleet(plans, out_dir, args.name, args.threads) as servers:
        for m, srv in servers.items():
            res["modes"][m] = {"server_args": plans[m]["args"], "levels": []}
            warm(srv.port, texts)
        res.update(batch1_overhead(args, ckpt, texts, servers["off"].port, servers["off"].log))
        for c in (int(x) for x in args.clients.split(",")):
            got = alternate_rounds({m: s.port for m, s in servers.items()}, texts, c, args)
            for mode, lv in got.items():
                lv["uptime_after"] = uptime_text()
                res["modes"][mode]["levels"].append(lv)
                print(f"batching {mode:3s} clients {c:4d}: {lv['throughput_rps']:8.1f} req/s  p50 {lv.get('p50_ms')} "
                      f"p99 {lv.get('p99_ms')} ms  mean batch {lv['mean_batch']}  {lv['status_counts']}", flush=True)
    res["overload"] = overload(args, ckpt, texts, out_dir)
    res["summary"] = summary(res)
    res["machine"]["uptime_at_end"] = uptime_text()
    return res


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ckpt = pick_checkpoint(args)
    texts, text_source = load_texts(args.texts, args.data_dir)
    out_dir = Path(args.out) if args.out else dated_results(args.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.token_budgets:
        return token_budget_main(args, ckpt, texts, text_source, out_dir)
    if args.docker:
        return docker_main(args, ckpt, texts, text_source, out_dir)
    res = full_benchmark(args, ckpt, texts, text_source, out_dir)
    _, md = write_record(res, out_dir, args.name, markdown)
    plot(res, out_dir / f"{args.name}.png")
    print(json.dumps(res["summary"], indent=2))
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
