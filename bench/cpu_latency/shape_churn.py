"""ONNX Runtime vs OpenVINO on a new sequence length every run, then on the same lengths again, in one process,
taking turns: what a runtime that prepares its kernels for each new input shape costs on served traffic, and
what the OpenVINO backend's padding to multiples of SEQ_MULTIPLE tokens buys back.

    python -m bench.cpu_latency.shape_churn runs/minilm-sst2 [--rows 8,32] [--runs 24]

Three engines: ONNX Runtime; OpenVINO's dynamic model fed each exact length (its compiled model called
directly); the OpenVINO backend as it serves (each length padded up to a multiple of SEQ_MULTIPLE). Prints
the total and median ms of each pass. Random token ids, full rows, lengths 17, 19, ... up to the checkpoint's.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.cpu_latency.common import random_rows
from holoserve.backends import load_backend
from holoserve.backends.openvino import SEQ_MULTIPLE
from holoserve.core.artifact import load_artifact
from holoserve.core.machine import describe_cpu


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.shape_churn", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--runs", type=int, default=24, help="lengths per pass (17, 19, ...; at most the checkpoint's)")
    args = ap.parse_args()
    art = load_artifact(args.checkpoint)
    ort, ov = load_backend("onnxruntime", art), load_backend("openvino", art)
    exact = ov.compiled.create_infer_request()

    def ov_exact(ids, mask, segments):
        names = dict(zip(("input_ids", "attention_mask", "token_type_ids"), (ids, mask, segments)))
        return exact.infer({n: names[n] for n in ov.input_names})

    engines = {"onnxruntime": ort.infer, "openvino, exact lengths": ov_exact,
               f"openvino, padded to {SEQ_MULTIPLE}": ov.infer}
    lengths = [s for s in range(17, 17 + 2 * args.runs, 2) if s <= art.max_seq_length]
    vocab = json.loads((art.path / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    rng = np.random.default_rng(0)
    print(describe_cpu())
    print(f"{len(lengths)} lengths, {lengths[0]} to {lengths[-1]}; total ms of a pass (median ms per run)")
    for rows in (int(r) for r in args.rows.split(",")):
        for label in ("each length new", "the same lengths again"):
            times: dict[str, list[float]] = {n: [] for n in engines}
            for seq in lengths:
                feed = tuple(random_rows(rng, vocab, rows, seq).values())
                for name, run in engines.items():
                    t0 = time.perf_counter()
                    run(*feed)
                    times[name].append(1000 * (time.perf_counter() - t0))
            print(f"{rows} rows, {label}: " + ", ".join(
                f"{n} {sum(v):.0f} ({np.median(v):.1f})" for n, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
