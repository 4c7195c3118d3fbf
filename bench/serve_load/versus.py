"""Served throughput of our checkpoint against the dense model on the same server and GPU.

Two `holoserve serve` processes stay up side by side on this machine, both with dynamic batching on:
ours (`--backend`, torch-cuda on a GPU, whose per-bucket routing between the 2:4 and the dense INT8 GEMMs
lands in the report from /v1/models) and the dense model on the `torch` backend (transformers, FP16 on
the GPU by default, `--dense-compile` through torch.compile too). Closed-loop clients post single SST-2 dev
sentences at each `--clients` level, the two servers taking turns round by round so drifting load hits
both alike. An idle server costs nothing, and the GPU runs one at a time.

The dense model is `--dense-checkpoint` (the teacher's folder) where given, else our checkpoint's own
weights in dense FP16: the same shapes and the same dense GEMMs as the teacher's, so the same speed
(dense kernels do not skip the zeros), only the values differ. Every level stops after --duration
seconds (split over --rounds) or --max-requests answers per server.

    python -m bench.serve_load.versus --backend torch-cuda --checkpoint CKPT --data-dir GLUE --clients 1,32,128

writes NAME.json and NAME.md (default name serve_versus) into --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from bench import dated_results
from bench.lib.report import machine, write_record
from bench.serve_load.load import alternate_rounds, fleet, run_load, sst2_sentences
from bench.serve_load.report import backend_desc
from holoserve.core.choices import TORCH_CUDA_ROUTES, TORCH_PRECISIONS
from holoserve.server.config import ServerConfig

OURS_BACKENDS = ("torch-cuda", "tensorrt", "onnxruntime")  # onnxruntime: the CPU check of this benchmark
TARGET_RATIO_32 = 1.5  # ours' served throughput at 32 clients over the dense model's, on the same server and GPU


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_load.versus", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="our compressed checkpoint folder")
    ap.add_argument("--backend", default="torch-cuda", choices=OURS_BACKENDS,
                    help="our server's backend (torch-cuda on a GPU; onnxruntime needs an export)")
    ap.add_argument("--route", default=ServerConfig.torch_cuda_route, choices=TORCH_CUDA_ROUTES,
                    help="torch-cuda's --torch-cuda-route for our server (default: the server's; auto: the faster of "
                         "the 2:4 and the dense INT8 GEMMs per batch bucket, timed at start-up)")
    ap.add_argument("--dense-checkpoint", default=None,
                    help="the dense model's folder (e.g. the teacher); default: our checkpoint's weights served dense")
    ap.add_argument("--dense-precision", default="fp16", choices=TORCH_PRECISIONS,
                    help="the dense server's --torch-precision (fp16 needs a CUDA GPU; fp32 on a CPU)")
    ap.add_argument("--dense-compile", action="store_true",
                    help="serve the dense model through torch.compile (--torch-compile); its start-up compiles")
    ap.add_argument("--data-dir", default=os.environ.get("HOLOSERVE_DATA_DIR"),
                    help="GLUE folder with SST-2/dev.tsv (default: built-in sentences)")
    ap.add_argument("--clients", default="1,32,128", help="comma-separated concurrent client counts")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per level and server, split over --rounds")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per level")
    ap.add_argument("--max-requests", type=int, default=50000, help="answers per level and server, at most")
    ap.add_argument("--batch-size", type=int, default=32, help="both servers' --max-batch-size")
    ap.add_argument("--queue-delay-ms", type=float, default=0.0, help="both servers' --max-queue-delay-ms")
    ap.add_argument("--threads", type=int, default=1, help="both servers' --threads (backend intra-op threads)")
    ap.add_argument("--ready-s", type=float, default=300.0,
                    help="seconds each server may take to load and warm up (routing and compiling take time)")
    ap.add_argument("--out", help="output folder (default bench/results/<today>-<name>)")
    ap.add_argument("--name", default="serve_versus")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: every problem is a usage error that names the fix."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.levels = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--clients takes whole numbers separated by commas, e.g. 1,32,128; not {args.clients!r}")
    if not args.levels or min(args.levels) < 1:
        ap.error(f"--clients needs at least one level, each >= 1; not {args.clients!r}")
    for flag, value, low in (("--duration", args.duration, 0.0), ("--ready-s", args.ready_s, 0.0)):
        if not value > low:
            ap.error(f"{flag} must be > 0 seconds, not {value}")
    for flag, value in (("--rounds", args.rounds), ("--max-requests", args.max_requests),
                        ("--batch-size", args.batch_size), ("--threads", args.threads)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, not {value}")
    if args.max_requests < args.rounds:
        ap.error(f"--max-requests ({args.max_requests}) must be >= --rounds ({args.rounds}): each round needs one")
    if args.route != ServerConfig.torch_cuda_route and args.backend != "torch-cuda":
        ap.error(f"--route chooses torch-cuda's GEMMs; with --backend {args.backend} leave it out")
    for flag, path in (("--checkpoint", args.checkpoint), ("--dense-checkpoint", args.dense_checkpoint)):
        if path is not None and not (Path(path) / "config.json").is_file():
            ap.error(f"{flag} {path}: no checkpoint there (config.json missing); pass a checkpoint folder "
                     "(on the GPU machine: python3 -m bench.gpu.pack unpack .carry/checkpoint /tmp/ckpt)")
    return args


def server_plans(args: argparse.Namespace) -> dict[str, dict]:
    """The two servers: backend, checkpoint and `holoserve serve` flags; the same batching for both."""
    common = ["--max-batch-size", str(args.batch_size), "--max-queue-delay-ms", str(args.queue_delay_ms),
              "--max-queue-size", "512", "--no-access-log"]
    ours = common + (["--torch-cuda-route", args.route] if args.backend == "torch-cuda" else [])
    dense = common + ["--torch-precision", args.dense_precision] + (["--torch-compile"] if args.dense_compile else [])
    return {"ours": {"backend": args.backend, "checkpoint": Path(args.checkpoint), "args": ours},
            "dense": {"backend": "torch", "checkpoint": Path(args.dense_checkpoint or args.checkpoint), "args": dense,
                      "weights": "--dense-checkpoint" if args.dense_checkpoint else
                      "our checkpoint's weights, served dense (the teacher's shapes and GEMMs)"}}


def backend_info(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return json.loads(r.read())["models"][0]["backend"]


def _dense_label(args: argparse.Namespace) -> str:
    return f"dense {args.dense_precision}" + (" + torch.compile" if args.dense_compile else "")


def measure(args: argparse.Namespace, texts: list[str], out_dir: Path) -> dict:
    """Start both servers, warm them, run every level in alternating rounds; raw results by server."""
    plans = server_plans(args)
    res: dict = {"servers": {}, "levels": []}
    with fleet(plans, out_dir, args.name, args.threads, ready_s=args.ready_s) as servers:
        for name, srv in servers.items():
            plan = plans[name]
            res["servers"][name] = {**{k: str(v) if isinstance(v, Path) else v for k, v in plan.items()},
                                    "start_s": srv.start_s, "backend_info": backend_info(srv.port)}
            print(f"{name}: {plan['backend']} ready in {srv.start_s} s", flush=True)
            for c in sorted({1, max(args.levels)}):  # warm-up, not recorded: batch 1 and the largest batches
                asyncio.run(run_load(srv.port, texts, c, 1.5, 2000))
        for c in args.levels:
            level = {"clients": c, **alternate_rounds({n: s.port for n, s in servers.items()}, texts, c, args)}
            dense_rps = level["dense"]["throughput_rps"]
            level["throughput_ratio"] = round(level["ours"]["throughput_rps"] / dense_rps, 3) if dense_rps else None
            res["levels"].append(level)
            print(f"clients {c:4d}: ours {level['ours']['throughput_rps']:9.1f} req/s "
                  f"(p50 {level['ours'].get('p50_ms')} "
                  f"ms)  {_dense_label(args)} {dense_rps:9.1f} req/s (p50 {level['dense'].get('p50_ms')} ms)  "
                  f"ratio {level['throughput_ratio']}", flush=True)
    return res


def summary(res: dict) -> dict:
    """The ratio at 32 clients against the target, and whether anything but a 200 came back."""
    by = {lv["clients"]: lv for lv in res["levels"]}
    bad = sum(v for lv in res["levels"] for n in ("ours", "dense") for k, v in lv[n]["status_counts"].items()
              if k != "200") + sum(lv[n]["transport_errors"] for lv in res["levels"] for n in ("ours", "dense"))
    out = {"throughput_ratio_by_clients": {str(c): lv["throughput_ratio"] for c, lv in by.items()},
           "non_200_or_transport_errors": int(bad)}
    if 32 in by and by[32]["throughput_ratio"] is not None:
        out["throughput_ratio_32"] = by[32]["throughput_ratio"]
        out["target_ratio_32"] = TARGET_RATIO_32
        out["target_met"] = by[32]["throughput_ratio"] >= TARGET_RATIO_32
    return out


def dense_buckets(info: dict) -> list[str]:
    """Our batch buckets that torch-cuda's routing put on the dense INT8 GEMMs (none for other backends)."""
    return sorted((b for b, k in (info.get("routes") or {}).items() if k == "int_mm"),
                  key=lambda s: tuple(int(x) for x in s.split("x")))


