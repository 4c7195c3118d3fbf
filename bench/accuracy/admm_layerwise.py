"""The projections onto 2:4 ∩ INT8 compared on each encoder Linear's reconstruction error.

A fine-tuned teacher's calibration batches (the pipeline's: `calib_batches` training batches of the seed's
order) fit each projection; the next `calib_batches` batches of that order score it. The error of a projected
weight V is ||X (W - V)^T||^2 on the held-out inputs X, relative to the nearest projection's (the preset's
activation-weighted mask, the kept weights as they are), every candidate ending on the per-row INT8 grid.

  --mode layer       each Linear on the dense teacher's inputs, side by side: nearest, OBS (the mask metric's
                     mask), least squares on that mask (what ADMM with that mask fixed converges to), ADMM with
                     the mask free (its last Z), and least squares on ADMM's mask (the `admm` projection)
  --mode sequential  the pipeline's pass (compress.admm.layerwise_projection): each encoder layer fed by the
                     already-projected ones, OBS and ADMM each on their own copy of the teacher, with wall times

  --compare          no computing: two checkpoints of the same teacher (projection=obs, projection=admm) side by
                     side, from their manifests (training.phases.projection: the sequential pass of the real job,
                     its held-out errors and time; metrics.after_projection: the dev score before any training)

    python -m bench.accuracy.admm_layerwise --task sst2 --data-dir "$GLUE_DIR" --teacher runs/x.state/teacher \
        --mode layer --results runs/admm-layer-sst2
    python -m bench.accuracy.admm_layerwise --compare runs/sst2-obs runs/sst2-admm
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.lib.report import table, write_record


def open_teacher(task: str, data_dir: str, teacher: Path, preset: str = "quick", seed: int = 0,
                 out: Path = Path("unused")):
    """The pipeline's context for a fine-tuned teacher (its rows, calibration order and dev set, as `holoserve
    compress --teacher` sees them) and a student copy of it in eval mode: (run, model, encoder Linears)."""
    from holoserve.compress.context import CompressRequest, ModelSource
    from holoserve.compress.layers import encoder_linear_names
    from holoserve.compress.pipeline import CompressionPipeline

    pipeline = CompressionPipeline(CompressRequest(task=task, out=out / "unused-checkpoint", data_dir=data_dir,
                                                   preset=preset, seed=seed, teacher=teacher, progress=False))
    run = pipeline.load_data(ModelSource(teacher))
    model = run.student(teacher).eval()
    return run, model, encoder_linear_names(model)


def _ratio(dense, v, h) -> float:
    d = dense - v
    return float((d @ h * d).sum())


def layer_mode(run, model, layers, fit, held, names) -> dict:

    from holoserve.compress.project import admm_prune, masked_least_squares, obs_prune, project
    from holoserve.compress.quant import input_hessians
    from holoserve.compress.sparsify import hard_masks

    importance = run.mask_importance(model, layers)
    masks = hard_masks(model, layers, importance=importance)
    hf, hh = input_hessians(model, names, fit), input_hessians(model, names, held)
    out = {}
    for name in names:
        w = model.get_submodule(name).weight.detach().double()
        mask, imp = masks[name], importance[name]
        grid = lambda v, mk: project(v.double(), mask=mk).z  # noqa: E731  (the kept values onto the row grid)
        t = {}
        t0 = time.process_time()
        cand = {"nearest": project(w, mask=mask).z}
        t["nearest"] = time.process_time() - t0
        t0 = time.process_time()
        o, _ = obs_prune(w, hf[name], mask=mask)
        cand["obs"] = grid(o, mask)
        t["obs"] = time.process_time() - t0
        t0 = time.process_time()
        cand["ls_fixed_mask"] = grid(masked_least_squares(w, hf[name], mask), mask)
        t["ls_fixed_mask"] = time.process_time() - t0
        t0 = time.process_time()
        res = admm_prune(w, hf[name], importance=imp)
        t["admm"] = time.process_time() - t0
        cand["admm_free_z"] = res.z.double()
        cand["admm_free_ls"] = grid(res.w, res.mask)
        row = {}
        for split, h in (("fit", hf[name]), ("heldout", hh[name])):
            base = _ratio(w, cand["nearest"], h)
            row[split] = {k: _ratio(w, v, h) / base for k, v in cand.items()}
        row["seconds"] = {k: round(v, 2) for k, v in t.items()}
        row["admm_iters"], row["admm_rho"] = res.iters, res.rho
        row["admm_mask_moved"] = float((res.mask != mask).float().mean())
        out[name] = row
        print(f"{name}: held-out " + " ".join(f"{k}={v:.3f}" for k, v in row["heldout"].items())
              + f" | iters {res.iters} moved {row['admm_mask_moved']:.3f} | {t['admm']:.1f}s", flush=True)
    return out


def sequential_mode(run, teacher_dir, layers, fit, held) -> dict:
    import torch

    from holoserve.compress.admm import ProjectionOptions, layerwise_projection
    from holoserve.compress.sparsify import hard_masks

    out = {}
    for method in ("obs", "admm"):
        model = run.student(teacher_dir).eval()
        importance = run.mask_importance(model, layers)
        masks = hard_masks(model, layers, importance=importance)
        t0, c0 = time.perf_counter(), time.process_time()
        _, diag = layerwise_projection(model, layers, fit, held, ProjectionOptions(method=method), masks=masks,
                                       importance=importance)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        out[method] = {"seconds": round(secs, 1), "cpu_seconds": round(cpu, 1), "layers": diag}
        med = statistics.median(d["heldout_vs_nearest"] for d in diag.values())
        print(f"sequential {method}: {secs:.1f}s, held-out median {med:.3f} of nearest", flush=True)
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def short(name: str) -> str:
    return name.replace("bert.encoder.layer.", "L").replace(".attention.self.", ".").replace(".attention.output.dense",
                                                                                               ".attn_out")


def markdown(r: dict) -> str:
    m = r["meta"]
    lines = [f"# Layer-wise projections onto 2:4 ∩ INT8, {m['task']} teacher ({m['machine']})", "",
             f"Held-out squared output error relative to the nearest projection's; fit on {m['calib_batches']} "
             f"calibration batches, scored on the next {m['calib_batches']}.", ""]
    if "layer" in r:
        keys = ["obs", "ls_fixed_mask", "admm_free_z", "admm_free_ls"]
        med = {k: statistics.median(row["heldout"][k] for row in r["layer"].values()) for k in keys}
        ratio = statistics.median(row["heldout"]["admm_free_ls"] / row["heldout"]["obs"] for row in r["layer"].values())
        lines += ["## Each Linear on the dense teacher's inputs", "",
                  *table(["Linear", *keys, "ADMM / OBS", "mask moved", "ADMM CPU s", "OBS CPU s"],
                         [*([short(name), *(f"{row['heldout'][k]:.3f}" for k in keys),
                             f"{row['heldout']['admm_free_ls'] / row['heldout']['obs']:.2f}",
                             f"{100 * row['admm_mask_moved']:.1f} %", f"{row['seconds']['admm']:.1f}",
                             f"{row['seconds']['obs']:.1f}"] for name, row in r["layer"].items()),
                          ["**median**", *(f"**{med[k]:.3f}**" for k in keys), f"**{ratio:.2f}**", "", "", ""]]), ""]
    if "sequential" in r:
        s = r["sequential"]
        a_l, o_l = s["admm"]["layers"], s["obs"]["layers"]
        mo = statistics.median(d["heldout_vs_nearest"] for d in o_l.values())
        ma = statistics.median(d["heldout_vs_nearest"] for d in a_l.values())
        mr = statistics.median(a_l[k]["heldout_vs_nearest"] / o_l[k]["heldout_vs_nearest"] for k in o_l)
        lines += ["## The sequential pass (each layer fed by the already-projected ones)", "",
                  *table(["Linear", "OBS", "ADMM", "ADMM / OBS", "ADMM rel. to output"],
                         [*([short(name), f"{o['heldout_vs_nearest']:.3f}", f"{a_l[name]['heldout_vs_nearest']:.3f}",
                             f"{a_l[name]['heldout_vs_nearest'] / o['heldout_vs_nearest']:.2f}",
                             f"{a_l[name]['heldout_relative']:.3g}"] for name, o in o_l.items()),
                          ["**median**", f"**{mo:.3f}**", f"**{ma:.3f}**", f"**{mr:.2f}**", ""]]), "",
                  f"Time of the pass (Hessians, held-out scoring and solves), CPU (process) / wall: OBS "
                  f"{s['obs'].get('cpu_seconds')} / {s['obs']['seconds']} s, ADMM {s['admm'].get('cpu_seconds')} / "
                  f"{s['admm']['seconds']} s.", ""]
    lines.append(f"Command: `{m['command']}`")
    return "\n".join(lines) + "\n"


def compare(obs_dir: Path, admm_dir: Path) -> str:
    """The sequential pass of two real jobs (projection=obs and projection=admm), from their manifests."""
    ms = [json.loads((Path(d) / "manifest.json").read_text()) for d in (obs_dir, admm_dir)]
    (po, pa), (mo, ma) = [m["training"]["phases"]["projection"] for m in ms], [m["metrics"] for m in ms]
    primary = mo["primary"]
    ratios = {name: pa["layers"][name]["heldout_vs_nearest"] / o["heldout_vs_nearest"]
              for name, o in po["layers"].items()}
    mo_med, ma_med = (statistics.median(d["heldout_vs_nearest"] for d in p["layers"].values()) for p in (po, pa))
    lines = [f"{obs_dir} vs {admm_dir}: held-out output error relative to the nearest projection's", "",
             *table(["Linear", "OBS", "ADMM", "ADMM / OBS"],
                    [*([short(name), f"{o['heldout_vs_nearest']:.3f}",
                        f"{pa['layers'][name]['heldout_vs_nearest']:.3f}",
                        f"{ratios[name]:.2f}"] for name, o in po["layers"].items()),
                     ["**median**", f"**{mo_med:.3f}**", f"**{ma_med:.3f}**",
                      f"**{statistics.median(ratios.values()):.2f}**"]]),
             "",
             f"dev {primary}: dense {100 * mo['dense'][primary]:.2f}; right after the projection OBS "
             f"{100 * mo['after_projection'][primary]:.2f}, ADMM {100 * ma['after_projection'][primary]:.2f}; "
             f"with INT8 activations (no training) OBS {100 * mo['compressed'][primary]:.2f}, "
             f"ADMM {100 * ma['compressed'][primary]:.2f}",
             f"projection time, CPU / wall s: OBS {po.get('cpu_seconds')} / {po['seconds']}, "
             f"ADMM {pa.get('cpu_seconds')} / {pa['seconds']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.accuracy.admm_layerwise", description=__doc__.split("\n")[0])
    ap.add_argument("--compare", nargs=2, metavar=("OBS_CHECKPOINT", "ADMM_CHECKPOINT"))
    ap.add_argument("--task")
    ap.add_argument("--data-dir")
    ap.add_argument("--teacher",
                    help="a fine-tuned teacher folder (a compress run's <out>.state/teacher)")
    ap.add_argument("--preset", default="quick")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=("layer", "sequential", "both"), default="both")
    ap.add_argument("--layers", default="", help="comma-separated substrings: only Linears whose name holds one "
                    "(layer mode), e.g. 'layer.0.,layer.3.,layer.5.'")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results", help="folder for results.json and results.md")
    args = ap.parse_args(argv)
    if args.compare:
        missing = [d for d in args.compare if not (Path(d) / "manifest.json").is_file()]
        if missing:
            ap.error(f"not a checkpoint (no manifest.json): {', '.join(missing)}")
        print(compare(*map(Path, args.compare)))
        return 0
    if not (args.task and args.data_dir and args.teacher and args.results):
        ap.error("--task, --data-dir, --teacher and --results are needed (or --compare OBS_CKPT ADMM_CKPT)")

    import torch

    from holoserve.compress.pipeline import machine

    torch.set_num_threads(args.threads)
    teacher = Path(args.teacher)
    if not (teacher / "config.json").is_file():
        print(f"error: {teacher} is not a model folder (no config.json)", file=sys.stderr)
        return 2
    out = Path(args.results)
    run, model, layers = open_teacher(args.task, args.data_dir, teacher, args.preset, args.seed, out)
    fit, held = run.calibration_batches(), run.calibration_batches(held_out=True)
    names = [n for n in layers if not args.layers or any(s in n for s in args.layers.split(","))]
    res = {"meta": {"task": args.task, "teacher": str(teacher), "seed": args.seed, "preset": args.preset,
                    "calib_batches": run.preset.calib_batches, "machine": machine(), "threads": args.threads,
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "command": "python -m bench.accuracy.admm_layerwise " + " ".join(sys.argv[1:] if argv is None
                                                                                      else argv)}}
    with torch.no_grad():
        if args.mode in ("layer", "both"):
            res["layer"] = layer_mode(run, model, layers, fit, held, names)
        if args.mode in ("sequential", "both"):
            res["sequential"] = sequential_mode(run, teacher, layers, fit, held)
    write_record(res, out, "results", markdown)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
