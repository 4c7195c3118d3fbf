"""ONNX Runtime's two INT8 GEMM paths on one checkpoint, in one process, taking turns: its default u8 x s8 GEMM
and the exact u8 x u8 one that `session.x64quantprecision` asks for (needed on x86-64 without VNNI, where the
default saturates). Prints what the probe finds on this CPU, each path's median ms and the largest logit
difference between them, per batch shape.

    python -m bench.cpu_latency.ort_exact_path runs/minilm-sst2 [--shapes 1x32,8x32,32x32,32x64] [--runs 20]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.cpu_latency.common import random_rows
from holoserve.backends.openvino import parse_shapes
from holoserve.core import ort
from holoserve.core.artifact import load_artifact
from holoserve.core.machine import describe_cpu


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.ort_exact_path",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--shapes", default="1x32,8x32,32x32,32x64", help="ROWSxTOKENS, comma-separated")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per path and shape, after 3 untimed")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    art = load_artifact(args.checkpoint)
    path = art.path / art.export("onnxruntime").file
    paths = {"default u8 x s8": ort.session(path, threads=args.threads, exact_u8u8=False, quiet=True),
             "exact u8 x u8": ort.session(path, threads=args.threads, exact_u8u8=True, quiet=True)}
    names = {i.name for i in paths["default u8 x s8"].get_inputs()}
    vocab = json.loads((art.path / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    rng = np.random.default_rng(0)
    print(f"{describe_cpu()}; {args.threads} thread(s); the default saturates here: {ort.u8s8_saturates()}")
    print("rows x tokens: median ms, default / exact, exact / default, max |logit difference|")
    for rows, seq in parse_shapes(args.shapes):
        feed = {k: v for k, v in random_rows(rng, vocab, rows, seq).items() if k in names}
        times: dict[str, list[float]] = {n: [] for n in paths}
        logits = {n: s.run(None, feed)[0] for n, s in paths.items()}
        for i in range(3 + args.runs):
            for name, sess in paths.items():
                t0 = time.perf_counter()
                sess.run(None, feed)
                if i >= 3:
                    times[name].append(1000 * (time.perf_counter() - t0))
        a, b = (float(np.median(v)) for v in times.values())
        diff = float(np.abs(logits["default u8 x s8"] - logits["exact u8 x u8"]).max())
        print(f"{rows} x {seq}: {a:.2f} / {b:.2f} ms, {b / a:.2f}x, {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
