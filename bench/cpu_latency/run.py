"""CPU latency in one run: PyTorch fp32 eager, ORT fp32 and dynamic INT8, OpenVINO fp32 and NNCF INT8, ours.

    python -m bench.cpu_latency.run CHECKPOINT [--dense HF_FOLDER] [--data-dir GLUE_DIR]

- "ours": the checkpoint's exported model.onnx (`holoserve export`: 2:4 weights, static INT8 QDQ
  fused by ONNX Runtime into integer MatMuls), and its `openvino` export (model.ov.onnx,
  `holoserve export CKPT --target openvino`) compiled by OpenVINO through the OpenVINO backend;
  skipped, with the reason printed and recorded, where the checkpoint has no such export.
- baselines come from the dense fine-tuned model (--dense, e.g. the teacher the compressor saved;
  default: the checkpoint's own fp32 weights): PyTorch fp32 in eager mode, its fp32 ONNX export in
  ONNX Runtime, and that export after onnxruntime.quantization.quantize_dynamic (int8 weights,
  dynamic activation ranges: what Optimum's dynamic quantization produces; it also makes the
  attention MatMuls integer). --fuse-baseline-attention gives both ORT baselines the attention
  fusion ours gets (export/fusion.py) instead, --baseline-classifier-row the last layer computed for
  the [CLS] row only, as ours has it.
- OpenVINO baselines, also from the dense model: its plain fp32 ONNX export (no ORT rewrites;
  OpenVINO does its own fusions) compiled by OpenVINO's CPU plugin, and that model after NNCF
  post-training quantization (nncf.quantize, model_type TRANSFORMER, subset_size 64, on the first
  --calibration-rows training rows of the task, tokenized as for dev accuracy, one row per sample;
  weights stay dense). Both compiled with PERFORMANCE_HINT LATENCY and INFERENCE_NUM_THREADS =
  --threads. OpenVINO and NNCF are optional (`pip install 'holoserve[bench]'`): without them
  those engines are skipped with a message; --skip leaves out any engine but PyTorch.
- static-shape rows: ours through the OpenVINO backend's static shapes (`--openvino-shapes`), and the NNCF
  INT8 IR reshaped alike, each compiled for every cell's (batch, seq); OpenVINO fuses more of the graph
  when every dimension is static. The report gives their ratio per cell; they get no dev accuracy (the
  models are their dynamic rows').
- f32 rows: ours on OpenVINO (dynamic and static) with `--openvino-precision f32`, the numerics of
  `holoserve eval`; OpenVINO's default runs the float ops in bf16 where the CPU has bf16 units.
- kernel rows: ours on OpenVINO with `--openvino-kernels on` (HoloServe's 2:4 kernels, holoserve.kernels),
  dynamic and static; skipped with the reason on a CPU without AVX-512 VNNI and VBMI.
- --also CKPT: a second compressed checkpoint (e.g. one trained with `--set activation=relu` from the
  same teacher), its `openvino` export timed like ours (dynamic and static rows) in the same run, so
  that two recipes compare on the same inputs and load; it gets a dev accuracy like every engine.
- batch 1/8/32 x sequence 32/128 x 1 and 2 threads; every run uses full-length rows of random
  token ids; median and p90 over --runs timed runs after --warmup runs, the engines interleaved
  per shape so that background load hits them alike. Also SST-2 (or the checkpoint's task) dev
  accuracy of every engine but PyTorch eager (whose weights the ORT fp32 export holds).
Writes bench/results/<today>-NAME/NAME.{json,md,png} (--name, default cpu_latency; --out). The machine
is shared: `uptime` load averages before and after are recorded.
"""
from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from bench.cpu_latency.common import (accuracy, kernels_missing, load_avg, nncf_int8, openvino_modules, output_options,
                                      parse, percentile, random_rows, timing_options, train_samples)
from bench.cpu_latency.engines import (ENGINES, INT8_REFERENCE, LABELS, OPENVINO_ENGINES, OURS_OPENVINO, STATIC_OF,
                                       EngineSet, skip_static_rows)
