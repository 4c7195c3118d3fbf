"""What two runtimes in one process cost each other when batches alternate between them, as a routed pair
(holoserve.backends.routed.RoutedCpuBackend) serves: a small batch on ONNX Runtime, then a large one on OpenVINO,
again and again, against each batch run on its own; for each way ONNX Runtime's pool threads can wait
(holoserve.core.ort.SPIN): spinning on after each run (its default), spinning inside a run only (HoloServe's
sessions), or never (parked).

    python -m bench.cpu_latency.switching runs/minilm-sst2 [--small 1x32] [--large 16x40] [--runs 30]

OpenVINO runs the large batch on a static shape that fits it, as `holoserve tune` would serve it. ONNX Runtime
also runs a medium batch (--medium) on its own: what the way its threads wait costs it inside a run.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.cpu_latency.common import random_rows
from holoserve.backends import load_backend
from holoserve.backends.openvino import SEQ_MULTIPLE, parse_shapes
from holoserve.core.artifact import load_artifact
from holoserve.core.machine import describe_cpu
from holoserve.core.ort import SPIN, session

LABELS = {"always": "spinning after each run (its default)", "run": "spinning inside a run only (HoloServe's)",
          "never": "parked"}


def _median_ms(run, feed, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        run(*feed)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.switching", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--small", default="1x32", help="ROWSxTOKENS of the batch ONNX Runtime runs")
    ap.add_argument("--large", default="16x40", help="ROWSxTOKENS of the batch OpenVINO runs")
    ap.add_argument("--medium", default="16x32", help="ROWSxTOKENS of a batch ONNX Runtime runs on its own")
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args(argv)
    art = load_artifact(args.checkpoint)
    ((sr, ss),), ((mr, ms),), ((lr, ls),) = (parse_shapes(x) for x in (args.small, args.medium, args.large))
    static = f"{lr}x{-(-ls // SEQ_MULTIPLE) * SEQ_MULTIPLE}"
    ov = load_backend("openvino", art, openvino_shapes=static)
    ort = load_backend("onnxruntime", art)  # its feeding; each way of waiting below swaps in its own session
    vocab = json.loads((art.path / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    rng = np.random.default_rng(0)
    small, medium, large = (tuple(random_rows(rng, vocab, rows, seq).values())
                            for rows, seq in ((sr, ss), (mr, ms), (lr, ls)))
    print(f"{describe_cpu()}; ONNX Runtime {args.small} and {args.medium} alone, {args.small} alternating with "
          f"OpenVINO {args.large} (static shape {static}); median ms")
    for spin in SPIN:
        ort.session = session(ort.path, threads=ort.threads, spin=spin, quiet=True)
        for _ in range(3):
            ort.infer(*small)
            ov.infer(*large)
        alone = [_median_ms(f.infer, feed, args.runs) for f, feed in ((ort, small), (ort, medium), (ov, large))]
        after: tuple[list[float], list[float]] = ([], [])
        for _ in range(args.runs):
            t0 = time.perf_counter()
            ort.infer(*small)
            t1 = time.perf_counter()
            ov.infer(*large)
            after[0].append(time.perf_counter() - t1)
            after[1].append(t1 - t0)
        print(f"ONNX Runtime threads {LABELS[spin]}: ONNX Runtime {alone[0]:.2f} alone, "
              f"{1000 * np.median(after[1]):.2f} right after OpenVINO, {args.medium} {alone[1]:.2f} alone; "
              f"OpenVINO {alone[2]:.2f} alone, {1000 * np.median(after[0]):.2f} right after ONNX Runtime", flush=True)


if __name__ == "__main__":
    main()
