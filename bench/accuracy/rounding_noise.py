"""How far a dev score moves when only float rounding changes, and where each runtime falls on that scale.

An INT8 model rounds every activation to a grid. A float difference of 1e-6 now and then moves a value
across a rounding boundary; the next layer then sees a whole step of difference, and that grows through
the layers. A runtime whose float ops round differently from the checkpoint's (another LayerNorm, Softmax
or Erf kernel, another vector width) therefore flips a few dev predictions against `holoserve eval`, in
either direction, without computing anything wrong.

This script measures that scale on the checkpoint's own `model.onnx`, which reproduces `holoserve eval`
prediction for prediction: it multiplies the position-embedding table by (1 + eps * N(0, 1)), a change of
the size of float rounding that reaches every token, for several eps and --repeats random draws, and
scores each copy through ONNX Runtime against the unchanged export. Then it scores OpenVINO on the
`openvino` export (f32 and its default precision, where installed and exported) against the same
reference. Per row of the table: the mean |logit difference|, the predictions that flip, and the dev
metric's difference (mean, sd, largest, and how many draws move it by more than --threshold points), and
how many draws `holoserve export`'s own check (holoserve.data.metrics.prediction_check) would accept.
The plot puts every draw and every runtime on one axis, mean |Δlogit| against Δ metric.

    python -m bench.accuracy.rounding_noise runs/minilm-sst2 --data-dir "$GLUE_DIR" \\
        --results bench/results/<today>-rounding-noise-sst2
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.accuracy.common import DevSet, command, dev_set, export_file, position_table, save
from bench.lib.report import figure, table
from holoserve.core.machine import describe_cpu

EPS = "1e-6,3e-6,1e-5,3e-5,1e-4"
OPENVINO_PRECISIONS = ("f32", "auto")


def difference(task, out: np.ndarray, ref: np.ndarray, labels: np.ndarray, ref_metric: float) -> dict:
    from holoserve.data.metrics import prediction_check, score

    metric = score(task, out, labels)[task.primary_metric]
    check, why = prediction_check(task, out, ref, labels)
    d = np.abs(out - ref)
    return {"mean_abs_logit_diff": float(d.mean()), "median_abs_logit_diff": float(np.median(d)),
            "flipped_predictions": check.get("changed_predictions"),  # None for a regression task
            "metric": float(metric), "metric_diff_points": round(100 * (metric - ref_metric), 4),
            "export_check_passes": why is None}


def summarise(draws: list[dict], threshold: float) -> dict:
    d = np.asarray([x["metric_diff_points"] for x in draws])
    flips = [x["flipped_predictions"] for x in draws if x["flipped_predictions"] is not None]
    return {"draws": len(draws), "mean_abs_logit_diff": float(np.mean([x["mean_abs_logit_diff"] for x in draws])),
            "flipped_mean": float(np.mean(flips)) if flips else None,
            "metric_diff_mean": float(d.mean()), "metric_diff_sd": float(d.std(ddof=1)) if len(d) > 1 else 0.0,
            "metric_diff_max_abs": float(np.abs(d).max()), "past_threshold": int((np.abs(d) > threshold + 1e-9).sum()),
            "export_check_passes": sum(x["export_check_passes"] for x in draws)}


def markdown(r: dict) -> str:
    m, t = r["meta"], r["meta"]["threshold_points"]
    lines = [f"# Rounding noise on the dev score ({m['date']}, {m['machine']})", "",
             f"Checkpoint `{m['checkpoint']}`, {m['task']} dev ({m['rows']} rows), {m['metric']}: `holoserve eval` "
             f"{'—' if m['eval_metric'] is None else format(m['eval_metric'], '.2f')} (manifest), `model.onnx` on "
             f"ONNX Runtime {m['reference_metric']:.2f}, the "
             f"reference below. Position-embedding table × (1 + eps · N(0, 1)), {m['repeats']} draws per eps.", "",
             *table(["change", "mean \\|Δlogit\\|", "flipped predictions", f"Δ {m['metric']} (points): mean ± sd",
                     "largest \\|Δ\\|", f"draws past {t}", "`holoserve export`'s check passes"],
                    [*map(perturbed_row, r["perturbed"]),
                     *(runtime_row(name, x, t) for name, x in r["runtimes"].items() if "skipped" not in x)])]
    skipped = {k: v["skipped"] for k, v in r["runtimes"].items() if "skipped" in v}
    lines += [""] + [f"Not run: {k}: {why}" for k, why in skipped.items()]
    lines += ["", f"Command: `{m['command']}` ({m['seconds']:.0f} s)."]
    return "\n".join(lines) + "\n"


def perturbed_row(row: dict) -> list[str]:
    """One eps's table row: its draws summarised."""
    s = row["summary"]
    flips = "—" if s["flipped_mean"] is None else f"{s['flipped_mean']:.1f} (mean)"
    return [f"eps {row['eps']:g}", f"{s['mean_abs_logit_diff']:.2g}", flips,
            f"{s['metric_diff_mean']:+.2f} ± {s['metric_diff_sd']:.2f}", f"{s['metric_diff_max_abs']:.2f}",
            f"{s['past_threshold']} of {s['draws']}", f"{s['export_check_passes']} of {s['draws']}"]


