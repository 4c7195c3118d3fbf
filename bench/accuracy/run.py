"""Accuracy benchmark: dense vs NNCF INT8 PTQ vs magnitude 2:4 vs one-shot 2:4 ∩ INT8 vs ADMM, over seeds.

Every compressed row is produced by the `holoserve compress` CLI (so the numbers are what users get),
and each (task, seed) trains its dense teacher once: the first method run trains it, the others reuse
it through --teacher, and the NNCF row quantizes that same teacher. Every method spends the same
steps after the teacher and the same distillation. Finished runs are kept under --runs-dir and
reused, so the table can be built across several invocations. Results: <results>/accuracy.{json,md,png}.

    python -m bench.accuracy.run --data-dir "$GLUE_DIR" --tasks mrpc,stsb,cola,sst2 --seeds 0,1,2 --preset quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import dated_results
from bench.accuracy import decision
from bench.lib.report import figure, table, write_record
from holoserve.core.artifact import read_manifest
from holoserve.core.manifest import Manifest

ROOT = Path(__file__).resolve().parents[2]


def recipe(method: str, *settings: str, flags: tuple[str, ...] = ()) -> list[str]:
    """A row's `holoserve compress` arguments: the method, its flags, then one --set per preset FIELD=VALUE."""
    return ["--method", method, *flags, *(a for setting in settings for a in ("--set", setting))]