def markdown(res: dict) -> str:
    """The page: both servers' levels side by side, the target and torch-cuda's routing."""
    args = argparse.Namespace(**res["settings"])
    m = res["machine"]
    ours_info = res["servers"]["ours"]["backend_info"]
    dense_info = res["servers"]["dense"]["backend_info"]
    lines = [f"# Served throughput: ours ({args.backend}) vs the dense model ({_dense_label(args)}), same server",
             "", f"{res['date']} · {res['backend_desc']} · {m['cpu']} ({m['cores']} cores) · {res['texts']} · one text "
             f"per request, closed-loop clients on loopback, {args.duration} s per level and server in {args.rounds} "
             f"alternating rounds · both servers: --max-batch-size {args.batch_size}, --max-queue-delay-ms "
             f"{args.queue_delay_ms}, --threads {args.threads}, no access log.",
             f"Dense model: {res['servers']['dense']['weights']} ({res['servers']['dense']['checkpoint']}), torch "
             f"backend, precision {dense_info.get('precision')}, compiled: {dense_info.get('compiled')}.",
             f"Ours: {res['servers']['ours']['checkpoint']}, {ours_info.get('backend')}"
             + (f", route {ours_info.get('route')}: buckets on dense INT8: {dense_buckets(ours_info) or 'none'}"
                if "routes" in ours_info else "") + ".", "",
             "| clients | ours req/s | dense req/s | ratio | ours p50 / p99 ms | dense p50 / p99 ms "
             "| mean batch ours / dense "
             "| non-200 ours / dense |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for lv in res["levels"]:
        o, d = lv["ours"], lv["dense"]

        def bad(x):
            return {k: v for k, v in x["status_counts"].items() if k != "200"} or "-"

        lines.append(f"| {lv['clients']} | {o['throughput_rps']:.1f} | {d['throughput_rps']:.1f} | "
                     f"{lv['throughput_ratio']} | {o.get('p50_ms')} / {o.get('p99_ms')} | {d.get('p50_ms')} / "
                     f"{d.get('p99_ms')} | {o['mean_batch']} / {d['mean_batch']} | {bad(o)} / {bad(d)} |")
    s = res["summary"]
    if "throughput_ratio_32" in s:
        lines += ["", f"Target: ours ≥ {TARGET_RATIO_32}× the dense model's served throughput at 32 clients: "
                      f"{s['throughput_ratio_32']}× ({'met' if s['target_met'] else 'NOT met'})."]
    if "route_ms" in ours_info:
        lines += ["", "torch-cuda's routing at start-up (median ms per call, CUDA events): "
                      + ", ".join(f"{b} ({v['tokens']} tokens): 2:4 {v.get('cslt')}, dense INT8 {v.get('int_mm')}"
                                  for b, v in ours_info["route_ms"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dense_precision == "fp16":
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
        if not cuda:
            sys.exit("--dense-precision fp16 serves the dense model on a CUDA GPU, and torch sees none here: "
                     "pass --dense-precision fp32 on a machine without one")
    texts, text_source = sst2_sentences(args.data_dir)
    out_dir = Path(args.out) if args.out else dated_results(args.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"benchmark": "serve_load_versus_dense", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": machine(), "backend_desc": backend_desc(args.backend), "texts": text_source,
           "settings": {k: v for k, v in vars(args).items() if k != "levels"}}
    res.update(measure(args, texts, out_dir))
    res["summary"] = summary(res)
    _, md = write_record(res, out_dir, args.name, markdown)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