from bench.cpu_latency.engines import KERNEL_ROWS  # noqa: F401  (re-exported with the rest of the engine table)
from bench.lib.report import figure, table, uptime_text, write_record
from holoserve.core.machine import describe_cpu


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.run", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--also", type=Path, default=None,
                    help="a second compressed checkpoint of the same task whose OpenVINO export is timed beside ours")
    ap.add_argument("--dense", type=Path, default=None,
                    help="dense fine-tuned HF folder for the baselines (default: the checkpoint's own fp32 weights)")
    ap.add_argument("--data-dir", default=None,
                    help="GLUE data dir for dev accuracy and the NNCF calibration rows (or $HOLOSERVE_DATA_DIR)")
    output_options(ap, "cpu_latency")
    timing_options(ap, 30)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--seqs", default="32,128")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dev-rows", type=int, default=None)
    ap.add_argument("--calibration-rows", type=int, default=64,
                    help="training rows NNCF calibrates the OpenVINO INT8 baseline on (its subset_size)")
    ap.add_argument("--skip", default="",
                    help=f"comma-separated engines to leave out, of {', '.join(ENGINES[1:])}")
    ap.add_argument("--fuse-baseline-attention", action="store_true",
                    help="give the ORT baselines the MultiHeadAttention fusion ours gets (before dynamic "
                         "quantization). Default: attention as exported, which dynamic quantization turns into "
                         "integer MatMuls; on a 2-core x86 CPU that was the faster dynamic INT8 baseline at "
                         "sequence 32 and no slower at 128")
    ap.add_argument("--baseline-classifier-row", action="store_true",
                    help="give the ORT baselines the classifier-row rewrite ours gets (the last layer computed "
                         "for the [CLS] row only; before dynamic quantization). Without --fuse-baseline-attention "
                         "it stops at the attention output, as attention is then not one node")
    return parse(ap, argv)


def requested_skips(args) -> dict:
    """{engine: why it is not run} for the engines --skip leaves out."""
    skipped = {}
    for k in filter(None, (x.strip() for x in args.skip.split(","))):
        if k not in ENGINES[1:]:
            raise SystemExit(f"--skip {k}: not an engine (choose from {', '.join(ENGINES[1:])})")
        skipped[k] = "left out (--skip)"
    return skipped


@dataclass
class Checkpoints:
    """The checkpoint (ours) and the optional --also one, with the exports their engines run."""
    art: Any
    ours: Path  # model.onnx
    ours_ov: Path | None  # model.ov.onnx
    art_also: Any = None
    also_ov: Path | None = None


def open_checkpoints(args, skipped: dict) -> Checkpoints:
    """Both checkpoints and their exports; an engine whose export is missing is skipped with the command that
    writes it, except ours on ONNX Runtime and --also's on OpenVINO, which the run needs."""
    from holoserve.core.artifact import load_artifact

    art = load_artifact(args.checkpoint)
    ours = art.export_path("onnxruntime")
    if ours is None or not ours.is_file():
        raise SystemExit(f"{art.path} has no ONNX Runtime export: run `holoserve export {art.path}` first")
    cps = Checkpoints(art, ours, art.export_path("openvino"))
    for key in OURS_OPENVINO:
        if key not in skipped and (cps.ours_ov is None or not cps.ours_ov.is_file()):
            skipped[key] = (f"{art.path.name} has no OpenVINO export (model.ov.onnx): run "
                            f"`holoserve export {art.path.name} --target openvino` to time ours on OpenVINO")
    if args.also is None:
        skipped.setdefault("also_openvino", "no --also checkpoint given")
    elif "also_openvino" not in skipped:
        cps.art_also = load_artifact(args.also)
        cps.also_ov = cps.art_also.export_path("openvino")
        if cps.also_ov is None or not cps.also_ov.is_file():
            raise SystemExit(f"--also {args.also}: it has no OpenVINO export (model.ov.onnx): run "
                             f"`holoserve export {args.also} --target openvino` first")
        if cps.art_also.task_name != art.task_name:
            raise SystemExit(f"--also {args.also}: its task is {cps.art_also.task_name!r}, the checkpoint's "
                             f"{art.task_name!r}; compare checkpoints of one task")
    return cps