NEAREST = "projection=nearest"  # the rows measured before the OBS projection keep their own
OBS = "projection=obs"
MAGNITUDE = "mask_metric=magnitude"
ACT = ("mask_metric=activation", "mask_activation_power=1")  # the 2:4 mask by |w| x input-channel norm
ACT05 = ("mask_metric=activation", "mask_activation_power=0.5")  # |w| x sqrt(||x||) (RIA's exponent)
# one-shot spends the admm and qat budgets on QAT: all of it in qat, one epoch, at most the quick preset's 500
QAT1 = ("admm.epochs=0", "qat.epochs=1", "qat.max_steps=500")
METHODS = {  # row key -> (label, extra CLI arguments); the order is the run order (the first trains the teacher)
    "admm_int8": ("ADMM 2:4 ∩ INT8 + QAT", recipe("admm", MAGNITUDE, NEAREST)),
    "oneshot_int8": ("one-shot 2:4 ∩ INT8 + QAT", recipe("oneshot", MAGNITUDE, NEAREST)),
    "magnitude_ptq": ("magnitude 2:4 + fine-tune + PTQ", recipe("magnitude")),
    "admm_sparse": ("ADMM 2:4 (fp32)", recipe("admm", NEAREST, flags=("--no-quant",))),
    # the same two recipes choosing each 2:4 mask by |w| x input-channel norm (preset mask_metric)
    "oneshot_act_int8": ("one-shot 2:4 ∩ INT8 + QAT, activation-aware mask", recipe("oneshot", *ACT, NEAREST)),
    "admm_act_int8": ("ADMM 2:4 ∩ INT8 + QAT, activation-aware mask", recipe("admm", *ACT, NEAREST)),
    # |w| x sqrt(||x||) (RIA's exponent): between the two masks above
    "oneshot_act05_int8": ("one-shot 2:4 ∩ INT8 + QAT, activation-aware mask (‖x‖^0.5)",
                           recipe("oneshot", *ACT05, NEAREST)),
    "admm_act05_int8": ("ADMM 2:4 ∩ INT8 + QAT, activation-aware mask (‖x‖^0.5)", recipe("admm", *ACT05, NEAREST)),
    # the default recipe with the kept weights updated by OBS at the projection (SparseGPT's compensation),
    # masks as in the default, or chosen by SparseGPT's saliency
    "oneshot_act05_obs": ("one-shot 2:4 ∩ INT8 (OBS) + QAT, activation-aware mask (‖x‖^0.5)",
                          recipe("oneshot", *ACT05, OBS)),
    # the default recipe with distillation also on a perturbed copy of each training row (distill.augment=1)
    "oneshot_act05_obs_aug1": ("one-shot 2:4 ∩ INT8 (OBS) + QAT, KD also on perturbed rows",
                               recipe("oneshot", *ACT05, OBS, "distill.augment=1")),
    # the default recipe with a ReLU student (activation=relu) swapped before the projection (activation_ramp=0):
    # the FFN's GELU is the one float op per element that OpenVINO's INT8 GEMM post-ops pay for; this row
    # measures what the swap costs in accuracy
    "oneshot_act05_obs_relu": ("one-shot 2:4 ∩ INT8 (OBS) + QAT, ReLU student",
                               recipe("oneshot", *ACT05, OBS, "activation=relu", "activation_ramp=0")),
    # the same ReLU student, projected and calibrated with the teacher's GELU and moved to ReLU over the first
    # half of QAT (activation_ramp=0.5, what activation=relu does by default)
    "oneshot_act05_obs_relu_ramp": ("one-shot 2:4 ∩ INT8 (OBS) + QAT, ReLU student ramped over half of QAT",
                                    recipe("oneshot", *ACT05, OBS, "activation=relu", "activation_ramp=0.5")),
    "oneshot_obs_sal": ("one-shot 2:4 ∩ INT8 (OBS) + QAT, SparseGPT saliency mask",
                        recipe("oneshot", "mask_metric=saliency", OBS)),
    # ADMM with the same masks and the same OBS projection at its end as the default one-shot recipe
    "admm_act05_obs": ("ADMM 2:4 ∩ INT8 (OBS) + QAT, activation-aware mask (‖x‖^0.5)", recipe("admm", *ACT05, OBS)),
    # ADMM starting on the set, from the default's OBS projection of the teacher (admm_cfg.init=projection):
    # the mask may still move while it trains; OBS again at its end
    "admm_init_obs": ("ADMM from the OBS projection + QAT, activation-aware mask (‖x‖^0.5)",
                      recipe("admm", *ACT05, OBS, "admm_cfg.init=projection")),
    # the default recipe with the layer-wise ADMM projection (projection=admm) in place of OBS, then the same QAT
    "oneshot_act05_admm": ("one-shot 2:4 ∩ INT8 (layer-wise ADMM) + QAT, activation-aware mask (‖x‖^0.5)",
                           recipe("oneshot", *ACT05, "projection=admm")),
    # the default recipe with ADMM solving the kept values on the default's own mask (projection=admm_fixed_mask:
    # Z rounds onto the INT8 grid on that mask; its own damping and calibration batches), then the same QAT
    "oneshot_act05_admm_fixed": ("one-shot 2:4 ∩ INT8 (layer-wise ADMM on the default's mask) + QAT, activation-aware "
                                 "mask (‖x‖^0.5)", recipe("oneshot", *ACT05, "projection=admm_fixed_mask")),
    # the default recipe with R2's stable free mask (projection=admm_stable: a gradual mask, ALPS's rho, fitted
    # as admm_fixed_mask is), then the same QAT
    "oneshot_act05_admm_stable": ("one-shot 2:4 ∩ INT8 (layer-wise ADMM, stable free mask) + QAT, activation-aware "
                                  "mask (‖x‖^0.5)", recipe("oneshot", *ACT05, "projection=admm_stable")),
    # M4: the default recipe and R1 with QAT capped at one epoch of the training rows (at most the budget above)
    "oneshot_act05_obs_qat1": ("one-shot 2:4 ∩ INT8 (OBS) + one epoch of QAT, activation-aware mask (‖x‖^0.5)",
                               recipe("oneshot", *ACT05, OBS, *QAT1)),
    "oneshot_act05_admm_fixed_qat1": ("one-shot 2:4 ∩ INT8 (layer-wise ADMM on the default's mask) + one epoch of "
                                      "QAT, activation-aware mask (‖x‖^0.5)",
                                      recipe("oneshot", *ACT05, "projection=admm_fixed_mask", *QAT1)),
    # ADMM end to end: the layer-wise ADMM projection, then QAT with the ADMM penalty kept on (--method admm_guided)
    "admm_guided": ("layer-wise ADMM + ADMM-guided QAT, activation-aware mask (‖x‖^0.5)",
                    recipe("admm_guided", *ACT05)),
    # the default recipe with QAT also training the TensorRT placement's extra quantizers (for model.trt.onnx)
    "oneshot_act05_trtqat": ("one-shot 2:4 ∩ INT8 + QAT, activation-aware mask (‖x‖^0.5), TensorRT QAT",
                             recipe("oneshot", *ACT05, "tensorrt_qat=true", NEAREST)),
}
PEER = "nncf_ptq"  # NNCF INT8 PTQ of the same teacher (dense weights)
LABELS = {"dense": "dense teacher", PEER: "NNCF INT8 PTQ (dense W)", **{k: v[0] for k, v in METHODS.items()}}
COLUMNS = ("dense", PEER, "magnitude_ptq", "oneshot_int8", "oneshot_act_int8", "oneshot_act05_int8", "admm_sparse",
           "admm_int8", "admm_act_int8", "admm_act05_int8", "oneshot_act05_obs", "oneshot_act05_obs_aug1",
           "oneshot_act05_obs_relu", "oneshot_act05_obs_relu_ramp", "oneshot_obs_sal", "admm_act05_obs",
           "admm_init_obs", "oneshot_act05_admm", "oneshot_act05_admm_fixed", "oneshot_act05_admm_stable",
           "oneshot_act05_obs_qat1", "oneshot_act05_admm_fixed_qat1", "admm_guided", "oneshot_act05_trtqat")
BASELINES = ("magnitude_ptq", "oneshot_int8", "oneshot_act_int8", "oneshot_act05_int8", "oneshot_act05_obs",
             "oneshot_act05_obs_aug1", "oneshot_act05_obs_relu", "oneshot_act05_obs_relu_ramp",
             "oneshot_obs_sal", "oneshot_act05_obs_qat1")  # the 2:4 ∩ INT8 recipes ADMM has to beat
# the rows whose projection is slower than the default's: with --equal-time (the default) their QAT gives up the
# steps that extra time would train, so every row spends the default recipe's wall time
EQUAL_TIME_ROWS = ("oneshot_act05_admm", "oneshot_act05_admm_fixed", "oneshot_act05_admm_stable",
                   "oneshot_act05_admm_fixed_qat1", "admm_guided")
