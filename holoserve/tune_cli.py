"""`holoserve tune CKPT`: time this machine's CPU backends on the checkpoint's dev texts and write the serving
profile that `holoserve serve --backend auto` then follows.

Light at import time (argparse only): the work is in holoserve.tune, imported by run().
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .cli_options import advanced
from .core.choices import OPENVINO_KERNELS, OPENVINO_PRECISIONS

DESCRIPTION = (
    "Time the CPU backends the checkpoint has exports for (ONNX Runtime; OpenVINO with HoloServe's 2:4 kernels "
    "where they run and beat its own GEMMs by 5 % in a first phase, and with a few static shapes) on this "
    "machine, on the checkpoint's own dev texts in the "
    "batches the server forms, taking turns round by round; then write the decision, the median times and what "
    "they were measured on into CKPT/serving-profile.json. `holoserve serve` with --backend auto (the default, "
    "and the container's) serves as that file says, without timing at start-up, for as long as the machine, "
    "the runtimes, the backend options and the exports are the ones it was measured with; otherwise it times "
    "briefly at start-up and says so. ONNX Runtime, the simpler backend, is kept unless OpenVINO is faster by "
    "5 %. Run it on the machine (or an identical one) that will serve, with the settings it will serve with.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder, exported (`holoserve export CKPT`); "
                   "the profile is written into it, so it must be writable")
    p.add_argument("--texts", metavar="FILE", type=Path,
                   help="texts like those the server will get: one a line, or a CSV, TSV or JSON Lines file with a "
                        "text column (two for a text-pair model); default: the checkpoint's dev texts (GLUE SST-2's "
                        "dev set for an sst2 checkpoint, or its GLUE task's in $HOLOSERVE_DATA_DIR), required "
                        "otherwise")
    p.add_argument("--duration", metavar="S", type=float, default=60.0,
                   help="seconds to time for, in rounds (at least 5 rounds however long they take; default 60)")
    p.add_argument("--threads", metavar="N", type=int, default=0,
                   help="backend intra-op threads, as `serve --threads` will give them (0 = what a CPU quota or "
                        "cpuset allows, else the library default; a profile applies only to a server with the same "
                        "threads)")
    p.add_argument("--workers", metavar="N", type=int, default=1,
                   help="the server processes `serve --workers` will start: under a CPU quota or cpuset they share "
                        "its threads, so the profile is timed with each one's share (default 1)")
    p.add_argument("--instances", metavar="N", default="auto",
                   help="the batches `serve --instances` will run at once: each is timed on its share of the "
                        "threads (default auto, as the server's)")
    p.add_argument("--max-batch-size", metavar="N", type=int, default=32,
                   help="the largest batch the server will form (`serve --max-batch-size`); batches of 1, 2, 4, "
                        "... up to it are timed (default 32)")
    adv = advanced(p, "backend options, to match a server started with them, and diagnostics")
    adv.add_argument("--text-column", metavar="NAME",
                     help="--texts: the text column (default: text, sentence, sentence1 or question)")
    adv.add_argument("--text-pair-column", metavar="NAME",
                     help="--texts: the second text's column for a text-pair model (default: text_pair, "
                          "sentence2 or sentence)")
    adv.add_argument("--openvino-precision", choices=OPENVINO_PRECISIONS, default="auto",
                     help="as `serve --openvino-precision` (default auto)")
    adv.add_argument("--openvino-kernels", choices=[k for k in OPENVINO_KERNELS if k != "reference"], default="auto",
                     help="as `serve --openvino-kernels` (default auto; not reference, which is for checks)")
    adv.add_argument("--openvino-sparse-weights", action="store_true",
                     help="as `serve --openvino-sparse-weights`")
    adv.add_argument("--no-static-shapes", action="store_true",
                     help="do not time OpenVINO with static shapes (saves their compile time and memory)")
    adv.add_argument("--min-rounds", metavar="N", type=int, default=5,
                     help="rounds to time however long they take (default 5)")


def run(args: argparse.Namespace) -> int:
    import sys

    from . import HoloServeError
    from .tune import TuneOptions, report, tune

    problems = []
    if args.duration < 0:
        problems.append(f"--duration {args.duration:g}: give 0 or more seconds")
    if args.threads < 0:
        problems.append(f"--threads {args.threads}: give 0 (the library default) or more")
    if args.workers < 1:
        problems.append(f"--workers {args.workers}: give 1 or more")
    if args.max_batch_size < 1:
        problems.append(f"--max-batch-size {args.max_batch_size}: give 1 or more")
    if args.min_rounds < 1:
        problems.append(f"--min-rounds {args.min_rounds}: give 1 or more")
    if problems:
        raise HoloServeError("; ".join(problems))
    opts = TuneOptions(texts=args.texts, text_column=args.text_column, text_pair_column=args.text_pair_column,
                       duration=args.duration, min_rounds=args.min_rounds, threads=args.threads, workers=args.workers,
                       instances=args.instances, max_batch_size=args.max_batch_size,
                       openvino_precision=args.openvino_precision, openvino_kernels=args.openvino_kernels,
                       openvino_sparse_weights=args.openvino_sparse_weights,
                       static_shapes=not args.no_static_shapes)
    prof, path = tune(args.checkpoint, opts, out=sys.stderr)
    print(report(prof, path))
    return 0