def openvino_or_skip(skipped: dict):
    """(openvino, nncf) where installed and needed (else None); the engines that cannot run on this machine are
    added to `skipped`, and every skipped engine is printed."""
    ov = nncf = None
    if any(k not in skipped for k in OPENVINO_ENGINES):
        try:
            ov, nncf, why = openvino_modules()
            if nncf is None:
                skipped.setdefault("openvino_nncf_int8", why)
        except ImportError as e:
            for k in OPENVINO_ENGINES:
                skipped.setdefault(k, f"OpenVINO is not installed ({e}): pip install 'holoserve[bench]'")
    no_kernels = kernels_missing()
    if no_kernels:  # --openvino-kernels on refuses such a CPU; the static row follows its dynamic one below
        skipped.setdefault("ours_openvino_kernels", no_kernels)
    skip_static_rows(skipped)
    for k, why in skipped.items():
        print(f"skipping {LABELS[k]}: {why}", flush=True)
    return ov, nncf


@dataclass
class Baselines:
    """The dense model's files the baseline engines run, and how their graphs were made."""
    fp32_onnx: Path  # ORT fp32 (with the requested rewrites)
    plain_fp32_onnx: Path  # OpenVINO's input: as exported, standard ops only
    dyn_onnx: Path  # ORT dynamic INT8
    nncf_ir: Path  # OpenVINO INT8 (NNCF PTQ)
    attention: str = "as exported (MatMul, Softmax)"
    classifier_row: str = "all rows computed"
    calibration: dict = field(default_factory=dict)


def export_baselines(args, dense_dir: Path, work: Path, skipped: dict) -> Baselines:
    """The dense model exported to fp32 ONNX (plain, and with the rewrites asked for) and dynamically quantized."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModelForSequenceClassification

    from holoserve.export.onnx_export import torch_export_fp32

    print(f"exporting the dense baselines from {dense_dir.name} ...", flush=True)
    dense_eager = AutoModelForSequenceClassification.from_pretrained(str(dense_dir), local_files_only=True,
                                                                     attn_implementation="eager").eval()
    base = Baselines(work / "dense.fp32.onnx", work / "dense.fp32.plain.onnx", work / "dense.dynamic-int8.onnx",
                     work / "dense.nncf-int8.xml")
    torch_export_fp32(dense_eager, base.fp32_onnx)
    shutil.copyfile(base.fp32_onnx, base.plain_fp32_onnx)
    if args.fuse_baseline_attention or args.baseline_classifier_row:
        rewrite_baseline(args, base, int(dense_eager.config.num_attention_heads))
    if "ort_dynamic_int8" not in skipped:
        quantize_dynamic(str(base.fp32_onnx), str(base.dyn_onnx), weight_type=QuantType.QInt8)
    return base


def rewrite_baseline(args, base: Baselines, num_heads: int) -> None:
    """Give the ORT baselines' fp32 ONNX ours' attention fusion and/or classifier-row rewrite."""
    import onnx

    from holoserve.export.fusion import CONTRIB, FUSED_OP, fuse_attention, tensor_ranks
    from holoserve.export.standard_rewrites import keep_classifier_row

    m = onnx.load(str(base.fp32_onnx))
    ranks = tensor_ranks(m) if args.baseline_classifier_row else {}  # before contrib ops hide shapes
    if args.fuse_baseline_attention:
        fused = fuse_attention(m, num_heads)
        base.attention = f"{fused} blocks fused into {CONTRIB}.{FUSED_OP}, as in ours"
    if args.baseline_classifier_row:
        got = keep_classifier_row(m, ranks)
        base.classifier_row = f"last layer on the [CLS] row only, as in ours ({got['row_nodes']} nodes)"
    onnx.save(m, str(base.fp32_onnx))


def known_task(art):
    """The checkpoint's task, or None (no dev accuracy, no calibration rows) where this install does not know it."""
    try:
        from holoserve.data.tasks import get_task

        return get_task(art.task_name)
    except Exception as e:
        print(f"note: task {art.task_name!r} unknown ({e}): no dev accuracy or calibration rows", file=sys.stderr)
        return None