ADMM_ROWS = ("admm_int8", "admm_act_int8", "admm_act05_int8", "admm_act05_obs", "admm_init_obs", "oneshot_act05_admm",
             "oneshot_act05_admm_fixed", "oneshot_act05_admm_stable", "oneshot_act05_admm_fixed_qat1", "admm_guided")


def run_one(task: str, seed: int, key: str, args, teacher: Path | None, extra: tuple[str, ...] = ()) -> Path | None:
    out = args.runs_dir / f"{task}-s{seed}-{key}"
    if (out / "manifest.json").is_file():
        print(f"[{task}/s{seed}/{key}] reusing {out}", flush=True)
        return out
    data = ["--task", task, *_user_data_args(args, with_train=True)] if args.train else \
        ["--task", task, "--data-dir", args.data_dir]
    cmd = [sys.executable, "-m", "holoserve", "compress", *data,
           "--out", str(out), "--preset", args.preset, "--seed", str(seed), "--no-progress", *METHODS[key][1]]
    if teacher is not None:
        cmd += ["--teacher", str(teacher)]
    if args.model:  # also with a teacher: the run records (and may tokenize with) the base model
        cmd += ["--model", str(args.model)]
    for flag in ("max_steps", "train_limit", "max_seq_length", "threads", "device"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for item in (*args.set, *extra):
        cmd += ["--set", item]
    print(f"[{task}/s{seed}/{key}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    print(f"[{task}/s{seed}/{key}] rc={rc} in {time.perf_counter() - t0:.0f}s", flush=True)
    return out if rc == 0 and (out / "manifest.json").is_file() else None


_SCORES: dict[Path, dict] = {}
_DATA = None  # holoserve.data.sources.DataOptions for the user's own files (--train/--dev), else None


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
        from holoserve.compress.evaluate import EvalOptions, evaluate_checkpoint

        _SCORES[path] = evaluate_checkpoint(path, EvalOptions(data_dir=data_dir, data=_DATA))["metrics"]
    return _SCORES[path], "holoserve eval"


def run_record(path: Path, data_dir: str | None) -> dict:
    """One finished checkpoint: its dev score (re-scored by `holoserve eval`), steps and wall time."""
    m = read_manifest(path)
    primary, t = m.metrics.primary, m.training
    metrics, source = scored(path, data_dir, m)
    phases = t.get("phases", {})
    return {
        "value": metrics[primary], "all": metrics, "scored_by": source, "manifest_value": m.metrics.compressed[primary],
        "metric": primary, "dev_rows": m.metrics.dev_rows, "dense": m.metrics.dense[primary],
        "max_seq_length": m.max_seq_length,
        "steps": {k: v.get("steps") for k, v in phases.items() if isinstance(v, dict) and "steps" in v},
        "dense_seconds": (phases.get("dense") or {}).get("seconds"),
        "wall_seconds": t.get("wall_seconds"), "machine": t.get("machine"), "train_rows": t.get("train_rows"),
        "checkpoint": path.name, "equal_time": (phases.get("projection") or {}).get("equal_time"),
        "extra": m.metrics.model_dump(include={"after_projection", "one_shot", "sparse_fp32"}, exclude_none=True),
    }


def _stats(xs: list[float]) -> dict | None:
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs),
            "values": xs}


def summarize(task: str, per_seed: dict[int, dict[str, dict]]) -> dict:
    """Mean ± std over seeds of every column for one task; `per_seed[seed][key]` is a run record
    (the dense column comes from the teacher each seed's runs share)."""
    per_seed = {seed: runs for seed, runs in per_seed.items() if runs}  # a seed with no finished run yet
    row: dict = {"task": task, "seeds": sorted(per_seed), "per_seed": per_seed, "columns": {}}

    def value(runs: dict, key: str) -> float:
        return next(iter(runs.values()))["dense"] if key == "dense" else runs[key]["value"]

    for key in COLUMNS:
        vals = [value(runs, key) for runs in per_seed.values() if key == "dense" or key in runs]
        if (st := _stats(vals)) is not None:
            recs = [runs[key] for runs in per_seed.values() if key in runs] if key != "dense" else []
            walls = [r["wall_seconds"] for r in recs if r.get("wall_seconds") is not None]
            st["wall_seconds"] = round(statistics.fmean(walls), 1) if walls else None
            st["steps"] = recs[0].get("steps") if recs else None
            row["columns"][key] = st
    first = next((r for runs in per_seed.values() for r in runs.values()), None)
    if first:
        row["metric"], row["dev_rows"] = first["metric"], first["dev_rows"]
    cols = row["columns"]
    # % of dense: the column's mean over the dense teachers' mean on the same seeds, so a column that has not
    # run on every seed yet is not divided by the other seeds' teachers
    for key, st in cols.items():
        if key == "dense":
            st["kept"] = 1.0
            continue
        pairs = [(runs[key]["value"], runs[key]["dense"]) for runs in per_seed.values()
                 if key in runs and runs[key].get("dense")]
        st["kept"] = statistics.fmean(v for v, _ in pairs) / statistics.fmean(d for _, d in pairs) if pairs else None
    # the seeds on which every column ran: comparisons across columns (overall) use only those
    common = [seed for seed, runs in per_seed.items() if all(k == "dense" or k in runs for k in cols)]
    row["common_seeds"] = sorted(common)
    for key, st in cols.items():
        vals = [value(per_seed[seed], key) for seed in common]
        st["common_mean"] = statistics.fmean(vals) if vals else None
    return row


