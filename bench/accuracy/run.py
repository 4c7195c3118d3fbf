"""Accuracy benchmark: dense vs magnitude 2:4 + PTQ INT8 vs ADMM 2:4 vs ADMM 2:4 ∩ INT8 (+KD), per GLUE task.

Every row is produced by the `holoserve compress` CLI (so the numbers are what users get); each
task's dense teacher is trained once (by the ADMM 2:4 ∩ INT8 run) and reused by the other rows
through --teacher. Finished runs are kept under --runs-dir and reused, so the script can be
re-run to fill in what is missing. Results: bench/results/accuracy.{json,md,png}.

    python bench/accuracy/run.py --data-dir "$GLUE_DIR" --tasks sst2,mrpc,cola --preset quick
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from holoserve.core.artifact import read_manifest  # noqa: E402
from holoserve.core.files import atomic_savefig, atomic_write_json, atomic_write_text  # noqa: E402
from holoserve.core.manifest import Manifest  # noqa: E402

METHODS = {  # row key -> (label, extra CLI arguments)
    "admm_int8": ("ADMM 2:4 ∩ INT8 + KD", []),
    "admm_sparse": ("ADMM 2:4 (fp32) + KD", ["--no-quant"]),
    "magnitude_ptq": ("magnitude 2:4 + PTQ INT8", ["--method", "magnitude"]),
    "oneshot_int8": ("one-shot 2:4 ∩ INT8 + QAT + KD", ["--method", "oneshot"]),
}
COLUMNS = ("dense", "magnitude_ptq", "oneshot_int8", "admm_sparse", "admm_int8")


def run_one(task: str, key: str, args, runs: Path, teacher: Path | None, reuse: Path | None) -> Path | None:
    out = reuse if reuse else runs / f"{task}-{key}"
    if (out / "manifest.json").is_file():
        print(f"[{task}/{key}] reusing {out}", flush=True)
        return out
    data = ["--task", task, *_user_data_args(args, with_train=True)] if args.train else \
        ["--task", task, "--data-dir", args.data_dir]
    cmd = [sys.executable, "-m", "holoserve", "compress", *data,
           "--out", str(out), "--preset", args.preset, "--seed", str(args.seed), "--no-progress",
           *METHODS[key][1]]
    if teacher is not None:
        cmd += ["--teacher", str(teacher)]
    elif args.model:
        cmd += ["--model", str(args.model)]
    for flag in ("max_steps", "train_limit", "threads", "device"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for item in args.set:
        cmd += ["--set", item]
    print(f"[{task}/{key}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    print(f"[{task}/{key}] rc={rc} in {time.perf_counter() - t0:.0f}s", flush=True)
    return out if rc == 0 and (out / "manifest.json").is_file() else None


_SCORES: dict[Path, dict] = {}
_DATA = None  # holoserve.data.tabular.DataOptions for the user's own files (--train/--dev), else None


def _user_data_args(args, with_train: bool) -> list[str]:
    out = ["--train", str(args.train)] if with_train else []
    if args.dev:
        out += ["--dev", str(args.dev)]
    for flag in ("text_column", "text_pair_column", "label_column"):
        if getattr(args, flag):
            out += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    return out + (["--no-header"] if args.no_header else [])


def scored(path: Path, data_dir: str | None, manifest: Manifest) -> tuple[dict, str]:
    """The checkpoint's dev metrics as `holoserve eval` computes them now (INT8 checkpoints: integer-exact
    GEMMs, the numerics ONNX Runtime reproduces), or the manifest's when there is nothing to re-score."""
    rescore = _DATA.dev is not None if _DATA is not None else bool(data_dir)
    if not rescore or not (manifest.quantization and manifest.quantization.activations):
        return manifest.metrics.compressed, "manifest"
    if path not in _SCORES:
        from holoserve.compress.evaluate_cli import evaluate_checkpoint

        _SCORES[path] = evaluate_checkpoint(path, data_dir=data_dir, data=_DATA)["metrics"]
    return _SCORES[path], "holoserve eval"


def summarize(task: str, ckpts: dict[str, Path | None], data_dir: str | None = None) -> dict:
    row: dict = {"task": task, "runs": {}}
    for key, path in ckpts.items():
        if path is None:
            continue
        m = read_manifest(path)
        primary = m.metrics.primary
        row["metric"] = primary
        row["dev_rows"] = m.metrics.dev_rows
        row["dense"] = m.metrics.dense[primary]
        t = m.training
        metrics, source = scored(path, data_dir, m)
        row["runs"][key] = {
            "value": metrics[primary],
            "all": metrics,
            "scored_by": source,
            "manifest_value": m.metrics.compressed[primary],
            "preset": t.get("preset"),
            "steps": {k: v.get("steps") for k, v in t.get("phases", {}).items() if isinstance(v, dict) and "steps" in v},
            "wall_seconds": t.get("wall_seconds"),
            "machine": t.get("machine"),
            "train_rows": t.get("train_rows"),
            "checkpoint": path.name,
            "extra": m.metrics.model_dump(include={"after_projection", "one_shot", "sparse_fp32"}, exclude_none=True),
        }
        if key == "admm_int8":
            row["dense_phase"] = t.get("phases", {}).get("dense")
    if "dense" in row and "admm_int8" in row["runs"]:
        v = row["runs"]["admm_int8"]["value"]
        row["admm_int8_retained"] = v / row["dense"] if row["dense"] else None
        mag = row["runs"].get("magnitude_ptq", {}).get("value")
        row["admm_int8_beats_magnitude"] = None if mag is None else v > mag
    return row