def nncf_baseline(args, art, tok, ov, nncf, base: Baselines, skipped: dict, sizes: dict) -> None:
    """OpenVINO's INT8 baseline: NNCF post-training quantization of the dense model on the first training rows,
    or the engine skipped where there are none."""
    if "openvino_nncf_int8" in skipped:
        return
    try:
        samples, task = train_samples(art, tok, args.data_dir, args.calibration_rows)
    except Exception as e:  # no data dir: nothing to calibrate on
        skipped["openvino_nncf_int8"] = f"no {art.task_name} training rows to calibrate on ({str(e)[:300]})"
        print(f"skipping {LABELS['openvino_nncf_int8']}: {skipped['openvino_nncf_int8']}", flush=True)
        return
    print(f"NNCF post-training quantization of the dense model on {len(samples)} {task.name} training rows ...",
          flush=True)
    t0 = time.perf_counter()
    nncf_int8(ov, nncf, base.plain_fp32_onnx, samples, base.nncf_ir)
    base.calibration = {"rows": len(samples), "split": "train", "task": task.name, "first_rows": True,
                        "seconds": round(time.perf_counter() - t0, 1)}
    sizes["openvino_nncf_int8_ir_bytes"] = base.nncf_ir.stat().st_size + base.nncf_ir.with_suffix(".bin").stat().st_size


def dev_accuracy(args, art, tok, task, engines: EngineSet) -> dict:
    """Dev accuracy of every engine with a dynamic-shape model, or why it was not measured."""
    acc = {}
    try:
        from holoserve.data.glue import read_split
        from holoserve.export.reference import encode_batches

        if task is None:
            raise RuntimeError(f"no task for {art.task_name!r}")
        rows = read_split(task, "dev", args.data_dir, limit=args.dev_rows)
        idx_b = list(encode_batches(tok, [r.text for r in rows], [r.text_pair for r in rows] if task.is_pair else None))
        order = np.concatenate([np.asarray(i) for i, _ in idx_b])
        labels = np.asarray([r.label for r in rows])[order]
        batches = [b for _, b in idx_b]
        for key, run in engines.runners(2).items():
            acc[key] = accuracy(run, batches, labels)
        acc["task"], acc["rows"] = task.name, len(rows)
        acc["max_seq_length"] = art.max_seq_length
        print("dev accuracy:", {k: v for k, v in acc.items()}, flush=True)
    except Exception as e:  # no data dir: latency only
        acc = {"skipped": str(e)}
    return acc


def time_cells(args, dense, tok, engines: EngineSet) -> list[dict]:
    """One row per (threads, batch, seq) cell: every engine's median and p90 and its speed-ups."""
    import torch

    rng = np.random.default_rng(0)
    vocab = dense.config.vocab_size
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    results = []
    for th in [int(x) for x in args.threads.split(",")]:
        torch.set_num_threads(th)
        engine_runs = engines.runners(th)
        for b in [int(x) for x in args.batches.split(",")]:
            for s in [int(x) for x in args.seqs.split(",")]:
                feed = random_rows(rng, vocab, b, s, cls_id, sep_id)
                results.append(time_cell(args, dense, engines, engine_runs, feed, th))
    return results