def fmt(x):
    return "—" if x is None else f"{100 * x:.2f}"


def fmt_stat(st: dict | None) -> str:
    if not st:
        return "—"
    return f"{100 * st['mean']:.2f}" + (f" ± {100 * st['std']:.2f}" if st["n"] > 1 else "")


def overall(rows: list[dict]) -> dict:
    """Mean over tasks of each column's per-task mean, over the tasks where every column ran (and within a
    task over the seeds on which every column ran), and the best ADMM 2:4 ∩ INT8 row's margin over the
    best baseline."""
    keys = [k for k in COLUMNS if all(k in r["columns"] for r in rows)] if rows else []

    def task_mean(st: dict) -> float:
        return st["common_mean"] if st.get("common_mean") is not None else st["mean"]

    means = {k: statistics.fmean(task_mean(r["columns"][k]) for r in rows) for k in keys}
    out: dict = {"tasks": [r["task"] for r in rows], "means": means}
    base = [means[k] for k in BASELINES if k in means]
    admm = [means[k] for k in ADMM_ROWS if k in means]
    if admm and base:
        out["admm_margin_over_best_baseline"] = max(admm) - max(base)
    ranked = sorted((k for k in means if k not in ("dense", PEER, "admm_sparse")), key=lambda k: -means[k])
    out["best_2to4_int8"] = ranked[0] if ranked else None
    return out


PAIRED_BASE = "oneshot_act05_obs"  # the default recipe: every other 2:4 ∩ INT8 row is paired with it by seed


def paired(rows: list[dict], base: str = PAIRED_BASE) -> dict:
    """Each trained row minus `base`, seed by seed (same teacher, same dev rows): per task the mean, std and
    seeds of the differences, and their mean over the tasks where the row has a pair on every task."""
    out: dict = {"base": base, "rows": {}}
    for key in COLUMNS:
        if key in ("dense", PEER, base):
            continue
        per_task = {}
        for r in rows:
            diffs = {int(seed): runs[key]["value"] - runs[base]["value"] for seed, runs in r["per_seed"].items()
                     if key in runs and base in runs}
            if diffs:
                per_task[r["task"]] = {**_stats(list(diffs.values())), "seeds": sorted(diffs)}
        if per_task:
            tasks_mean = statistics.fmean(st["mean"] for st in per_task.values()) \
                if len(per_task) == len(rows) and len(rows) > 1 else None
            out["rows"][key] = {"tasks": per_task, "mean_over_tasks": tasks_mean}
    return out


def task_row(r: dict, shown: list[str], seeds: list[int]) -> list[str]:
    """A task's row of the main table: each column's mean ± std, its % of the dense teacher and, where it has not
    run on every seed, on how many."""
    cells = []
    for k in shown:
        st = r["columns"].get(k)
        kept = f" ({100 * st['kept']:.1f} %)" if st and k != "dense" and st.get("kept") else ""
        part = f" [{st['n']} of {len(r['seeds'])} seeds]" if st and st["n"] < len(r["seeds"]) else ""
        cells.append(fmt_stat(st) + kept + part)
    n = "" if r["seeds"] == seeds else f" (seed{'s' if len(r['seeds']) > 1 else ''} {', '.join(map(str, r['seeds']))})"
    return [f"{r['task']}{n}", r.get("metric", "—"), *cells]


def paired_row(key: str, p: dict, tasks: list[str]) -> list[str]:
    """A row's differences from the paired base: per task mean ± std [seeds], then the mean over tasks."""
    cells = [(f"{100 * st['mean']:+.2f}" + (f" ± {100 * st['std']:.2f}" if st["n"] > 1 else "")
              + f" [{','.join(map(str, st['seeds']))}]") if (st := p["tasks"].get(t)) else "—" for t in tasks]
    m = p.get("mean_over_tasks")
    return [LABELS[key], *cells, "—" if m is None else f"{100 * m:+.2f}"]


def steps_row(r: dict, trained: list[str]) -> list[str]:
    """A task's steps per phase and mean wall time per trained row, after the teacher's own."""
    recs = [x for runs in r["per_seed"].values() for x in runs.values()]
    teacher = next((x for x in recs if x.get("dense_seconds") is not None), {})
    cells = []
    for k in trained:
        st = r["columns"].get(k)
        if not st:
            cells.append("—")
            continue
        steps = {p: n for p, n in (st.get("steps") or {}).items() if p != "dense" and n}
        cells.append(" + ".join(f"{n} {p}" for p, n in steps.items()) + f"; {st.get('wall_seconds')} s")
    return [r["task"], f"{(teacher.get('steps') or {}).get('dense', '—')} / {teacher.get('dense_seconds', '—')}",
            *cells]


def _seed_cell(rec: dict | None, base: dict | None) -> str:
    """One run of the per-seed table: its score, its difference from the default on that seed, its score right after
    the projection (as its manifest scored it) and the QAT steps the equal-time rule took from it."""
    if rec is None:
        return "—"
    parts = [] if base is None or rec is base else [f"{100 * (rec['value'] - base['value']):+.2f}"]
    after = ((rec.get("extra") or {}).get("after_projection") or {}).get(rec["metric"])
    if after is not None:
        parts.append(f"after proj {fmt(after)}")
    if et := rec.get("equal_time"):
        parts.append(f"{et['steps_given_up']} of {et['steps_given_up'] + et['qat_steps']} QAT steps given up")
    return fmt(rec["value"]) + (f" ({'; '.join(parts)})" if parts else "")