def fmt(x):
    return "—" if x is None else f"{100 * x:.2f}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# Accuracy: {meta['model']} on GLUE dev ({meta['date']}, preset `{meta['preset']}`, {meta['machine']})",
        "",
        "| task | metric | dense | " + " | ".join(METHODS[k][0] for k in COLUMNS[1:]) + " | kept vs dense | beats magnitude |",
        "|" + " --- |" * (len(COLUMNS) + 4),
    ]
    for r in rows:
        runs = r["runs"]
        if not runs:
            lines.append(f"| {r['task']} | not run |" + " |" * (len(COLUMNS) + 2))
            continue
        kept = r.get("admm_int8_retained")
        beats = r.get("admm_int8_beats_magnitude")
        lines.append(
            f"| {r['task']} | {r.get('metric', '—')} | {fmt(r.get('dense'))} | "
            + " | ".join(fmt(runs.get(k, {}).get("value")) for k in COLUMNS[1:])
            + f" | {'—' if kept is None else f'{100 * kept:.1f}%'} | {'—' if beats is None else ('yes' if beats else 'no')} |"
        )
    lines += ["", "Wall time in seconds (the dense teacher is trained once per task; runs reusing it via --teacher "
              "exclude it) and steps per phase:", "",
              "| task | dense teacher | " + " | ".join(METHODS[k][0] for k in COLUMNS[1:]) + " | steps (dense / admm / qat) |",
              "|" + " --- |" * (len(COLUMNS) + 2)]
    for r in rows:
        runs = r["runs"]
        if not runs:
            continue
        st = runs.get("admm_int8", {}).get("steps", {})
        dense_s = (r.get("dense_phase") or {}).get("seconds", "—")
        lines.append(f"| {r['task']} | {dense_s} | " + " | ".join(
            str(runs.get(k, {}).get("wall_seconds", "—")) for k in COLUMNS[1:])
            + f" | {st.get('dense', '—')} / {st.get('admm', '—')} / {st.get('qat', '—')} |")
    for r in rows:
        mag = r["runs"].get("magnitude_ptq", {}).get("extra", {})
        if mag:
            lines += ["", f"{r['task']} magnitude baseline: one-shot 2:4 {fmt(mag.get('one_shot', {}).get(r['metric']))} → "
                      f"masked fine-tune (fp32) {fmt(mag.get('sparse_fp32', {}).get(r['metric']))} → "
                      f"PTQ INT8 {fmt(r['runs']['magnitude_ptq']['value'])}."]
    variants = meta.get("variants") or []
    if variants:
        lines += ["", "Every ADMM 2:4 ∩ INT8 run of this benchmark (the same dense teacher; schedule = steps @ peak lr):", "",
                  "| task | run | ADMM | QAT | after ADMM (fp32) | after hard projection | final (INT8 W+A) | wall s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for v in variants:
            lines.append(f"| {v['task']} | {v['name']} | {v['admm']} | {v['qat']} | {fmt(v.get('after_admm'))} | "
                         f"{fmt(v.get('after_projection'))} | {fmt(v['value'])} | {v['wall_seconds']} |")
    lines += ["", f"Metric values ×100. Dense = the fine-tuned teacher. INT8 results are scored by `holoserve eval` "
              "(int8 × int8 products summed exactly, as the exported model's int32 GEMMs do; accuracy.json keeps "
              f"each manifest's own score as manifest_value). {meta['notes']}", ""]
    return "\n".join(lines)


def variant(name: str, path: Path, data_dir: str | None = None) -> dict:
    m = read_manifest(path)
    t, met = m.training, m.metrics
    pc, primary = t["preset_config"], met.primary
    admm = t["phases"].get("admm", {})
    return {
        "task": m.task.name, "name": name, "checkpoint": path.name,
        "admm": f"{pc['admm']['steps']} @ {pc['admm']['lr']:g}", "qat": f"{pc['qat']['steps']} @ {pc['qat']['lr']:g}",
        "after_admm": (admm.get("dev_before_projection") or {}).get(primary),
        "after_projection": (met.after_projection or {}).get(primary),
        "value": scored(path, data_dir, m)[0][primary], "manifest_value": met.compressed[primary],
        "wall_seconds": t.get("wall_seconds"),
    }


def plot(rows: list[dict], path: Path, meta: dict) -> None:
    try:
        import matplotlib
    except ImportError:  # e.g. a GPU image without it: the JSON and Markdown still carry everything
        print(f"matplotlib is not installed: no {path.name}", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in rows if r["runs"]]  # tasks that were not run have nothing to draw
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(3 + 2.5 * len(rows), 4.2))
    lows = []
    labels = ["dense"] + [METHODS[k][0] for k in COLUMNS[1:]]
    width = 0.2
    x = np.arange(len(rows))
    for i, key in enumerate(COLUMNS):
        vals = [(r.get("dense") if key == "dense" else r["runs"].get(key, {}).get("value")) for r in rows]
        vals = [np.nan if v is None else 100 * v for v in vals]
        lows += [v for v in vals if not np.isnan(v)]
        bars = ax.bar(x + (i - 1.5) * width, vals, width, label=labels[i])
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
    ax.set_xticks(x, [f"{r['task']} ({r.get('metric', '?')})" for r in rows])
    ax.set_ylabel("dev metric ×100")
    ax.set_ylim(max(0.0, min(lows) - 6), min(100.0, max(lows) + 2))  # zoom: the differences are small
    ax.set_title(f"{meta['model']}, preset {meta['preset']} — {meta['machine']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")  # above the low-metric task (CoLA MCC)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=os.environ.get("HOLOSERVE_DATA_DIR"))
    ap.add_argument("--tasks", default="sst2,mrpc,cola", help="GLUE shortcuts (ignored with --train)")
    ap.add_argument("--train", type=Path, help="your own labelled rows (CSV, TSV, JSONL, Parquet, saved folder)")
    ap.add_argument("--dev", type=Path, help="their dev rows (default: a held-out share of --train)")
    ap.add_argument("--text-column")
    ap.add_argument("--text-pair-column")
    ap.add_argument("--label-column")
    ap.add_argument("--no-header", action="store_true")
    ap.add_argument("--preset", default="quick")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--train-limit", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--model", type=Path, help="base model folder (default: all-MiniLM-L6-v2 from its package)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), help="passed to holoserve compress")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="preset override passed to every run")
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "bench-accuracy")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--reuse", action="append", default=[], metavar="TASK=CHECKPOINT",
                    help="use an existing ADMM 2:4 ∩ INT8 checkpoint for TASK (its <ckpt>.state/teacher is reused too)")
    ap.add_argument("--only", help="comma-separated row keys to run (default: all)")
    ap.add_argument("--report-only", action="store_true", help="rebuild the tables from finished runs only")
    ap.add_argument("--notes", default="")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=CHECKPOINT",
                    help="also list this ADMM 2:4 ∩ INT8 checkpoint (e.g. a tuning run) in the variants table")
    args = ap.parse_args()
    global _DATA
    if args.train:  # the user's own rows: one task, named for the training file
        from holoserve.data.tabular import data_options

        _DATA = data_options(args)
        args.tasks = Path(args.train).stem
    elif not args.data_dir:
        ap.error("--data-dir (or HOLOSERVE_DATA_DIR) is required, or --train FILE for your own rows")
    reuse = dict(x.split("=", 1) for x in args.reuse)
    only = set(args.only.split(",")) if args.only else set(METHODS)
    rows = []
    for task in args.tasks.split(","):
        ckpts: dict[str, Path | None] = {}
        admm_path = Path(reuse[task]) if task in reuse else None
        if args.report_only:
            for key in METHODS:
                p = admm_path if key == "admm_int8" and admm_path else args.runs_dir / f"{task}-{key}"
                ckpts[key] = p if (p / "manifest.json").is_file() else None
        else:
            ckpts["admm_int8"] = run_one(task, "admm_int8", args, args.runs_dir, None, admm_path) \
                if "admm_int8" in only or admm_path else None
            main_ckpt = ckpts["admm_int8"] or admm_path or args.runs_dir / f"{task}-admm_int8"
            teacher = main_ckpt.with_name(main_ckpt.name + ".state") / "teacher"
            if not (teacher / "teacher.json").is_file():
                print(f"[{task}] no teacher at {teacher}; skipping the other rows", flush=True)
                teacher = None
            for key in ("admm_sparse", "magnitude_ptq", "oneshot_int8"):
                if key in only and teacher is not None:
                    ckpts[key] = run_one(task, key, args, args.runs_dir, teacher, None)
        rows.append(summarize(task, ckpts, args.data_dir))
    machines = sorted({r["machine"] for row in rows for r in row["runs"].values() if r.get("machine")})
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "model": "all-MiniLM-L6-v2",
        "preset": args.preset,
        "machine": "; ".join(m.split(" (")[0] for m in machines) or "unknown",
        "machine_detail": machines,
        "notes": args.notes,
        "variants": [variant(n, Path(p), args.data_dir) for n, p in (x.split("=", 1) for x in args.variant)],
    }
    args.results.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "rows": rows}
    atomic_write_json(args.results / "accuracy.json", payload)
    atomic_write_text(args.results / "accuracy.md", markdown(rows, meta))
    plot(rows, args.results / "accuracy.png", meta)
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