def time_cell(args, dense, engines: EngineSet, engine_runs: dict, feed: dict, th: int) -> dict:
    """Every engine timed on `feed`, interleaved; the static-shape rows compiled for its shape first."""
    import torch

    b, s = feed["input_ids"].shape
    tfeed = {k: torch.from_numpy(v) for k, v in feed.items()}

    def run_torch():
        with torch.inference_mode():
            dense(**tfeed)

    fns = {"pytorch_fp32": run_torch}
    static_backends = {}
    for k in engines.names:
        if k in STATIC_OF:
            run, static_backends[k] = engines.static_runner(k, th, b, s)
            engine_runs[k] = run
    for k in engines.names[1:]:
        fns[k] = (lambda run=engine_runs[k]: run(feed))
    times = interleaved(fns, args.runs, args.warmup)
    row = {"threads": th, "batch": b, "seq": s}
    for k, backend in static_backends.items():
        if backend is not None and backend.runs["static"] == 0:  # the cell must have run static
            raise RuntimeError(f"{LABELS[k]} never ran its static model: {backend.runs}")
    for k in engines.names:
        row[k] = {"median_ms": round(percentile(times[k], 50), 3), "p90_ms": round(percentile(times[k], 90), 3)}
    base = row["pytorch_fp32"]["median_ms"]
    row["speedup_vs_pytorch_fp32"] = {k: round(base / row[k]["median_ms"], 2) for k in engines.names}
    if INT8_REFERENCE in engines.names:
        ref = row[INT8_REFERENCE]["median_ms"]
        row[f"speedup_vs_{INT8_REFERENCE}"] = {k: round(ref / row[k]["median_ms"], 2) for k in engines.names}
    print(f"threads {th} batch {b:>2} seq {s:>3}: " + "  ".join(
        f"{k} {row[k]['median_ms']:.1f}ms (x{row['speedup_vs_pytorch_fp32'][k]})" for k in engines.names), flush=True)
    return row


