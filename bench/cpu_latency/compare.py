"""A/B latency of ONNX exports of one model, alternating in one process (what one graph rewrite buys).

    python -m bench.cpu_latency.compare LABEL=MODEL.onnx LABEL=MODEL.onnx [...] [--batch 32] [--seq 128]
                                        [--threads 1] [--runs 40] [--rounds 2] [--runtime onnxruntime|openvino]
                                        [--name compare]

--runtime openvino compiles each model (e.g. two checkpoints' model.ov.onnx) with OpenVINO's CPU plugin for
the one (batch, seq) shape, as the OpenVINO backend's --openvino-shapes does, with OpenVINO's default float
precision. With only the compared models in the process, a few-percent difference shows where
bench/cpu_latency/run.py, which interleaves a dozen engines, spreads by more than that at batch 1.

Every model gets the same full-length rows of random token ids (after the first 1000 ids of the
vocabulary); runs alternate model by model, so background load hits all alike; each round is a
fresh interleaving. Prints and writes the median per model and its ratio to the first one, per
round and over all runs, to bench/results/<today>-NAME/NAME.{json,md} (--out), with the machine named and its load.
"""
from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench.cpu_latency.common import (load_avg, ort_session, output_options, parse, percentile, random_rows, save,
                                      shape_options, timing_options)
from bench.lib.report import table, uptime_text
from holoserve.core.machine import describe_cpu


def _shown(path: Path) -> str:
    """The model's path relative to the working directory, or its folder/name when it lies outside."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return f"{path.parent.name}/{path.name}"


def parse_models(items: list[str]) -> list[tuple[str, Path]]:
    out = []
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"{item!r}: expected LABEL=PATH, e.g. fused=runs/ckpt/model.onnx")
        if not Path(path).is_file():
            raise SystemExit(f"{path}: no such ONNX file")
        out.append((label, Path(path)))
    if len(out) < 2:
        raise SystemExit("give at least two LABEL=PATH models to compare")
    if len({lbl for lbl, _ in out}) != len(out):
        raise SystemExit("labels must differ")
    return out


def runner(path: Path, label: str, feed: dict, args):
    """A no-argument callable that runs the model at `path` once on `feed` with the chosen runtime."""
    if args.runtime == "openvino":
        from holoserve.backends.openvino import compile_model

        compiled, _ = compile_model(path, threads=args.threads, shape=(args.batch, args.seq))
        names = {i.get_any_name() for i in compiled.inputs}
        run = compiled.create_infer_request().infer
    else:
        sess = ort_session(path, args.threads)
        names = {i.name for i in sess.get_inputs()}
        run = lambda f: sess.run(None, f)  # noqa: E731
    missing = {"input_ids", "attention_mask"} - names
    if missing:
        raise SystemExit(f"{label}: the model has no input(s) {sorted(missing)}")
    mine = {k: v for k, v in feed.items() if k in names}
    return lambda: run(mine)


def runtime_version(name: str) -> str:
    if name == "openvino":
        import openvino

        return openvino.__version__
    import onnxruntime

    return onnxruntime.__version__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.compare", description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+",
                    help="LABEL=PATH to an ONNX model (inputs input_ids, attention_mask, token_type_ids)")
    shape_options(ap, batch=32)
    timing_options(ap, 40, "timed runs per model and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runtime", choices=("onnxruntime", "openvino"), default="onnxruntime")
    ap.add_argument("--vocab", type=int, default=30522, help="token ids are drawn from [1000, vocab)")
    output_options(ap, "compare")
    args = parse(ap, argv)
    models = parse_models(args.models)
    if min(args.batch, args.seq, args.threads, args.runs, args.rounds) < 1:
        raise SystemExit("--batch, --seq, --threads, --runs and --rounds must be at least 1")

    started = datetime.now(timezone.utc)
    uptime_before, load_before = uptime_text(), load_avg()
    feed = random_rows(np.random.default_rng(0), args.vocab, args.batch, args.seq)
    sessions = [(label, runner(path, label, feed, args)) for label, path in models]
    times = {label: [] for label, _ in sessions}
    rounds = []
    for r in range(args.rounds):
        for label, run in sessions:
            for _ in range(args.warmup):
                run()
        this = {label: [] for label, _ in sessions}
        for _ in range(args.runs):
            for label, run in sessions:
                t0 = time.perf_counter()
                run()
                this[label].append((time.perf_counter() - t0) * 1000.0)
        med = {label: round(percentile(v, 50), 2) for label, v in this.items()}
        first = med[models[0][0]]
        rounds.append({"median_ms": med, "ratio_to_first": {k: round(first / v, 3) for k, v in med.items()}})
        print(f"round {r + 1}: " + "  ".join(f"{k} {v:.1f} ms (x{first / v:.3f})" for k, v in med.items()), flush=True)
        for label, xs in this.items():
            times[label].extend(xs)
    med = {label: round(percentile(v, 50), 2) for label, v in times.items()}
    first = med[models[0][0]]
    report = {
        "benchmark": "cpu_latency_compare",
        "date": started.date().isoformat(),
        "started": started.isoformat(timespec="seconds"),
        "machine": describe_cpu(),
        "load": {"uptime_before": uptime_before, "uptime_after": uptime_text(), "loadavg_before": load_before,
                 "loadavg_after": load_avg()},
        "runtime": args.runtime,
        args.runtime: runtime_version(args.runtime),
        "shape": {"batch": args.batch, "seq": args.seq, "threads": args.threads},
        "method": {"runs_per_round": args.runs, "warmup": args.warmup, "rounds": args.rounds, "interleaved": True,
                   "inputs": "random token ids, full-length rows (no padding)"},
        "models": {label: _shown(path) for label, path in models},
        "rounds": rounds,
        "median_ms": med,
        "speedup_vs_first": {k: round(first / v, 3) for k, v in med.items()},
    }
    print("overall: " + "  ".join(f"{k} {v:.1f} ms (x{first / v:.3f})" for k, v in med.items()))
    save(report, args, markdown)
    return 0


def markdown(r: dict) -> str:
    shape, method, med = r["shape"], r["method"], r["median_ms"]
    first = med[next(iter(med))]
    rows = [[label, f"`{path}`", f"{med[label]:.1f}", f"×{first / med[label]:.3f}",
             ", ".join(f"{x['median_ms'][label]:.1f}" for x in r["rounds"])] for label, path in r["models"].items()]
    lines = [f"# A/B latency — {r['date']}, {r['machine']}", "",
             f"batch {shape['batch']}, seq {shape['seq']}, {shape['threads']} thread(s); {method['rounds']} rounds × "
             f"{method['runs_per_round']} runs per model after {method['warmup']} warm-up runs, alternating; "
             f"{r['runtime']} {r[r['runtime']]}"
             + (", each model compiled for this one shape." if r["runtime"] == "openvino" else "."),
             f"Load before: `{r['load']['uptime_before']}`; after: `{r['load']['uptime_after']}`.", "",
             *table(["model", "file", "median ms", "speed-up vs first", "per round"], rows)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
