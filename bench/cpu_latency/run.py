"""CPU latency, side by side in one run: PyTorch fp32 eager, ORT fp32, ORT dynamic INT8, our QDQ export.

    python bench/cpu_latency/run.py CHECKPOINT [--dense HF_FOLDER] [--data-dir GLUE_DIR]

- "ours": the checkpoint's exported model.onnx (`holoserve export`: 2:4 weights, static INT8 QDQ
  fused by ONNX Runtime into integer MatMuls).
- baselines come from the dense fine-tuned model (--dense, e.g. the teacher the compressor saved;
  default: the checkpoint's own fp32 weights): PyTorch fp32 in eager mode, its fp32 ONNX export in
  ONNX Runtime, and that export after onnxruntime.quantization.quantize_dynamic (int8 weights,
  dynamic activation ranges: what Optimum's dynamic quantization produces; it also makes the
  attention MatMuls integer). --fuse-baseline-attention gives both ORT baselines the attention
  fusion ours gets (export/fusion.py) instead, --baseline-classifier-row the last layer computed for
  the [CLS] row only, as ours has it.
- batch 1/8/32 x sequence 32/128 x 1 and 2 threads; every run uses full-length rows of random
  token ids; median and p90 over --runs timed runs after --warmup runs, the engines interleaved
  per shape so that background load hits them alike. Also SST-2 (or the checkpoint's task) dev
  accuracy of the dynamic INT8 model and ours, through ONNX Runtime.
Writes bench/results/cpu_latency.{json,md,png}. The machine is shared: `uptime` load averages
before and after are recorded.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from holoserve.core.files import atomic_savefig  # noqa: E402
from holoserve.core.machine import describe_cpu  # noqa: E402
from holoserve.core.ort import session  # noqa: E402

ENGINES = ("pytorch_fp32", "ort_fp32", "ort_dynamic_int8", "ours_qdq_int8")
LABELS = {
    "pytorch_fp32": "PyTorch fp32 (eager)",
    "ort_fp32": "ORT fp32",
    "ort_dynamic_int8": "ORT dynamic INT8",
    "ours_qdq_int8": "ours: 2:4 + static INT8 (ORT)",
}


def load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def uptime_text() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def ort_session(path: Path, threads: int):
    # ORT's pool threads spin-wait after each run; with engines interleaved in one process on a
    # small CPU that spinning starves the next engine's threads (PyTorch at 2 threads measured
    # 5x slower than at 1). Parked threads keep the comparison fair.
    return session(path, threads=threads, spinning=False, quiet=True)


def random_rows(rng, vocab: int, batch: int, seq: int, cls_id: int | None = None,
                sep_id: int | None = None) -> dict[str, np.ndarray]:
    """Full-length rows of random token ids, skipping the special/unused ids at the start of a BERT
    vocabulary; [CLS] ... [SEP] when both ids are given. No padding."""
    ids = rng.integers(min(1000, vocab // 2), vocab, size=(batch, seq), dtype=np.int64)
    if cls_id is not None and sep_id is not None:
        ids[:, 0], ids[:, -1] = cls_id, sep_id
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def percentile(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def accuracy(sess, batches, labels) -> float:
    outs = [sess.run(["logits"], b)[0] for b in batches]
    pred = np.concatenate(outs).argmax(1)
    return float((pred == labels).mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--dense", type=Path, default=None,
                    help="dense fine-tuned HF folder for the baselines (default: the checkpoint's own fp32 weights)")
    ap.add_argument("--data-dir", default=None, help="GLUE data dir for dev accuracy (or $HOLOSERVE_DATA_DIR)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default="cpu_latency")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--seqs", default="32,128")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dev-rows", type=int, default=None)
    ap.add_argument("--fuse-baseline-attention", action="store_true",
                    help="give the ORT baselines the MultiHeadAttention fusion ours gets (before dynamic "
                         "quantization). Default: attention as exported, which dynamic quantization turns into "
                         "integer MatMuls; on a 2-core x86 CPU that was the faster dynamic INT8 baseline at "
                         "sequence 32 and no slower at 128")
    ap.add_argument("--baseline-classifier-row", action="store_true",
                    help="give the ORT baselines the classifier-row rewrite ours gets (the last layer computed "
                         "for the [CLS] row only; before dynamic quantization). Without --fuse-baseline-attention "
                         "it stops at the attention output, as attention is then not one node")
    args = ap.parse_args(argv)
    if args.runs < 30:
        print("note: fewer than 30 timed runs per cell", file=sys.stderr)

    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModelForSequenceClassification

    from holoserve.export.onnx_export import encode_batches, make_tokenizer, torch_export_fp32
    from holoserve.core.artifact import load_artifact

    art = load_artifact(args.checkpoint)
    ours = art.export_path("onnxruntime")
    if ours is None or not ours.is_file():
        raise SystemExit(f"{art.path} has no ONNX Runtime export: run `holoserve export {art.path}` first")
    dense_dir = args.dense or art.path
    started = datetime.now(timezone.utc)
    uptime_before, load_before = uptime_text(), load_avg()

    work = Path(tempfile.mkdtemp(prefix="holoserve-bench-"))
    print(f"exporting the dense baselines from {dense_dir.name} ...", flush=True)
    dense_eager = AutoModelForSequenceClassification.from_pretrained(str(dense_dir), local_files_only=True,
                                                                     attn_implementation="eager").eval()
    fp32_onnx = work / "dense.fp32.onnx"
    torch_export_fp32(dense_eager, fp32_onnx)
    baseline_attention = "as exported (MatMul, Softmax)"
    baseline_classifier_row = "all rows computed"
    if args.fuse_baseline_attention or args.baseline_classifier_row:
        import onnx

        from holoserve.export.fusion import CONTRIB, FUSED_OP, fuse_attention, keep_classifier_row, tensor_ranks

        m = onnx.load(str(fp32_onnx))
        ranks = tensor_ranks(m) if args.baseline_classifier_row else {}  # before contrib ops hide shapes
        if args.fuse_baseline_attention:
            fused = fuse_attention(m, int(dense_eager.config.num_attention_heads))
            baseline_attention = f"{fused} blocks fused into {CONTRIB}.{FUSED_OP}, as in ours"
        if args.baseline_classifier_row:
            got = keep_classifier_row(m, ranks)
            baseline_classifier_row = f"last layer on the [CLS] row only, as in ours ({got['row_nodes']} nodes)"
        onnx.save(m, str(fp32_onnx))
    dyn_onnx = work / "dense.dynamic-int8.onnx"
    quantize_dynamic(str(fp32_onnx), str(dyn_onnx), weight_type=QuantType.QInt8)
    del dense_eager
    # PyTorch as users run it: default attention implementation, eval mode, inference_mode
    dense = AutoModelForSequenceClassification.from_pretrained(str(dense_dir), local_files_only=True).eval()
    sizes = {
        "fp32_onnx_bytes": fp32_onnx.stat().st_size,
        "dynamic_int8_onnx_bytes": dyn_onnx.stat().st_size,
        "ours_onnx_bytes": ours.stat().st_size,
    }

    tok = make_tokenizer(art)

    # ---------------------------------------------------------------- accuracy (dev, through ORT)
    acc = {}
    try:
        from holoserve.data.glue import read_split
        from holoserve.data.tasks import get_task

        task = get_task(art.task_name)
        rows = read_split(task, "dev", args.data_dir, limit=args.dev_rows)
        idx_b = list(encode_batches(tok, [r.text for r in rows], [r.text_pair for r in rows] if task.is_pair else None))
        order = np.concatenate([np.asarray(i) for i, _ in idx_b])
        labels = np.asarray([r.label for r in rows])[order]
        batches = [b for _, b in idx_b]
        for key, path in (("ort_fp32", fp32_onnx), ("ort_dynamic_int8", dyn_onnx), ("ours_qdq_int8", ours)):
            acc[key] = accuracy(ort_session(path, 2), batches, labels)
        acc["task"], acc["rows"] = task.name, len(rows)
        acc["max_seq_length"] = art.max_seq_length
        print("dev accuracy:", {k: v for k, v in acc.items()}, flush=True)
    except Exception as e:  # no data dir: latency only
        acc = {"skipped": str(e)}

    # ---------------------------------------------------------------- latency
    batches_ = [int(x) for x in args.batches.split(",")]
    seqs = [int(x) for x in args.seqs.split(",")]
    threads_ = [int(x) for x in args.threads.split(",")]
    rng = np.random.default_rng(0)
    vocab = dense.config.vocab_size
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    results = []
    for th in threads_:
        torch.set_num_threads(th)
        sessions = {
            "ort_fp32": ort_session(fp32_onnx, th),
            "ort_dynamic_int8": ort_session(dyn_onnx, th),
            "ours_qdq_int8": ort_session(ours, th),
        }
        for b in batches_:
            for s in seqs:
                feed = random_rows(rng, vocab, b, s, cls_id, sep_id)
                tfeed = {k: torch.from_numpy(v) for k, v in feed.items()}

                def run_torch():
                    with torch.inference_mode():
                        dense(**tfeed)

                fns = {"pytorch_fp32": run_torch}
                for k, sess in sessions.items():
                    fns[k] = (lambda sess=sess: sess.run(["logits"], feed))
                for fn in fns.values():
                    for _ in range(args.warmup):
                        fn()
                times = {k: [] for k in fns}
                for _ in range(args.runs):
                    for k, fn in fns.items():  # interleaved: background load hits every engine alike
                        t0 = time.perf_counter()
                        fn()
                        times[k].append((time.perf_counter() - t0) * 1000.0)
                row = {"threads": th, "batch": b, "seq": s}
                for k in ENGINES:
                    row[k] = {"median_ms": round(percentile(times[k], 50), 3), "p90_ms": round(percentile(times[k], 90), 3)}
                base = row["pytorch_fp32"]["median_ms"]
                row["speedup_vs_pytorch_fp32"] = {k: round(base / row[k]["median_ms"], 2) for k in ENGINES}
                results.append(row)
                print(f"threads {th} batch {b:>2} seq {s:>3}: " + "  ".join(
                    f"{k} {row[k]['median_ms']:.1f}ms (x{row['speedup_vs_pytorch_fp32'][k]})" for k in ENGINES), flush=True)

    import onnxruntime

    report = {
        "benchmark": "cpu_latency",
        "date": started.date().isoformat(),
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": describe_cpu(),
        "load": {"uptime_before": uptime_before, "uptime_after": uptime_text(), "loadavg_before": load_before,
                 "loadavg_after": load_avg(),
                 "note": "shared machine: other jobs may have been running during the measurement"},
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "python": platform.python_version()},
        "checkpoint": art.path.name,
        "dense_baseline": dense_dir.name,
        "method": {"runs": args.runs, "warmup": args.warmup, "inputs": "random token ids, full-length rows (no padding)",
                   "interleaved": True, "dynamic_int8": "onnxruntime.quantization.quantize_dynamic(weight_type=QInt8)",
                   "baseline_attention": baseline_attention,
                   "baseline_classifier_row": baseline_classifier_row},
        "sizes": sizes,
        "dev_accuracy": acc,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    from holoserve.core.files import atomic_write_json, atomic_write_text

    atomic_write_json(args.out / f"{args.name}.json", report)
    atomic_write_text(args.out / f"{args.name}.md", markdown(report))
    plot(report, args.out / f"{args.name}.png")
    print(f"wrote {args.out / args.name}.{{json,md,png}}")
    return 0


def markdown(r: dict) -> str:
    lines = [f"# CPU latency — {r['date']}, {r['machine']}", "",
             f"Checkpoint `{r['checkpoint']}`; baselines from `{r['dense_baseline']}`. "
             f"Median / p90 of {r['method']['runs']} runs after {r['method']['warmup']} warm-up runs, engines "
             f"interleaved, full-length rows. torch {r['versions']['torch']}, onnxruntime {r['versions']['onnxruntime']}. "
             f"Attention in the ORT baselines: {r['method'].get('baseline_attention', 'as exported')}; "
             f"their last layer: {r['method'].get('baseline_classifier_row', 'all rows computed')}.",
             f"Load before: `{r['load']['uptime_before']}`; after: `{r['load']['uptime_after']}` "
             "(shared machine: other jobs may have been running).", ""]
    acc = r["dev_accuracy"]
    if "skipped" not in acc:
        lines += [f"{acc['task']} dev accuracy ({acc['rows']} rows, ONNX Runtime, max_seq_length {acc['max_seq_length']}): "
                  f"dense fp32 {100 * acc['ort_fp32']:.2f}, dynamic INT8 {100 * acc['ort_dynamic_int8']:.2f}, "
                  f"ours {100 * acc['ours_qdq_int8']:.2f}.", ""]
    s = r["sizes"]
    lines += [f"ONNX sizes: fp32 {s['fp32_onnx_bytes'] / 1e6:.1f} MB, dynamic INT8 {s['dynamic_int8_onnx_bytes'] / 1e6:.1f} MB, "
              f"ours {s['ours_onnx_bytes'] / 1e6:.1f} MB.", ""]
    for th in sorted({x["threads"] for x in r["results"]}):
        lines += [f"## {th} thread{'s' if th > 1 else ''} — median ms (p90 ms), speed-up vs PyTorch fp32", "",
                  "| batch | seq | " + " | ".join(LABELS[k] for k in ENGINES) + " |",
                  "|---:|---:|" + "---:|" * len(ENGINES)]
        for x in r["results"]:
            if x["threads"] != th:
                continue
            cells = [f"{x[k]['median_ms']:.1f} ({x[k]['p90_ms']:.1f}) ×{x['speedup_vs_pytorch_fp32'][k]:.2f}" for k in ENGINES]
            lines.append(f"| {x['batch']} | {x['seq']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ths = sorted({x["threads"] for x in r["results"]})
    fig, axes = plt.subplots(1, len(ths), figsize=(6 * len(ths), 4.2), squeeze=False)
    for ax, th in zip(axes[0], ths):
        rows = [x for x in r["results"] if x["threads"] == th]
        xs = np.arange(len(rows))
        w = 0.2
        for i, k in enumerate(ENGINES):
            ax.bar(xs + (i - 1.5) * w, [x["speedup_vs_pytorch_fp32"][k] for x in rows], w, label=LABELS[k])
        ax.set_xticks(xs, [f"b{x['batch']}\ns{x['seq']}" for x in rows])
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_title(f"{th} thread{'s' if th > 1 else ''}")
        ax.set_ylabel("speed-up vs PyTorch fp32 (median)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"CPU latency, {r['machine']}, {r['date']}", fontsize=10)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