def interleaved(fns: dict, runs: int, warmup: int) -> dict[str, list[float]]:
    """{name: ms per timed run}: `warmup` untimed runs of each, then `runs` rounds of one run of each."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    order = list(fns.items())
    for i in range(runs):
        # interleaved, so background load hits every engine alike, and in reverse order every
        # other round: an engine timed right after a similar one runs faster at batch 1
        # (docs/results/2026-11-24-openvino.md), a bias the reversal cancels
        for k, fn in (order if i % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t0) * 1000.0)
    return times


def record(args, cps: Checkpoints, base: Baselines, dense_dir: Path, started: datetime, before: dict,
           engines: EngineSet, skipped: dict, openvino_info: dict, sizes: dict, acc: dict, results: list) -> dict:
    """The run's JSON record."""
    import onnxruntime
    import torch

    return {
        "benchmark": "cpu_latency",
        "date": started.date().isoformat(),
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": describe_cpu(),
        "load": {"uptime_before": before["uptime"], "uptime_after": uptime_text(), "loadavg_before": before["loadavg"],
                 "loadavg_after": load_avg(),
                 "note": "shared machine: other jobs may have been running during the measurement"},
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                     "python": platform.python_version(),
                     **({"openvino": openvino_info["version"], "nncf": openvino_info["nncf"]}
                        if openvino_info else {})},
        "checkpoint": cps.art.path.name,
        "also_checkpoint": cps.art_also.path.name if cps.art_also is not None else None,
        "dense_baseline": dense_dir.name,
        "method": {"runs": args.runs, "warmup": args.warmup,
                   "inputs": "random token ids, full-length rows (no padding)",
                   "interleaved": "every round, the order reversed every other round",
                   "dynamic_int8": "onnxruntime.quantization.quantize_dynamic(weight_type=QInt8)",
                   "baseline_attention": base.attention,
                   "baseline_classifier_row": base.classifier_row,
                   "openvino_baselines": "the dense fp32 ONNX as exported (standard ops, no ORT rewrites), compiled "
                                         "by OpenVINO; INT8: nncf.quantize(model_type=TRANSFORMER, subset_size="
                                         f"{args.calibration_rows}) on the first training rows, dense weights",
                   "static_shape_rows": "compiled for each cell's (batch, seq) alone; ours through the OpenVINO "
                                        "backend's static shapes (--openvino-shapes), NNCF's IR reshaped to the "
                                        "cell; no dev accuracy (the same models as their dynamic rows)",
                   "nncf_calibration": base.calibration},
        "engines": engines.names,
        "skipped_engines": skipped,
        "openvino": openvino_info,
        "sizes": sizes,
        "dev_accuracy": acc,
        "results": results,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    skipped = requested_skips(args)  # engine -> why it was not run
    if args.runs < 30:
        print("note: fewer than 30 timed runs per cell", file=sys.stderr)
    from transformers import AutoModelForSequenceClassification

    from holoserve.export.reference import make_tokenizer

    cps = open_checkpoints(args, skipped)
    ov, nncf = openvino_or_skip(skipped)
    dense_dir = args.dense or cps.art.path
    started = datetime.now(timezone.utc)
    before = {"uptime": uptime_text(), "loadavg": load_avg()}
    work = Path(tempfile.mkdtemp(prefix="holoserve-bench-"))
    base = export_baselines(args, dense_dir, work, skipped)
    # PyTorch as users run it: default attention implementation, eval mode, inference_mode
    dense = AutoModelForSequenceClassification.from_pretrained(str(dense_dir), local_files_only=True).eval()
    sizes = {
        "fp32_onnx_bytes": base.fp32_onnx.stat().st_size,
        "dynamic_int8_onnx_bytes": base.dyn_onnx.stat().st_size if base.dyn_onnx.is_file() else None,
        "ours_onnx_bytes": cps.ours.stat().st_size,
        "ours_openvino_onnx_bytes": cps.ours_ov.stat().st_size if "ours_openvino" not in skipped else None,
        "also_openvino_onnx_bytes": cps.also_ov.stat().st_size if cps.also_ov is not None else None,
    }
    tok = make_tokenizer(cps.art)
    task = known_task(cps.art)
    nncf_baseline(args, cps.art, tok, ov, nncf, base, skipped, sizes)
    skip_static_rows(skipped)
    engines = EngineSet([k for k in ENGINES if k not in skipped], cps, base)
    openvino_info = engines.openvino_info(ov, nncf)
    acc = dev_accuracy(args, cps.art, tok, task, engines)
    results = time_cells(args, dense, tok, engines)
    report = record(args, cps, base, dense_dir, started, before, engines, skipped, openvino_info, sizes, acc, results)
    write_record(report, args.out, args.name, markdown)
    plot(report, args.out / f"{args.name}.png")
    print(f"wrote {args.out / args.name}.{{json,md,png}}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def report_engines(r: dict) -> list[str]:
    """The engines a report timed (reports written before OpenVINO joined have the first four)."""
    return list(r.get("engines") or ("pytorch_fp32", "ort_fp32", "ort_dynamic_int8", "ours_qdq_int8"))


def markdown(r: dict) -> str:
    engines = report_engines(r)
    versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items() if k != "python" and v)
    lines = [f"# CPU latency — {r['date']}, {r['machine']}", "",
             f"Checkpoint `{r['checkpoint']}`"
             + (f", second checkpoint (--also) `{r['also_checkpoint']}`" if r.get("also_checkpoint") else "")
             + f"; baselines from `{r['dense_baseline']}`. "
             f"Median / p90 of {r['method']['runs']} runs after {r['method']['warmup']} warm-up runs, engines "
             f"interleaved (the order reversed every other round), full-length rows. {versions}. "
             f"Attention in the ORT baselines: {r['method'].get('baseline_attention', 'as exported')}; "
             f"their last layer: {r['method'].get('baseline_classifier_row', 'all rows computed')}.",
             f"Load before: `{r['load']['uptime_before']}`; after: `{r['load']['uptime_after']}` "
             "(shared machine: other jobs may have been running).", ""]
    if any(k in engines for k in OPENVINO_ENGINES):
        cal = r["method"].get("nncf_calibration") or {}
        lines += [f"OpenVINO baselines: {r['method']['openvino_baselines']}"
                  + (f" ({cal['rows']} {cal['task']} rows, {cal['seconds']} s)" if cal else "")
                  + f"; compiled with {r['openvino']['config']}, other settings OpenVINO's defaults.", ""]
        prec = [f"{LABELS[k]} {r['openvino'][k]['gemm_precisions']}, float ops in "
                f"{r['openvino'][k].get('inference_precision', '?')}" for k in OPENVINO_ENGINES if k in r["openvino"]]
        lines += ["OpenVINO GEMM precisions (compiled graph): " + "; ".join(prec) + ".", ""]
    for k, why in (r.get("skipped_engines") or {}).items():
        lines += [f"Not run: {LABELS[k]} — {why}.", ""]
    acc = r["dev_accuracy"]
    if "skipped" not in acc:
        got = ", ".join(f"{LABELS[k]} {100 * acc[k]:.2f}" for k in engines if k in acc)
        lines += [f"{acc['task']} dev accuracy ({acc['rows']} rows, max_seq_length {acc['max_seq_length']}; "
                  f"ORT fp32 holds the PyTorch weights): {got}.", ""]
    else:
        lines += [f"Dev accuracy not measured: {acc['skipped']}", ""]
    s = r["sizes"]
    names = {"fp32_onnx_bytes": "fp32 ONNX", "dynamic_int8_onnx_bytes": "dynamic INT8 ONNX",
             "openvino_nncf_int8_ir_bytes": "NNCF INT8 IR", "ours_onnx_bytes": "ours (model.onnx)",
             "ours_openvino_onnx_bytes": "ours (model.ov.onnx)", "also_openvino_onnx_bytes": "second (model.ov.onnx)"}
    lines += ["Sizes: " + ", ".join(f"{names.get(k, k)} {v / 1e6:.1f} MB" for k, v in s.items() if v) + ".", ""]
    for th in sorted({x["threads"] for x in r["results"]}):
        lines += threads_section(r, engines, th)
    return "\n".join(lines)


