"""`holoserve eval CHECKPOINT`: dev metrics with the numerics the export reproduces, on the checkpoint's own
dev rows (the embedded sample it was trained on), a GLUE split (--data-dir DIR) or the user's file (--dev FILE).

Weights are used exactly as stored (int8 × per-channel scale); with INT8 activations in the
manifest, every encoder Linear input is fake-quantized per tensor with the manifest's amax.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from holoserve import HoloServeError
from holoserve.cli_options import advanced
from holoserve.core.choices import (
    EVAL_BACKEND_ALIASES,
    EVAL_BACKENDS,
    OPENVINO_KERNELS,
    OPENVINO_KERNELS_DEFAULT,
    OPENVINO_PRECISIONS,
)
from holoserve.core.manifest import ONNXRUNTIME, TENSORRT_ONNX


def add_arguments(p: argparse.ArgumentParser) -> None:
    adv = advanced(p)
    p.add_argument("checkpoint", type=Path, help="HoloServe checkpoint folder")
    g = p.add_argument_group("data", "the rows to score: --dev FILE (your own labelled rows, labels spelled as in "
                                     "training), or a GLUE shortcut's split in --data-dir; a checkpoint trained on "
                                     "the embedded sample is scored on the sample's dev rows by default")
    g.add_argument("--dev", metavar="FILE", help="labelled rows: CSV, TSV, JSON Lines, Parquet or a "
                                                 "datasets.save_to_disk folder")
    g.add_argument("--text-column", metavar="NAME", help="text column (default: text, sentence, sentence1, question)")
    g.add_argument("--text-pair-column", metavar="NAME", help="second text of a pair task")
    g.add_argument("--label-column", metavar="NAME", help="label column (default: label, labels or score)")
    g.add_argument("--no-header", action="store_true", help="CSV/TSV without a header line")
    g.add_argument("--task", help="GLUE shortcut (default: the checkpoint's task)")
    g.add_argument("--data-dir", help="GLUE folder (default: $HOLOSERVE_DATA_DIR)")
    g.add_argument("--split", default="dev", help="GLUE split to score (default: dev)")
    adv.add_argument("--limit", type=int, help="score only the first N rows")
    adv.add_argument("--batch-size", type=int, default=128)
    adv.add_argument("--fp32", action="store_true", help="skip activation fake-quant (weights still as stored)")
    p.add_argument("--backend", choices=EVAL_BACKENDS, default=None, type=lambda s: EVAL_BACKEND_ALIASES.get(s, s),
                   help="what computes the logits: torch (default), the fake-quant model with the checkpoint's "
                        "numerics; onnxruntime or openvino, an export through the server's own backend of that "
                        "name, on the same batches (`holoserve export --target onnxruntime|openvino` first)")
    p.add_argument("--onnx", action="store_true", help="the same as --backend onnxruntime")
    p.add_argument("--compare", action="store_true",
                   help="with --backend onnxruntime or openvino: also score the checkpoint's own numerics on the "
                        "same rows and report how the backend's predictions differ: identical share, rows only "
                        "one of them gets right, McNemar's exact test of whether their accuracies differ "
                        "(a regression: the correlation of the two scores and their largest difference), and whether "
                        "that is within what float rounding explains (the rule `holoserve export` checks)")
    adv.add_argument("--openvino-precision", choices=OPENVINO_PRECISIONS, default=None,
                     help="with --backend openvino: the precision of OpenVINO's float ops, as `holoserve serve "
                          "--openvino-precision` takes it (default: auto, the CPU plugin's choice, bf16 on CPUs "
                          "with bf16 units)")
    adv.add_argument("--openvino-kernels", choices=OPENVINO_KERNELS, default=None,
                     help="with --backend openvino: run the 2:4 INT8 Linears on HoloServe's kernels, as `holoserve "
                          "serve --openvino-kernels` takes it (default: " + OPENVINO_KERNELS_DEFAULT + ")")
    adv.add_argument("--onnx-export", default=ONNXRUNTIME, choices=(ONNXRUNTIME, TENSORRT_ONNX),
                   help="with --onnx: which export; 'onnxruntime' (what `holoserve serve` runs on a CPU) or "
                        "'tensorrt-onnx' (the TensorRT placement, emulated on the CPU)")
    adv.add_argument("--threads", type=int, default=0,
                     help="the backend's threads with --backend onnxruntime|openvino (0 = its default)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the PyTorch model runs: auto = a CUDA GPU when torch sees one (default: auto)")
    p.add_argument("--predictions", metavar="FILE", type=Path,
                   help="also write one JSON line per scored row: its texts, gold label and prediction (with "
                        "the class probabilities, or the score of a regression), in row order")


def run(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit <= 0:
        raise HoloServeError("--limit must be a positive number")
    from holoserve.data.sources import data_options

    from .evaluate import EvalOptions, evaluate_checkpoint

    options = EvalOptions(
        data=data_options(args), task=args.task, data_dir=args.data_dir, split=args.split, limit=args.limit,
        batch_size=args.batch_size, backend=args.backend, onnx=args.onnx, onnx_export=args.onnx_export,
        fp32=args.fp32, threads=args.threads, device=args.device, openvino_precision=args.openvino_precision,
        openvino_kernels=args.openvino_kernels, compare=args.compare, predictions=args.predictions)
    out = evaluate_checkpoint(args.checkpoint, options)
    print(json.dumps(out, indent=2))
    return 0