def runtime_row(name: str, x: dict, threshold: float) -> list[str]:
    """One runtime's table row, on the same scale as the draws'."""
    flips = "—" if x["flipped_predictions"] is None else str(x["flipped_predictions"])
    return [name, f"{x['mean_abs_logit_diff']:.2g}", flips, f"{x['metric_diff_points']:+.2f}",
            f"{abs(x['metric_diff_points']):.2f}", "yes" if abs(x["metric_diff_points"]) > threshold + 1e-9 else "no",
            "yes" if x["export_check_passes"] else "no"]


def plot(r: dict, path: Path) -> None:
    from matplotlib.ticker import NullFormatter

    with figure(path, figsize=(7, 4.2)) as (fig, ax):
        for row in r["perturbed"]:
            xs = [max(d["mean_abs_logit_diff"], 1e-9) for d in row["draws"]]
            ax.scatter(xs, [d["metric_diff_points"] for d in row["draws"]], s=14, alpha=0.6,
                       label=f"eps {row['eps']:g}")
        for name, x in r["runtimes"].items():
            if "skipped" not in x:
                ax.scatter([max(x["mean_abs_logit_diff"], 1e-9)], [x["metric_diff_points"]], marker="*", s=160,
                           edgecolor="black", label=name, zorder=3)
        t = r["meta"]["threshold_points"]
        ax.axhspan(-t, t, color="grey", alpha=0.15, lw=0)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # decades only: minor labels collide
        ax.set_xlabel("mean |Δlogit| against model.onnx on ONNX Runtime (each dot one draw)")
        ax.set_ylabel(f"Δ dev {r['meta']['metric']} (points)")
        ax.set_title(f"{r['meta']['checkpoint']}: dev score under rounding-sized changes (band ±{t})", fontsize=10)
        ax.legend(fontsize=7, ncol=2)