def threads_section(r: dict, engines: list[str], th: int) -> list[str]:
    """One thread count's table, then ours' static-shape rows against NNCF's static one."""
    ref = f"speedup_vs_{INT8_REFERENCE}"
    has_ref = any(ref in x for x in r["results"])
    rows = [[x["batch"], x["seq"], *(f"{x[k]['median_ms']:.1f} ({x[k]['p90_ms']:.1f}) "
                                     f"×{x['speedup_vs_pytorch_fp32'][k]:.2f}"
                                     + (f" / ×{x[ref][k]:.2f}" if ref in x else "") for k in engines)]
            for x in r["results"] if x["threads"] == th]
    lines = [f"## {th} thread{'s' if th > 1 else ''} — median ms (p90 ms), speed-up vs PyTorch fp32"
             + (f" / vs {LABELS[INT8_REFERENCE]}" if has_ref else ""), "",
             *table(["batch", "seq", *(LABELS[k] for k in engines)], rows), ""]
    peer = "openvino_nncf_int8_static"
    for ours_static in ("ours_openvino_static", "ours_openvino_static_f32", "ours_openvino_static_kernels",
                        "also_openvino_static"):
        pair = [x for x in r["results"] if x["threads"] == th and peer in x and ours_static in x]
        if pair:  # the like-for-like ratio: both compiled for the cell's shape
            lines += [f"{LABELS[ours_static]} vs {LABELS[peer]}: " + ", ".join(
                f"batch {x['batch']} seq {x['seq']} ×{x[peer]['median_ms'] / x[ours_static]['median_ms']:.2f}"
                for x in pair) + ".", ""]
    return lines


def plot(r: dict, path: Path) -> None:
    engines = report_engines(r)
    ths = sorted({x["threads"] for x in r["results"]})
    with figure(path, figsize=(7 * len(ths), 4.4), dpi=110, nrows=1, ncols=len(ths), squeeze=False) as (fig, axes):
        for ax, th in zip(axes[0], ths):
            rows = [x for x in r["results"] if x["threads"] == th]
            xs = np.arange(len(rows))
            w = 0.8 / len(engines)
            for i, k in enumerate(engines):
                ax.bar(xs + (i - (len(engines) - 1) / 2) * w, [x["speedup_vs_pytorch_fp32"][k] for x in rows], w,
                       label=LABELS[k])
            ax.set_xticks(xs, [f"b{x['batch']}\ns{x['seq']}" for x in rows])
            ax.axhline(1.0, color="k", lw=0.6)
            ax.set_title(f"{th} thread{'s' if th > 1 else ''}")
            ax.set_ylabel("speed-up vs PyTorch fp32 (median)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"CPU latency, {r['machine']}, {r['date']}", fontsize=10)


if __name__ == "__main__":
    sys.exit(main())
