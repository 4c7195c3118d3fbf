"""ONNX Runtime vs OpenVINO on one repeated input shape and on a new sequence length every run, in one
process, taking turns: what a runtime that pays for each new shape costs on served traffic.

    python -m bench.cpu_latency.shape_churn runs/minilm-sst2 [--rows 8,32] [--runs 12]

Prints the minimum and median of each (ms). Random token ids, no padding.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from holoserve.backends import load_backend
from holoserve.core.artifact import load_artifact
from holoserve.core.machine import describe_cpu


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.shape_churn", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--seq", type=int, default=30, help="the repeated length; the new lengths step by 2 from 18")
    args = ap.parse_args()
    art = load_artifact(args.checkpoint)
    backends = {n: load_backend(n, art) for n in ("onnxruntime", "openvino")}
    rng = np.random.default_rng(0)
    print(describe_cpu())
    for rows in (int(r) for r in args.rows.split(",")):
        for label, lengths in (("one shape repeated", [args.seq] * args.runs),
                               ("a new length every run", list(range(18, 18 + 2 * args.runs, 2)))):
            times = {n: [] for n in backends}
            for seq in lengths:
                ids = rng.integers(1000, 30000, (rows, seq))
                feed = (ids, np.ones_like(ids), np.zeros_like(ids))
                for name, backend in backends.items():
                    t0 = time.perf_counter()
                    backend.infer(*feed)
                    times[name].append(1000 * (time.perf_counter() - t0))
            print(f"{rows} rows, {label}: " + ", ".join(
                f"{n} min {min(v):.1f} median {np.median(v):.1f}" for n, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
