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
import resource
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from bench import dated_results
from bench.hostile.attacks import run_amplification, run_flood, run_fuzz, run_leavers, run_mixed, run_slow, run_unread
from bench.hostile.bounded import run_bounded
from bench.hostile.cases import v2_cases
from bench.hostile.report import summarize, write_markdown
from bench.hostile.workers import run_worker_kill
from bench.lib.http import closed_connections, model_name
from bench.lib.report import machine
from bench.lib.server import ServerProcess
from holoserve.core.files import atomic_write_json

REPO = Path(__file__).resolve().parents[2]
PAIR_TASKS = ("mrpc", "qqp", "qnli", "rte", "stsb", "wnli", "mnli")


def position_table(ckpt: Path) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 512))


def build_parser() -> argparse.ArgumentParser:
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
    return ap


def start_refusing(args, root: Path, ckpt: Path, settings: dict, log: Path) -> tuple[ServerProcess, dict]:
    """Phase 1: a sequence length beyond the position table must stop the server from starting; the server the
    later phases use (the same one where it started anyway)."""
    table = position_table(ckpt)
    too_long = max(1000, table + 1)
    srv = ServerProcess(root, ckpt, log, env={**settings, "HOLOSERVE_MAX_SEQ_LENGTH": str(too_long)},
                        nofile=args.server_nofile)
    started = srv.wait_ready()
    msg = ""
    if not started:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "max-seq-length" in ln]
        msg = lines[-1].strip()[:400] if lines else ""
    refusal = {"max_seq_length": too_long, "position_table": table, "refused": not started,
               "exit_code": srv.proc.returncode, "message": msg}
    if not started:
        srv = ServerProcess(root, ckpt, log, env=settings, nofile=args.server_nofile)
        srv.wait_ready()
    return srv, refusal


def one_server_phases(args, srv: ServerProcess, pair: bool, hold: float) -> dict:
    """Phases 2 to 8 against one running server."""
    res: dict = {"fuzz": asyncio.run(run_fuzz(srv.port, pair))}
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
    res["server_counters"] = closed_connections(srv.url)
    return res


def main() -> int:
    args = build_parser().parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this client holds thousands of sockets
    tmp = Path(tempfile.mkdtemp(prefix="holoserve-hostile-"))
    if args.checkpoint:
        ckpt = Path(args.checkpoint).resolve()
    else:
        from tests.helpers.serving import make_tiny_checkpoint

        ckpt = make_tiny_checkpoint(tmp, "sst2")
    pair = json.loads((ckpt / "manifest.json").read_text()).get("task", {}).get("name") in PAIR_TASKS
    root = Path(args.server_root).resolve()
    settings = {"HOLOSERVE_BACKEND": "onnxruntime", "HOLOSERVE_THREADS": "1", "HOLOSERVE_ACCESS_LOG": "0",
                "HOLOSERVE_HEADER_TIMEOUT_S": str(args.header_timeout),
                "HOLOSERVE_BODY_TIMEOUT_S": str(args.body_timeout),
                "HOLOSERVE_SEND_TIMEOUT_S": str(args.send_timeout)}
    hold = args.hold or max(args.header_timeout, args.body_timeout) + 3
    log = tmp / "server.log"
    res: dict = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
                 "checkpoint": ckpt.name if args.checkpoint else "tiny random BERT (sst2, 2 layers)",
                 "server_settings": {k.removeprefix("HOLOSERVE_").lower(): v for k, v in settings.items()},
                 "server_nofile": args.server_nofile,
                 "timeouts": {"header": args.header_timeout, "body": args.body_timeout},
                 "command": "python -m bench.hostile.run" + (" --checkpoint CKPT" if args.checkpoint else "")}
    srv, res["settings"] = start_refusing(args, root, ckpt, settings, log)
    log_start = log.stat().st_size if log.exists() else 0
    try:
        res.update(one_server_phases(args, srv, pair, hold))
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
