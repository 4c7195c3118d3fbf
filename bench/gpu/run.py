#!/usr/bin/env python3
"""All-in-one GPU benchmark of 2:4 sparse INT8 (cuSPARSELt through PyTorch) for HoloServe.

One run on an H100/H200 (< 10 minutes) writes to --out:
  results.json  everything measured, with the GPU, driver, torch / CUDA / cuSPARSELt versions
  latest.json   the encoder timings as flat rows (model, engine, kind dense/ours/peer-2:4, batch, seq,
                median ms, ratio to the best dense peer): every ratio can be recomputed from it
  results.md    the tables (per-GEMM, whole encoder, parity, targets) and the TensorRT check
  gemm.png      2:4 speed-ups per GEMM shape over M
  encoder.png   whole-encoder throughput per variant over batch size

Sections
  env      GPU, driver, versions; `python3 -c "import tensorrt"` and `ldconfig -p | grep nvinfer`
  peak     measured dense peaks: FP16 cuBLAS and INT8 torch._int_mm at 8192^3
  gemm     K, N in {384, 768, 1536, 3072}, M = tokens 128..16384: dense FP16 (cuBLAS), dense INT8
           (torch._int_mm), 2:4 FP16 and 2:4 INT8 (torch._cslt_sparse_mm); TFLOP/s / TOPS counted
           as dense-equivalent 2*M*N*K, against the measured dense peak of the same precision
  encoder  MiniLM (the real checkpoint from --carry) and a BERT-base-shaped model with RANDOM weights:
           FP16 eager (transformers), FP16 + CUDA graphs, dense INT8 + graphs, ours (2:4 INT8 eager
           and + graphs), torchao int8_dynamic_activation_int8_semi_sparse_weight (eager, + graphs),
           the torch-cuda backend end to end (host arrays in, logits out), and two compiled dense peers
           (bench/gpu/peers.py): FP16 transformers (SDPA) and dense INT8 (_int_mm) through torch.compile
           (--compile-mode, default max-autotune); batch 1/8/32/128, seq 128. Each variant is also
           given against the best dense peer at its batch (the fastest dense variant)
  parity   ours vs the checkpoint's fake-quant model (fp32) on the dev split from --carry: logit
           differences, argmax agreement, accuracy
  profile  (not in the default set) where the BERT-base-shaped encoder's time goes, per kernel category

Method: CUDA events around each call, warm-up calls first, medians over timed calls, fresh random
inputs every call (token ids drawn away from special tokens; GEMM operands random and non-zero).
Every measurement is guarded: a failure is recorded with its message and the run goes on, and the
JSON is rewritten after each section, so a run cut short still leaves its results.

`--cpu-smoke` runs the same pipeline on tiny shapes on the CPU with no CUDA call at all (reference
INT8 math instead of the GPU kernels; the compiled peers through Inductor's C++ backend, on the
BERT-base stand-in only), to test the argument handling and the report writers.

Layout: this module reads the command line and runs the sections in order; harness.py holds the run's
state, timing and guards; gemm.py the env, peak and gemm sections; models.py the models timed;
encoder.py the encoder and profile sections; parity.py the parity section; report.py the targets,
results.md, plots, latest.json and --merge.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from bench import dated_results
from bench.gpu import peers
from bench.gpu.encoder import section_encoder, section_encoder_3p, section_profile
from bench.gpu.gemm import section_env, section_gemm, section_peak
from bench.gpu.harness import Run, Stopped, guarded, log, only_failure
from bench.gpu.parity import section_parity
from bench.gpu.report import finish, merge_main

ROOT = Path(__file__).resolve().parents[2]

KN_DEFAULT = [384, 768, 1536, 3072]
M_DEFAULT = [128, 512, 1024, 2048, 4096, 8192, 16384]
BATCHES_DEFAULT = [1, 8, 32, 128]
ENCODER_MODELS = ("checkpoint", "bert-base")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.run", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(dated_results("gpu")),
                    help="output folder (default $OUT, else bench/results/<today>-gpu)")
    ap.add_argument("--carry", default=str(ROOT / ".carry"), help="folder written by bench.gpu.bundle (default .carry)")
    ap.add_argument("--sections", default="env,peak,gemm,encoder,parity",
                    help="comma-separated subset of env,peak,gemm,encoder,parity,profile (profile: where "
                         "the encoder's time goes, per kernel category; not in the default set)")
    ap.add_argument("--kn", default=",".join(map(str, KN_DEFAULT)), help="GEMM K and N values")
    ap.add_argument("--m", default=",".join(map(str, M_DEFAULT)), help="GEMM M values (tokens)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES_DEFAULT)), help="encoder batch sizes")
    ap.add_argument("--seq", type=int, default=128, help="encoder sequence length")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--gemm-inner", type=int, default=8,
                    help="distinct input buffers per GEMM timing (graph of N calls)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip remaining work after this many seconds")
    ap.add_argument("--no-torchao", action="store_true", help="leave out the torchao variants")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peers")
    ap.add_argument("--compile-mode", choices=peers.COMPILE_MODES, default=peers.DEFAULT_COMPILE_MODE,
                    help=f"torch.compile mode of the compiled peers (default {peers.DEFAULT_COMPILE_MODE}; "
                         "cpu-smoke: default)")
    ap.add_argument("--models", default=",".join(ENCODER_MODELS),
                    help="encoder models: checkpoint (the one in --carry, MiniLM), bert-base (random weights)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on the CPU, no CUDA calls (tests the pipeline)")
    args = ap.parse_args(argv)
    args.kn_list = [int(x) for x in args.kn.split(",") if x]
    args.m_list = [int(x) for x in args.m.split(",") if x]
    args.batch_list = [int(x) for x in args.batches.split(",") if x]
    args.section_list = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    if set(args.model_list) - set(ENCODER_MODELS):
        ap.error(f"unknown models: {', '.join(sorted(set(args.model_list) - set(ENCODER_MODELS)))}")
    bad = set(args.section_list) - (set(SECTIONS) - {"encoder_3p"})  # encoder_3p follows encoder on its own
    if bad:
        ap.error(f"unknown sections: {', '.join(sorted(bad))}")
    if args.cpu_smoke:
        if args.kn == ",".join(map(str, KN_DEFAULT)):
            args.kn_list = [32, 64]
        if args.m == ",".join(map(str, M_DEFAULT)):
            args.m_list = [16, 32]
        if args.batches == ",".join(map(str, BATCHES_DEFAULT)):
            args.batch_list = [1, 2]
        args.seq = min(args.seq, 16)
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 3)
        args.gemm_inner = min(args.gemm_inner, 2)
        if args.compile_mode == peers.DEFAULT_COMPILE_MODE:  # autotuning and CUDA graphs are GPU features
            args.compile_mode = "default"
    return args


SECTIONS = {"env": section_env, "peak": section_peak, "gemm": section_gemm, "encoder": section_encoder,
            "parity": section_parity, "encoder_3p": section_encoder_3p, "profile": section_profile}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--merge"]:  # --merge A/results.json [B/results.json ...] --out DIR (one: re-render)
        if "--out" not in argv or argv.index("--out") < 2 or len(argv) != argv.index("--out") + 2:
            print("usage: python -m bench.gpu.run --merge RESULTS.json [RESULTS.json ...] --out DIR", file=sys.stderr)
            return 2
        return merge_main(argv[1:argv.index("--out")], Path(argv[-1]))
    args = parse_args(argv)
    run = Run(args)
    if not run.smoke:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run this on a GPU machine, or use --cpu-smoke", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False
    run.report["errors"] = []

    def _stop(signum, _frame):  # `timeout` sends SIGTERM: still write the tables of what was measured
        raise Stopped(f"stopped by signal {signum} after {run.elapsed():.0f} s")

    signal.signal(signal.SIGTERM, _stop)
    # parity first (the check that must not be lost), then the whole-encoder targets, then the GEMM
    # sweep (it stops at the time budget), and third-party graph captures last of all
    order = [s for s in ("env", "peak", "parity", "profile", "encoder", "gemm") if s in args.section_list or s == "env"]
    if "encoder" in args.section_list:
        order.append("encoder_3p")
    try:
        for name in order:
            if run.over_budget() and name != "env":
                run.report["sections"][name] = {"error": "skipped: time budget reached"}
                continue
            log(f"section {name}")
            t = time.perf_counter()
            r = guarded(name, lambda name=name: SECTIONS[name](run))
            if only_failure(r):
                run.report["errors"].append(f"{name}: {r['error']}")
            r["seconds"] = round(time.perf_counter() - t, 1)
            run.report["sections"][name] = r
            run.save()
    except Stopped as e:
        log(str(e))
        run.report["errors"].append(str(e))
    finish(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