def seed_rows(rows: list[dict], keys: list[str], base: str = PAIRED_BASE) -> list[list[str]]:
    """The per-seed table under the paired one: each task and seed with its teacher, the default recipe and every
    row paired with it."""
    out = []
    for r in rows:
        for seed, runs in sorted(r["per_seed"].items(), key=lambda kv: int(kv[0])):
            b = runs.get(base)
            first = next(iter(runs.values()))
            out.append([r["task"], str(seed), fmt(first["dense"]), *(_seed_cell(runs.get(k), b) for k in keys)])
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    rows = [r for r in rows if r["columns"]]
    seeds = sorted({s for r in rows for s in r["seeds"]})
    shown = [k for k in COLUMNS if any(k in r["columns"] for r in rows)]  # columns that ran
    trained = [k for k in shown if k not in ("dense", PEER)]  # the rows `holoserve compress` wrote
    lines = [
        f"# Accuracy: {meta['model']}, preset `{meta['preset']}`, seeds {', '.join(map(str, seeds))} "
        f"({meta['date']}, {meta['machine']})", "",
        "Dev metric ×100, mean ± std over seeds (% of the dense teacher in brackets).", "",
        *([("Joined from " + "; ".join(f"seeds {', '.join(map(str, j['seeds_taken'])) or 'none'} of `{j['folder']}` "
                                       f"({j['date']})" for j in meta["joined_from"])
            + " (`--from-json`, repeated): each seed's rows and teacher come from one call."), ""]
          if meta.get("joined_from") else []),
    ]
    ov = meta.get("overall") or {}
    means = [["**mean over tasks**", "", *(fmt(ov["means"].get(k)) for k in shown)]] \
        if ov.get("means") and len(rows) > 1 else []
    lines += table(["task", "metric", *(LABELS[k] for k in shown)],
                   [*(task_row(r, shown, seeds) for r in rows), *means])
    if ov.get("best_2to4_int8"):
        lines += ["", f"Best 2:4 ∩ INT8 recipe on the mean: **{LABELS[ov['best_2to4_int8']]}**."
                  + (f" ADMM's margin over the best baseline: {100 * ov['admm_margin_over_best_baseline']:+.2f} points."
                     if "admm_margin_over_best_baseline" in ov else "")
                  + ("".join(f" Compared on the seeds every column ran "
                             f"({r['task']}: {', '.join(map(str, r['common_seeds']))})."
                             for r in rows if r.get("common_seeds") is not None and r["common_seeds"] != r["seeds"]))]
    pair = paired(rows)
    if pair.get("rows"):
        tasks = [r["task"] for r in rows]
        seed_keys = [pair["base"], *pair["rows"]]  # the per-seed table's columns: the default, then the paired rows
        lines += ["", f"Paired by seed against **{LABELS[pair['base']]}** (the row minus it on the same seed, teacher "
                  "and dev rows; ×100, mean ± std [seeds]):", "",
                  *table(["row", *tasks, "mean over tasks"],
                         [paired_row(key, p, tasks) for key, p in pair["rows"].items()]),
                  *decision.markdown(meta.get("decision") or [], LABELS),
                  "", "Per seed (in brackets: the difference from the default on that seed, the score right after the "
                  "projection as the manifest scored it, and the QAT steps the equal-time rule took):", "",
                  *table(["task", "seed", "dense teacher", *(LABELS[k] for k in seed_keys)],
                         seed_rows(rows, seed_keys, pair["base"]))]
    lines += ["", "Steps per phase after the teacher and mean wall time per run (s; the dense teacher, "
              "trained once per task and seed, is in the first method's time and listed apart):", "",
              *table(["task", "teacher steps / s", *(LABELS[k] for k in trained)],
                     [steps_row(r, trained) for r in rows])]
    peer = meta.get("peer") or {}
    if peer:
        lines += ["", f"NNCF row: the same teacher exported to ONNX, `nncf.quantize` (transformer preset) on the first "
                  f"{peer.get('calibration_rows')} training rows (NNCF {peer.get('nncf')}), scored through OpenVINO "
                  f"{peer.get('openvino')} on the same dev rows; its weights stay dense."]
    variants = meta.get("variants") or []
    if variants:
        lines += ["", "Other ADMM 2:4 ∩ INT8 runs (the same dense teacher; schedule = steps @ peak lr):", "",
                  *table(["task", "run", "ADMM", "QAT", "after ADMM (fp32)", "after hard projection",
                          "final (INT8 W+A)", "wall s"],
                         [[v["task"], v["name"], v["admm"], v["qat"], fmt(v.get("after_admm")),
                           fmt(v.get("after_projection")), fmt(v["value"]), v["wall_seconds"]] for v in variants])]
    lines += ["", "INT8 rows are scored by `holoserve eval` (int8 × int8 products summed exactly, as the exported "
              "model's int32 GEMMs do; accuracy.json keeps each manifest's own score as manifest_value). "
              f"{meta['notes']}", ""]
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


