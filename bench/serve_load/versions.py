"""The server's own cost per request: this checkout's `holoserve serve` against another checkout's (a baseline
commit), on the same checkpoint with the same backend and settings, in one run.

Both servers stay up and take turns round by round at each client level (closed-loop keep-alive clients in
one asyncio process), so drifting load on the shared cores hits both alike. Reported per level and server:
requests/s, p50/p99 latency, and the server process's CPU time per request (user + system, from
/proc/PID/stat), which is what a faster request path saves whatever the model costs.

    git worktree add /tmp/baseline <commit>
    python -m bench.serve_load.versions --checkpoint runs/minilm-sst2 --baseline-root /tmp/baseline \\
        --data-dir "$GLUE_DIR" --texts short --clients 1,32
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from bench import dated_results
from bench.lib.report import machine, table, write_record
from bench.serve_load.load import REPO, alternate_rounds, fleet, load_texts, warm


def markdown(res: dict) -> str:
    lines = [f"# The server's own cost: this checkout vs {res['baseline']} ({res['date']})", "",
             f"Machine: {res['machine'].get('cpu', '')}, {res['machine'].get('cores', '')} cores; checkpoint "
             f"{res['checkpoint']}; backend {res['backend']}, {res['threads']} thread(s); {res['texts']}; "
             f"{res['rounds']} alternating rounds, {res['duration_s']} s per level and server.", "",
             f"`{res['command']}`", "",
             *table(("server", "clients", "req/s", "p50 ms", "p99 ms", "server CPU ms / request", "statuses"),
                    ([name, r["clients"], r["throughput_rps"], r.get("p50_ms"), r.get("p99_ms"),
                      r["server_cpu_ms_per_request"], r["status_counts"]]
                     for lv in res["levels"] for name, r in lv["servers"].items()))]
    lines += ["", "Ratios (this checkout / baseline): " + json.dumps(res["ratios"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_load.versions", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="an exported checkpoint folder")
    ap.add_argument("--baseline-root", required=True, help="a checkout of the baseline (git worktree add DIR COMMIT)")
    ap.add_argument("--data-dir", default=os.environ.get("HOLOSERVE_DATA_DIR"))
    ap.add_argument("--texts", default="short", help="short, long (three sentences joined) or pairs (MRPC)")
    ap.add_argument("--clients", default="1,32")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per level and server, over --rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-requests", type=int, default=10 ** 9, help="answers per level and server, at most")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="onnxruntime")
    ap.add_argument("--out", help="output folder (default bench/results/<today>-serve-versions)")
    args = ap.parse_args(argv)

    ckpt, baseline = Path(args.checkpoint).resolve(), Path(args.baseline_root).resolve()
    texts, source = load_texts(args.texts, args.data_dir)
    out = Path(args.out) if args.out else dated_results("serve-versions")
    out.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "-C", str(baseline), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or baseline.name
    ours = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    roots = {f"baseline {head}": baseline, f"this checkout {ours}": REPO}
    res: dict = {"benchmark": "serve_versions", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine(), "baseline": head, "checkpoint": ckpt.name, "backend": args.backend,
                 "threads": args.threads, "texts": source, "rounds": args.rounds, "duration_s": args.duration,
                 "command": "python -m bench.serve_load.versions --checkpoint CKPT --baseline-root DIR "
                            f"--data-dir \"$GLUE_DIR\" --texts {args.texts} --clients {args.clients}",
                 "levels": []}
    plans = {name: {"checkpoint": ckpt, "args": [], "backend": args.backend, "root": root}
             for name, root in roots.items()}
    with fleet(plans, out, "versions", args.threads) as servers:
        for srv in servers.values():
            warm(srv.port, texts, 8, 2.0, 400)
        for c in (int(x) for x in args.clients.split(",")):
            got = alternate_rounds({n: s.port for n, s in servers.items()}, texts, c, args,
                                   pids={n: s.pid for n, s in servers.items()})
            res["levels"].append({"clients": c, "servers": got})
            for name, r in got.items():
                print(f"{name:28s} clients {c:3d}: {r['throughput_rps']:8.1f} req/s  p50 {r.get('p50_ms')} ms  "
                      f"cpu {r['server_cpu_ms_per_request']} ms/req  {r['status_counts']}", flush=True)
    base, new = list(roots)
    res["ratios"] = {str(lv["clients"]): {
        "throughput": round(lv["servers"][new]["throughput_rps"] / lv["servers"][base]["throughput_rps"], 3),
        "p50": round(lv["servers"][new]["p50_ms"] / lv["servers"][base]["p50_ms"], 3),
        "cpu_per_request": round(lv["servers"][new]["server_cpu_ms_per_request"]
                                 / lv["servers"][base]["server_cpu_ms_per_request"], 3)} for lv in res["levels"]}
    stem = f"versions_{args.texts}"
    write_record(res, out, stem, markdown)
    print(json.dumps(res["ratios"], indent=1))
    print(f"wrote {out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