def parse_args(argv) -> tuple[argparse.Namespace, list[float]]:
    """The options, and --eps as numbers."""
    ap = argparse.ArgumentParser(prog="python -m bench.accuracy.rounding_noise", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--data-dir", required=True, help="the GLUE folder")
    ap.add_argument("--eps", default=EPS, help=f"relative changes of the position-embedding table (default {EPS})")
    ap.add_argument("--repeats", type=int, default=10, help="random draws per eps (default 10)")
    ap.add_argument("--threshold", type=float, default=0.2, help="points of dev metric counted as a move (0.2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results", type=Path, help="folder for rounding_noise.{json,md,png}; default: print only")
    args = ap.parse_args(argv)
    try:
        eps = [float(x) for x in args.eps.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--eps takes comma-separated numbers such as {EPS}, got {args.eps!r}") from None
    if not eps or min(eps) <= 0 or args.repeats < 2:
        raise SystemExit("--eps needs positive values and --repeats at least 2 (the sd needs two draws)")
    return args, eps


def perturbed_draws(model, k: int, dev: DevSet, ref: np.ndarray, ref_metric: float, eps: list[float], args) -> list:
    """Per eps, --repeats copies of the export with initializer `k` (the position table) × (1 + eps · N(0, 1)),
    each scored against the reference, and their summary."""
    import onnx
    from onnx import numpy_helper

    table_ = numpy_helper.to_array(model.graph.initializer[k]).copy()
    name = model.graph.initializer[k].name
    perturbed = []
    with tempfile.TemporaryDirectory(prefix="holoserve-noise-") as tmp:
        file = Path(tmp) / "perturbed.onnx"
        for e in eps:
            draws = []
            for seed in range(args.repeats):
                noise = np.random.default_rng(seed).standard_normal(table_.shape)
                model.graph.initializer[k].CopyFrom(
                    numpy_helper.from_array((table_ * (1 + e * noise)).astype(np.float32), name))
                onnx.save(model, str(file))
                draws.append(difference(dev.task, dev.ort_logits(file, args.threads), ref, dev.labels, ref_metric)
                             | {"seed": seed})
            s = summarise(draws, args.threshold)
            perturbed.append({"eps": e, "summary": s, "draws": draws})
            print(f"  eps {e:g}: mean |Δlogit| {s['mean_abs_logit_diff']:.2g}, flips {s['flipped_mean']}, "
                  f"Δ {s['metric_diff_mean']:+.2f} ± {s['metric_diff_sd']:.2f} points, past {args.threshold}: "
                  f"{s['past_threshold']}/{s['draws']}", flush=True)
    return perturbed


def openvino_runs(art, dev: DevSet, ref: np.ndarray, ref_metric: float, args) -> dict[str, dict]:
    """The `openvino` export on OpenVINO at each of OPENVINO_PRECISIONS against the reference, or why it did not run."""
    from holoserve.core.manifest import OPENVINO

    runtimes: dict[str, dict] = {}
    ov_path = art.export_path(OPENVINO)
    for precision in OPENVINO_PRECISIONS:
        key = f"OpenVINO {precision}"
        if ov_path is None or not ov_path.is_file():
            runtimes[key] = {"skipped": f"no openvino export (`holoserve export {args.checkpoint} --target openvino`)"}
            continue
        try:
            from holoserve.backends.openvino import compile_model, inference_precision
            compiled, _ = compile_model(ov_path, threads=args.threads, precision=precision)
        except Exception as e:  # OpenVINO not installed: said in the report, never silently
            runtimes[key] = {"skipped": str(e)}
            continue
        req = compiled.create_infer_request()
        out = dev.logits(lambda f: req.infer(f)[compiled.outputs[0]].copy(),
                         {i.get_any_name() for i in compiled.inputs})
        runtimes[key] = (difference(dev.task, out, ref, dev.labels, ref_metric)
                         | {"inference_precision": inference_precision(compiled)})
        print(f"  {key} ({runtimes[key]['inference_precision']}): {runtimes[key]}", flush=True)
    return runtimes


def main(argv=None) -> int:
    args, eps = parse_args(argv)
    import onnx

    from holoserve.core.artifact import load_artifact
    from holoserve.core.manifest import ONNXRUNTIME
    from holoserve.data.metrics import score

    t0 = time.time()
    art = load_artifact(args.checkpoint)
    path = export_file(art, args.checkpoint, ONNXRUNTIME, "model.onnx")
    dev = dev_set(art, args.data_dir)
    task = dev.task
    model = onnx.load(str(path))
    k = position_table(model)
    ref = dev.ort_logits(path, args.threads)
    ref_metric = score(task, ref, dev.labels)[task.primary_metric]
    name, shape = model.graph.initializer[k].name, tuple(model.graph.initializer[k].dims)
    print(f"{args.checkpoint.name}: {task.name} dev {task.primary_metric} {100 * ref_metric:.2f} on model.onnx "
          f"(the reference); perturbing {name} {shape}", flush=True)
    perturbed = perturbed_draws(model, k, dev, ref, ref_metric, eps, args)
    runtimes = openvino_runs(art, dev, ref, ref_metric, args)
    recorded = (art.manifest.metrics.compressed or {}).get(task.primary_metric)  # what `holoserve eval` reproduces
    eval_metric = None if recorded is None else 100 * float(recorded)
    report = {"meta": {"checkpoint": args.checkpoint.name, "task": task.name, "metric": task.primary_metric,
                       "rows": len(dev.rows), "eval_metric": eval_metric,
                       "reference_metric": 100 * float(ref_metric), "table": name, "repeats": args.repeats,
                       "threshold_points": args.threshold, "threads": args.threads, "python": platform.python_version(),
                       "machine": describe_cpu(), "date": time.strftime("%Y-%m-%d"), "seconds": time.time() - t0,
                       "command": command(sys.argv[1:] if argv is None else argv, "bench.accuracy.rounding_noise")},
              "perturbed": perturbed, "runtimes": runtimes}
    save(args.results, "rounding_noise", report, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