def can_plot(path: Path) -> bool:
    """Whether matplotlib is installed; says which plot is left out where it is not (e.g. a GPU image: the JSON
    and Markdown carry everything)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: no {path.name}", flush=True)
        return False
    return True


def plot(rows: list[dict], path: Path, meta: dict) -> None:
    import numpy as np

    if not can_plot(path):
        return

    rows = [r for r in rows if r["columns"]]
    if not rows:
        return
    keys = [k for k in COLUMNS if any(k in r["columns"] for r in rows)]

    def seeds_label(r: dict) -> str:
        ns = sorted({st["n"] for st in r["columns"].values()})
        return f"n={ns[0]}" if len(ns) == 1 else f"n={ns[0]}–{ns[-1]}"

    with figure(path, figsize=(max(7.0, 3 + 2.8 * len(rows)), 5.0 + 0.18 * len(keys))) as (fig, ax):
        width = 0.8 / len(keys)
        x = np.arange(len(rows))
        for i, key in enumerate(keys):
            # % of each task's dense teacher, so tasks with different metrics share one axis
            vals = [100 * r["columns"][key]["kept"] if key in r["columns"] and r["columns"][key].get("kept") else np.nan
                    for r in rows]
            errs = [100 * r["columns"][key]["std"] / r["columns"]["dense"]["mean"] if key in r["columns"]
                    and r["columns"].get("dense", {}).get("mean") else 0.0 for r in rows]
            bars = ax.bar(x + (i - (len(keys) - 1) / 2) * width, vals, width, yerr=errs, capsize=2, label=LABELS[key])
            ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=2)
        ax.axhline(99, color="grey", lw=0.8, ls="--")
        ax.set_xticks(x, [f"{r['task']} ({r.get('metric', '?')}, {seeds_label(r)})" for r in rows])
        ax.set_ylabel("% of the dense teacher's dev metric (mean ± std)")
        finite = [100 * r["columns"][k]["kept"] for r in rows for k in keys
                  if k in r["columns"] and r["columns"][k].get("kept")]
        ax.set_ylim(max(0.0, min(finite) - 4), max(finite) + 3)
        ax.set_title(f"{meta['model']}, preset {meta['preset']} — {meta['machine']}", fontsize=9)
        # below the axes (the bars fill them); one label per line where a few tasks leave the figure narrow
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1 if len(rows) < 3 else 3)


def plot_paired(pair: dict, path: Path, meta: dict) -> None:
    """Each paired row's per-seed differences from the default recipe, per task (dots), their mean (a bar) and the
    decision rule's per-task floor (dashed): what the decision reads, at a glance."""
    if not pair.get("rows") or not can_plot(path):
        return
    tasks = list(dict.fromkeys(t for p in pair["rows"].values() for t in p["tasks"]))
    keys = list(pair["rows"])
    width = 0.8 / len(keys)
    with figure(path, figsize=(max(6.0, 1.5 + 1.8 * len(tasks)), 4.6)) as (fig, ax):
        for i, key in enumerate(keys):
            color = f"C{i}"
            label = LABELS[key]  # once per row, on its first bar
            for j, task in enumerate(tasks):
                st = pair["rows"][key]["tasks"].get(task)
                if not st:
                    continue
                x = j + (i - (len(keys) - 1) / 2) * width
                ax.bar(x, 100 * st["mean"], width * 0.9, color=color, alpha=0.35, label=label)
                label = None
                ax.scatter([x] * st["n"], [100 * v for v in st["values"]], s=12, color=color, zorder=3)
        for j, task in enumerate(tasks):
            floor = decision.FLOOR.get(task, decision.TASK_FLOOR)
            ax.hlines(floor, j - 0.45, j + 0.45, colors="grey", linestyles="dashed", lw=0.8,
                      label="the decision rule's floor for the task" if j == 0 else None)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_ylabel("difference from the default recipe\non the same seed (points)")
        ax.set_title(f"Paired by seed: {meta['model']}, preset {meta['preset']} — {meta['machine']}", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1)


def write_report(rows: list[dict], meta: dict, results: Path) -> None:
    meta["overall"] = overall([r for r in rows if r["columns"]])
    meta["paired"] = paired([r for r in rows if r["columns"]])
    meta["decision"] = decision.decide(meta["paired"], meta.get("full_check"))
    write_record({"meta": meta, "rows": rows}, results, "accuracy", lambda r: markdown(r["rows"], r["meta"]))
    plot(rows, results / "accuracy.png", meta)
    plot_paired(meta["paired"], results / "paired.png", meta)
    print(markdown(rows, meta))


def full_check(path: Path | None) -> dict[str, float] | None:
    """--full-check: each row's paired mean difference over the tasks of a full-preset accuracy.json (points)."""
    if path is None:
        return None
    try:
        rows = [r for r in json.loads(path.read_text())["rows"] if r["columns"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"--full-check {path}: not an accuracy.json written by this script ({type(e).__name__}: {e})")
    if len(rows) < 2:
        sys.exit(f"--full-check {path}: it holds {len(rows)} task(s); the rule's check needs two or more")
    return {k: 100 * p["mean_over_tasks"] for k, p in paired(rows)["rows"].items()
            if p.get("mean_over_tasks") is not None}


def rebuild(sources: list[Path], results: Path, check: dict[str, float] | None = None) -> int:
    """The tables of one or more accuracy.json files summarized again from their per-seed run records.

    Several files (runs of the same preset made in separate calls, e.g. seeds 0-1 and then 2-3 on a GPU
    lent for a few minutes at a time) are joined per task and seed. A seed that a later file holds
    replaces that seed of an earlier file whole: each row of a seed is paired with the teacher of the
    call that trained it, so rows of one seed are never mixed across calls."""
    per_task: dict[str, dict[int, dict]] = {}
    origin: dict[tuple[str, int], int] = {}  # (task, seed) -> the file it is taken from
    metas = []
    for source in sources:
        try:
            old = json.loads(source.read_text())
            for r in old["rows"]:
                for seed, runs in r["per_seed"].items():
                    per_task.setdefault(r["task"], {})[int(seed)] = runs
                    origin[(r["task"], int(seed))] = len(metas)
            metas.append(old["meta"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            sys.exit(f"--from-json {source}: not an accuracy.json written by this script ({type(e).__name__}: {e})")
    presets = {m.get("preset") for m in metas}
    if len(presets) > 1:
        sys.exit(f"--from-json: the files were made with different presets ({', '.join(map(str, sorted(presets)))}); "
                 "join only runs of one preset")
    meta = dict(metas[-1])
    if len(sources) > 1:
        meta["seeds"] = sorted({s for seeds in per_task.values() for s in seeds})
        meta["date"] = ", ".join(dict.fromkeys(str(m.get("date")) for m in metas))
        meta["machine_detail"] = list(dict.fromkeys(d for m in metas for d in m.get("machine_detail", [])))
        meta["joined_from"] = [{"folder": src.resolve().parent.name, "date": m.get("date"),
                                "seeds_taken": sorted({s for (_, s), j in origin.items() if j == i})}
                               for i, (src, m) in enumerate(zip(sources, metas))]
    rows = [summarize(task, dict(sorted(seeds.items()))) for task, seeds in per_task.items()]
    meta["full_check"] = check if check is not None else meta.get("full_check")
    write_report(rows, meta, results)
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.accuracy.run", description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=os.environ.get("HOLOSERVE_DATA_DIR"))
    ap.add_argument("--tasks", default="mrpc,stsb,cola,sst2", help="GLUE shortcuts (ignored with --train)")
    ap.add_argument("--train", type=Path, help="your own labelled rows (CSV, TSV, JSONL, Parquet, saved folder)")
    ap.add_argument("--dev", type=Path, help="their dev rows (default: a held-out share of --train)")
    ap.add_argument("--text-column")
    ap.add_argument("--text-pair-column")
    ap.add_argument("--label-column")
    ap.add_argument("--no-header", action="store_true")
    ap.add_argument("--preset", default="quick")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--train-limit", type=int)
    ap.add_argument("--max-seq-length", type=int,
                    help="passed to holoserve compress: a fixed length instead of the one the data calls for")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--model", type=Path, help="base model folder (default: all-MiniLM-L6-v2 from its package)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), help="passed to holoserve compress")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="preset override passed to every run")
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "bench-accuracy")
    ap.add_argument("--results", type=Path, help="output folder (default bench/results/<today>-accuracy)")
    ap.add_argument("--only", help=f"comma-separated rows to run (with --report-only: to report), of "
                                   f"{', '.join([*METHODS, PEER])} (default: all)")
    ap.add_argument("--calibration-rows", type=int, default=256, help="NNCF row: training rows to calibrate on")
    ap.add_argument("--report-only", action="store_true", help="rebuild the tables from finished runs only")
    ap.add_argument("--no-equal-time", dest="equal_time", action="store_false",
                    help=f"let the ADMM projection rows ({', '.join(EQUAL_TIME_ROWS)}) keep every QAT step instead of "
                         "giving up the ones their extra projection time would train")
    ap.add_argument("--full-check", type=Path, metavar="ACCURACY_JSON",
                    help="an accuracy.json of a full-preset run on two tasks or more: the decision rule's check")
    ap.add_argument("--notes", default="")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=CHECKPOINT",
                    help="also list this ADMM 2:4 ∩ INT8 checkpoint (e.g. a tuning run) in the variants table")
    ap.add_argument("--from-json", type=Path, action="append", metavar="ACCURACY_JSON",
                    help="rebuild the tables and plot from an accuracy.json written elsewhere (e.g. on a GPU "
                         "machine whose runs are gone) into --results, without any run; repeat it to join "
                         "files of the same preset (a seed a later file holds replaces that seed whole)")
    return ap


def rows_and_seeds(ap: argparse.ArgumentParser, args) -> tuple[list[str], list[int]]:
    """The --only rows and the --seeds, checked; with --train, the user's data options (one task, named for
    the training file)."""
    global _DATA
    from holoserve.data.sources import data_options

    if args.train:  # the user's own rows: one task, named for the training file
        _DATA = data_options(args)
        args.tasks = Path(args.train).stem
    elif not args.data_dir:
        ap.error("--data-dir (or HOLOSERVE_DATA_DIR) is required, or --train FILE for your own rows")
    only = args.only.split(",") if args.only else [*METHODS, PEER]
    bad = [k for k in only if k not in METHODS and k != PEER]
    if bad:
        ap.error(f"--only: unknown row {', '.join(bad)}; choose from {', '.join([*METHODS, PEER])}")
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. 0,1,2")
    return only, seeds


def seed_runs(task: str, seed: int, only: list[str], args) -> tuple[dict[str, dict], dict]:
    """One (task, seed): every method's run record (run, reused, or left out as --only and --report-only say)
    and the NNCF row on the teacher they share; also the NNCF row's settings ({} without one)."""
    ckpts: dict[str, Path | None] = {}
    teacher = None
    for key in METHODS:
        path = args.runs_dir / f"{task}-s{seed}-{key}"
        if args.report_only and key not in only:  # a report covers only the --only rows
            ckpts[key] = None
        elif args.report_only or key not in only:
            ckpts[key] = path if (path / "manifest.json").is_file() else None
        else:
            ckpts[key] = run_one(task, seed, key, args, teacher, equal_time(task, seed, key, ckpts, args))
        state = args.runs_dir / f"{task}-s{seed}-{key}.state" / "teacher"
        if teacher is None and (state / "teacher.json").is_file():
            teacher = state  # trained by this run: the other methods reuse it
    runs = {k: run_record(p, args.data_dir) for k, p in ckpts.items() if p is not None}
    peer = peer_row(task, seed, teacher, runs, args) if PEER in only and teacher is not None and runs else {}
    return runs, peer


def equal_time(task: str, seed: int, key: str, ckpts: dict[str, Path | None], args) -> tuple[str, ...]:
    """An ADMM projection row's equal-time setting: the default recipe's QAT seconds per step on this seed, so the
    row's extra projection time comes out of its QAT steps (compress/equal_time.py); () for other rows."""
    if key not in EQUAL_TIME_ROWS or not args.equal_time:
        return ()
    base = ckpts.get(PAIRED_BASE)
    if base is None:
        sys.exit(f"[{task}/s{seed}/{key}] the equal-time rule needs the default recipe's run on this seed first: add "
                 f"{PAIRED_BASE} to --only (it is reused when finished), or pass --no-equal-time")
    qat = read_manifest(base).training["phases"]["qat"]
    if not qat["steps"] or qat["seconds"] <= 0:
        sys.exit(f"[{task}/s{seed}/{key}] the default recipe's run on this seed recorded {qat['seconds']} s over "
                 f"{qat['steps']} QAT steps, too little to time a step by: rerun it with more --max-steps, or pass "
                 "--no-equal-time")
    return (f"equal_time_step_seconds={qat['seconds'] / qat['steps']:.6g}",)


def peer_row(task: str, seed: int, teacher: Path, runs: dict[str, dict], args) -> dict:
    """Adds the NNCF INT8 PTQ row of `teacher` to `runs` (cached beside the runs; with --report-only only from that
    cache); returns its settings, or {} when there is none."""
    from bench.accuracy.nncf_ptq import cached_nncf_ptq
    from holoserve.data.sources import DataOptions

    first = next(iter(runs.values()))
    data = _DATA or DataOptions(data_dir=args.data_dir)
    cache = args.runs_dir / f"{task}-s{seed}-{PEER}.json"
    res = None if args.report_only and not cache.is_file() else \
        cached_nncf_ptq(cache, teacher, None if args.train else task, data,
                        max_seq_length=first["max_seq_length"], seed=seed, rows=args.calibration_rows)
    if res is None:
        return {}
    runs[PEER] = {**first, "value": res["metrics"][first["metric"]], "all": res["metrics"],
                  "scored_by": "OpenVINO", "steps": {}, "wall_seconds": res["seconds"],
                  "checkpoint": f"{task}-s{seed}-{PEER}.json", "extra": {}}
    return {k: res.get(k) for k in ("calibration_rows", "openvino", "nncf")}


def run_meta(rows: list[dict], seeds: list[int], peer_meta: dict, args) -> dict:
    """The report's header: date, model, preset, seeds, the machines the runs trained on, and the extras."""
    machines = sorted({r["machine"] for row in rows for runs in row["per_seed"].values() for r in runs.values()
                       if r.get("machine")})
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "model": "all-MiniLM-L6-v2",
        "preset": args.preset,
        "seeds": seeds,
        "machine": "; ".join(m.split(" (")[0] for m in machines) or "unknown",
        "machine_detail": machines,
        "notes": args.notes,
        "overrides": args.set,
        "peer": peer_meta,
        "variants": [variant(n, Path(p), args.data_dir) for n, p in (x.split("=", 1) for x in args.variant)],
    }


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    args.results = args.results or dated_results("accuracy")
    if args.from_json:
        return rebuild(args.from_json, args.results, full_check(args.full_check))
    only, seeds = rows_and_seeds(ap, args)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    rows, peer_meta = [], {}
    for task in args.tasks.split(","):
        per_seed: dict[int, dict[str, dict]] = {}
        for seed in seeds:
            per_seed[seed], peer = seed_runs(task, seed, only, args)
            peer_meta = peer or peer_meta
        rows.append(summarize(task, per_seed))
    write_report(rows, {**run_meta(rows, seeds, peer_meta, args), "full_check": full_check(args.full_check)},
                 args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
