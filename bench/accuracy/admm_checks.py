"""Why the layer-wise ADMM projection's lead over the default's does not survive QAT: checks without training.

The ADMM projection (`--set projection=admm`) fits each encoder Linear better than the default (the mask metric's
2:4 mask, |w|·‖x‖^0.5, then OBS updates), yet after the same QAT it trails. Each check below tests one candidate
cause on a fine-tuned teacher, with the pipeline's own rows, calibration order and projections
(compress.context.CompressionContext), and needs no training step:

  m1  the free mask overfits the calibration batches. ADMM (mask free) is solved on each Linear of the dense
      teacher twice, on calibration batches 0-15 and on 16-31 (each with its own input norms for the mask
      metric), and its mask moves (kept/pruned changes against the metric's mask) are compared: the share of
      A's moves that B makes too, against B's share of moved weights (what B's moves, spread at random, would
      hit). Each candidate is also scored on batches 32-47, which neither was fitted on.
  m2  the least-squares values are sharp. (a) Each Linear of the dense teacher fitted on batches 0-15 and scored
      on 16-31 with the damping (added to the Hessian's diagonal, relative to its mean) at each of --damps, for
      OBS, least squares on the metric's mask, ADMM on that mask (projection=admm_fixed_mask) and ADMM with the
      mask free. (b) The default's, the ADMM and the admm_fixed_mask projection of the whole teacher (the
      pipeline's sequential pass), each perturbed by Gaussian noise on its kept weights (a share --noise of the
      row's RMS, --draws draws): the drop of the dev metric and how far the logits move, float activations.
  r2  R2's hysteresis tau (projection=admm_stable), chosen by m1's test rather than by a dev score: the stable
      free mask (damping 0.1, the ramp, ALPS's rho) solved on batches 0-15 (A) and 16-31 (B) at each of --taus,
      and per tau the share of the weights moved, the share of A's moves B makes too, and the held-out error on
      32-47. The choice: the smallest tau at which at least --reproduce of A's moves (median over the Linears)
      are made by B too, i.e. the moves left are the data's, not the batches'; where none reaches it, the tau
      whose moves reproduce most.
  m6  the activation ranges are calibrated once, on the projected model, over calib_batches. On each of those
      three projected models: the dev metric with INT8 activations calibrated on 16 and on 64 batches, with the
      preset's percentile and with the plain max, and how far those ranges are from the default calibration's.

    python -m bench.accuracy.admm_checks --task mrpc --data-dir "$GLUE_DIR" --teacher runs/x.state/teacher \\
        --checks m1,m2,m6 --threads 1 --results runs/admm-checks-mrpc
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.accuracy.admm_layerwise import _ratio, open_teacher, short
from bench.lib.report import table, write_record

CHECKS = ("m1", "m2", "m6", "r2")
BATCHES = 16  # the quick preset's calib_batches: the size of each split of the calibration order the checks use
# the projections of the whole teacher that m2 (b) and m6 compare: row name -> preset settings
PROJECTIONS = {"default (obs)": {"projection": "obs"}, "admm": {"projection": "admm"},
               "admm_fixed_mask": {"projection": "admm_fixed_mask"}}


def _split(run, i: int) -> list[dict]:
    """Calibration batches BATCHES*i .. BATCHES*(i+1)-1 of the pipeline's calibration order."""
    return run.calibration_batches(start=BATCHES * i, count=BATCHES)


def _masks_and_hessians(run, model, layers, batches):
    """The mask metric's importance (|w|·‖x‖^power, the preset's power) and masks, and the input Hessians, of the
    dense model's Linears on `batches`."""
    from holoserve.compress.quant import input_channel_norms, input_hessians
    from holoserve.compress.sparsify import hard_masks

    power = run.preset.mask_activation_power
    importance = {k: v.pow(power) for k, v in input_channel_norms(model, layers, batches).items()}
    return importance, hard_masks(model, layers, importance=importance), input_hessians(model, layers, batches)


def check_m1(run, model, layers) -> dict:
    """Solve the free-mask ADMM on batches 0-15 (A) and 16-31 (B); score on 32-47 (C)."""
    import torch

    from holoserve.compress.project import admm_prune, masked_least_squares, obs_prune, project

    (imp_a, mask_a, h_a), (imp_b, mask_b, h_b) = (_masks_and_hessians(run, model, layers, _split(run, i))
                                                  for i in (0, 1))
    _, _, h_c = _masks_and_hessians(run, model, layers, _split(run, 2))
    out = {}
    for name in layers:
        w = model.get_submodule(name).weight.detach().double()
        res_a, res_b = (admm_prune(w, h_a[name], importance=imp_a[name]),
                        admm_prune(w, h_b[name], importance=imp_b[name]))
        moves_a, moves_b = res_a.mask != mask_a[name], res_b.mask != mask_b[name]
        both = int((moves_a & moves_b).sum())
        grid = lambda v, mk: project(v.double(), mask=mk).z  # noqa: E731
        nearest = project(w, mask=mask_a[name]).z
        cand = {"obs_a": grid(obs_prune(w, h_a[name], mask=mask_a[name])[0], mask_a[name]),
                "ls_a": grid(masked_least_squares(w, h_a[name], mask_a[name]), mask_a[name]),
                "admm_a": grid(res_a.w, res_a.mask), "admm_b": grid(res_b.w, res_b.mask)}
        row = {"moved_a": float(moves_a.float().mean()), "moved_b": float(moves_b.float().mean()),
               "reproduced": both / max(1, int(moves_a.sum())),
               "metric_masks_differ": float((mask_a[name] != mask_b[name]).float().mean()),
               "admm_masks_differ": float((res_a.mask != res_b.mask).float().mean()),
               "fit_a": {k: _ratio(w, cand[k], h_a[name]) / _ratio(w, nearest, h_a[name])
                         for k in ("obs_a", "ls_a", "admm_a")},
               "heldout_c": {k: _ratio(w, v, h_c[name]) / _ratio(w, nearest, h_c[name]) for k, v in cand.items()}}
        out[name] = row
        print(f"m1 {short(name)}: moved {row['moved_a']:.3f}/{row['moved_b']:.3f}, reproduced "
              f"{row['reproduced']:.3f}; held-out C " + " ".join(f"{k}={v:.3f}" for k, v in row["heldout_c"].items()),
              flush=True)
        del w, res_a, res_b
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def check_r2(run, model, layers, taus: list[float]) -> dict:
    """The stable free mask at each tau, solved on batches 0-15 (A) and 16-31 (B), scored on 32-47 (C)."""
    from holoserve.compress.config import PROJECTION_FIT, STABLE_RAMP
    from holoserve.compress.project import AdmmSolverOptions, admm_prune, project

    (imp_a, mask_a, h_a), (imp_b, mask_b, h_b) = (_masks_and_hessians(run, model, layers, _split(run, i))
                                                  for i in (0, 1))
    _, _, h_c = _masks_and_hessians(run, model, layers, _split(run, 2))
    out: dict = {}
    for tau in taus:
        solver = AdmmSolverOptions(damp=PROJECTION_FIT["admm_stable"][0], hysteresis=tau, ramp=STABLE_RAMP,
                                   schedule="alps")
        rows = {}
        for name in layers:
            w = model.get_submodule(name).weight.detach().double()
            res_a, res_b = (admm_prune(w, h[name], importance=imp[name], solver=solver)
                            for imp, h in ((imp_a, h_a), (imp_b, h_b)))
            moves_a, moves_b = res_a.mask != mask_a[name], res_b.mask != mask_b[name]
            nearest = project(w, mask=mask_a[name]).z
            rows[name] = {"moved_a": float(moves_a.float().mean()), "moved_b": float(moves_b.float().mean()),
                          "reproduced": int((moves_a & moves_b).sum()) / max(1, int(moves_a.sum())),
                          "iters_a": res_a.iters,
                          "heldout_c": _ratio(w, project(res_a.w.double(), mask=res_a.mask).z, h_c[name])
                          / _ratio(w, nearest, h_c[name])}
        out[f"{tau:g}"] = rows
        med = {k: statistics.median(x[k] for x in rows.values()) for k in ("moved_a", "reproduced", "heldout_c")}
        print(f"r2 tau {tau:g}: moved {100 * med['moved_a']:.2f} %, reproduced {100 * med['reproduced']:.1f} %, "
              f"held-out C {med['heldout_c']:.3f}", flush=True)
    return out


def choose_tau(r2: dict, reproduce: float) -> tuple[float | None, str]:
    """(tau, why): the smallest tau at which the median share of A's moves that B makes too is at least
    `reproduce`, among the taus that still move the mask; where none reaches it, the tau whose moves reproduce
    most (the smallest on a tie); None where no tau moves the mask."""
    medians = []
    for tau, rows in sorted(r2.items(), key=lambda kv: float(kv[0])):
        if statistics.median(x["moved_a"] for x in rows.values()) > 0:
            medians.append((float(tau), statistics.median(x["reproduced"] for x in rows.values())))
    for tau, rep in medians:
        if rep >= reproduce:
            return tau, f"the smallest with at least {100 * reproduce:.0f} % of A's moves reproduced"
    if not medians:
        return None, "no tau moves the mask"
    best = max(rep for _, rep in medians)
    tau = next(t for t, rep in medians if rep == best)
    return tau, (f"none reaches {100 * reproduce:.0f} % of A's moves reproduced: the one whose moves reproduce "
                 f"most ({100 * best:.1f} %)")


def check_m2_layers(run, model, layers, damps: list[float]) -> dict:
    """Each Linear fitted on batches 0-15, scored on 16-31, at each damping."""
    from holoserve.compress.project import (AdmmSolverOptions, admm_on_mask, admm_prune, masked_least_squares,
                                            obs_prune, project)

    imp, masks, h_fit = _masks_and_hessians(run, model, layers, _split(run, 0))
    _, _, h_held = _masks_and_hessians(run, model, layers, _split(run, 1))
    out: dict = {str(d): {} for d in damps}
    for name in layers:
        w = model.get_submodule(name).weight.detach().double()
        mask = masks[name]
        nearest = project(w, mask=mask).z
        base_fit, base_held = _ratio(w, nearest, h_fit[name]), _ratio(w, nearest, h_held[name])
        for d in damps:
            free = admm_prune(w, h_fit[name], importance=imp[name], solver=AdmmSolverOptions(damp=d))
            cand = {"obs": project(obs_prune(w, h_fit[name], mask=mask, damp=d)[0].double(), mask=mask).z,
                    "ls": project(masked_least_squares(w, h_fit[name], mask, damp=d).double(), mask=mask).z,
                    "admm_fixed_mask": admm_on_mask(w, h_fit[name], mask, solver=AdmmSolverOptions(damp=d)).z.double(),
                    "admm": project(free.w.double(), mask=free.mask).z}
            out[str(d)][name] = {"fit": {k: _ratio(w, v, h_fit[name]) / base_fit for k, v in cand.items()},
                                 "heldout": {k: _ratio(w, v, h_held[name]) / base_held for k, v in cand.items()},
                                 "admm_moved": float((free.mask != mask).float().mean())}
        print(f"m2 {short(name)}: held-out " + " | ".join(
            f"damp {d:g}: " + " ".join(f"{k}={v:.3f}" for k, v in out[str(d)][name]["heldout"].items())
            for d in damps), flush=True)
    return out


def projected_models(run, teacher: Path, layers):
    """Each of PROJECTIONS applied to a fresh student copy of the teacher as the pipeline applies it (the preset's
    masks and sequential pass, compress.context.project_masks; then the grid and the INT8 word embeddings):
    yields (row name, model, the projection's record)."""
    from holoserve.compress.sparsify import finalize, quantize_embeddings

    for row, settings in PROJECTIONS.items():
        ctx = replace(run, preset=replace(run.preset, **settings))
        model = ctx.student(teacher).eval()
        t0 = time.process_time()
        masks = ctx.project_masks(model, layers)
        finalize(model, masks, quant=True)
        if ctx.preset.quantize_embeddings:
            quantize_embeddings(model)
        record = dict(ctx.record.phases.get("projection", {}))
        record["cpu_seconds_with_masks"] = round(time.process_time() - t0, 1)
        yield row, model, record


def _dev(run, model, amax=None, layers=None):
    """(dev metrics, logits) with float activations, or INT8 ones with `amax`."""
    from holoserve.compress.evaluate import predict_quantized, score

    logits = predict_quantized(model, run.dev, batch_size=run.preset.eval_batch_size, act_amax=amax,
                               quant_layers=layers)
    return score(run.task, logits, run.dev.labels), logits


def check_m2_noise(run, model, layers, noise: list[float], draws: int, seed: int) -> dict:
    """Dev metric and logit movement of `model` (a projected one) under Gaussian noise on its kept weights."""
    import numpy as np
    import torch

    base, base_logits = _dev(run, model)
    primary = run.task.primary_metric
    weights = {k: model.get_submodule(k).weight for k in layers}
    saved = {k: w.detach().clone() for k, w in weights.items()}
    out = {"dev": base[primary], "noise": {}}
    g = torch.Generator().manual_seed(seed)
    for sigma in noise:
        vals, moves = [], []
        for _ in range(draws):
            with torch.no_grad():
                for k, w in weights.items():
                    kept = saved[k] != 0
                    rms = (saved[k].pow(2).sum(1) / kept.sum(1).clamp_min(1)).sqrt().unsqueeze(1)
                    eps = torch.randn(saved[k].shape, generator=g).to(w.device, w.dtype)
                    w.copy_(saved[k] + sigma * rms * eps * kept)
            metrics, logits = _dev(run, model)
            vals.append(metrics[primary])
            moves.append(float(np.sqrt(((logits - base_logits) ** 2).mean())))
        out["noise"][str(sigma)] = {"dev_mean": statistics.mean(vals), "drop": base[primary] - statistics.mean(vals),
                                    "dev_draws": vals, "logit_rms_move": statistics.mean(moves)}
    with torch.no_grad():
        for k, w in weights.items():
            w.copy_(saved[k])
    out["logit_rms"] = float(np.sqrt((base_logits ** 2).mean()))
    return out


def check_m6(run, model, layers, default_amax: dict | None = None) -> dict:
    """INT8-activation dev metric of `model` with ranges from 16 or 64 calibration batches, percentile or max."""
    from holoserve.compress.quant import calibrate_amax

    primary = run.task.primary_metric
    pct = run.preset.calib_percentile
    out = {}
    ranges = {}
    for batches in (16, 64):
        cal = run.calibration_batches(count=batches)
        for how, percentile in (("percentile", pct), ("max", None)):
            key = f"{batches} batches, {how}"
            ranges[key] = calibrate_amax(model, layers, cal, percentile=percentile)
            metrics, _ = _dev(run, model, ranges[key], layers)
            out[key] = {"dev": metrics[primary]}
    ref = ranges[f"{run.preset.calib_batches} batches, percentile"]
    for key, amax in ranges.items():
        out[key]["amax_vs_default_median"] = statistics.median(amax[k] / ref[k] for k in ref)
        if default_amax is not None:
            out[key]["amax_vs_obs_model_median"] = statistics.median(amax[k] / default_amax[key][k] for k in amax)
    return out, ranges


def damping_row(d: str, rows: dict, keys: list[str]) -> list[str]:
    """M2 (a)'s row for one damping: per candidate the median fit / held-out error, and how far ADMM's mask moved."""
    med = lambda f: statistics.median(f(x) for x in rows.values())  # noqa: E731
    return [f"{float(d):g}", *(f"{med(lambda x, k=k: x['fit'][k]):.3f} / {med(lambda x, k=k: x['heldout'][k]):.3f}"
                               for k in keys), f"{100 * med(lambda x: x['admm_moved']):.1f} %"]


def markdown(r: dict) -> str:
    m = r["meta"]
    primary = m["primary"]
    lines = [f"# ADMM checks without training, {m['task']} teacher ({m['machine']})", ""]
    if "m1" in r:
        rows = r["m1"]
        med = lambda f: statistics.median(f(x) for x in rows.values())  # noqa: E731
        shares = ("moved_a", "moved_b", "reproduced", "metric_masks_differ", "admm_masks_differ")
        heldout = ("obs_a", "ls_a", "admm_a", "admm_b")
        lines += ["## M1: does the free mask overfit the calibration batches?", "",
                  "ADMM (mask free) solved on each Linear of the dense teacher on batches 0-15 (A) and on 16-31 (B). "
                  "Shares of the weights; held-out errors on batches 32-47 relative to the nearest projection's.", "",
                  *table(["Linear", "moved A", "moved B", "A's moves B makes too", "metric masks A vs B differ",
                          "ADMM masks A vs B differ", "OBS (A)", "LS, metric mask (A)", "ADMM (A)", "ADMM (B)"],
                         [*([short(name), *(f"{100 * x[k]:.1f} %" for k in shares),
                             *(f"{x['heldout_c'][k]:.3f}" for k in heldout)] for name, x in rows.items()),
                          ["**median**", *(f"**{100 * med(lambda x, k=k: x[k]):.1f} %**" for k in shares),
                           *(f"**{med(lambda x, k=k: x['heldout_c'][k]):.3f}**" for k in heldout)]])]
        lines += ["", "Fit (on A) against held out (on C), medians: " + ", ".join(
            f"{k} {med(lambda x, k=k: x['fit_a'][k]):.3f} → {med(lambda x, k=k: x['heldout_c'][k]):.3f}"
            for k in ("obs_a", "ls_a", "admm_a")), ""]
    if "r2" in r:
        med = lambda rows, k: statistics.median(x[k] for x in rows.values())  # noqa: E731
        lines += ["## R2: the stable free mask's hysteresis tau, chosen by M1's reproducibility test", "",
                  "projection=admm_stable's solve (damping 0.1, the ramp, ALPS's rho) on batches 0-15 (A) and 16-31 "
                  "(B), each starting from its own metric mask; medians over the Linears. Held-out error on "
                  "batches 32-47 relative to the nearest projection's.", "",
                  *table(["tau", "moved A", "moved B", "A's moves B makes too", "iterations (A)", "held-out error"],
                         [[tau, f"{100 * med(rows, 'moved_a'):.2f} %", f"{100 * med(rows, 'moved_b'):.2f} %",
                           f"{100 * med(rows, 'reproduced'):.1f} %", f"{med(rows, 'iters_a'):.0f}",
                           f"{med(rows, 'heldout_c'):.3f}"] for tau, rows in r["r2"].items()]), "",
                  f"Chosen: tau = {r['r2_choice']} ({r['r2_why']}).", ""]
    if "m2_layers" in r:
        keys = ["obs", "ls", "admm_fixed_mask", "admm"]
        lines += ["## M2 (a): damping, each Linear fitted on batches 0-15, scored on 16-31", "",
                  "Median over the Linears of the squared output error relative to the nearest projection's "
                  "(fit / held out).", "", *table(["damping", *keys, "ADMM mask moved"], [
                      damping_row(d, rows, keys) for d, rows in r["m2_layers"].items()]), ""]
    if "models" in r:
        models = r["models"]
        noise = list(next(iter(models.values()))["m2_noise"]["noise"]) if "m2_noise" in next(iter(models.values())) \
            else []
        lines += ["## The three projections of the whole teacher (the pipeline's sequential pass)", "",
                  *table(["projection", "fit batches", "damping", "held-out error vs nearest, median",
                          f"dev {primary} (float activations)", "CPU s"],
                         [[row, x["projection"].get("calib_batches"), x["projection"].get("damp"),
                           x["projection"].get("heldout_vs_nearest_median"), f"{100 * x['dev']:.2f}",
                           x["projection"].get("cpu_seconds_with_masks")] for row, x in models.items()]), ""]
        if noise:
            drops = {row: x["m2_noise"]["noise"] for row, x in models.items()}
            lines += ["## M2 (b): dev drop under Gaussian noise on the kept weights (float activations)", "",
                      f"Noise: a share σ of each row's RMS, on the kept weights only; {m['draws']} draws each. "
                      f"Drop of dev {primary} ×100 (mean over the draws) / RMS change of the logits.", "",
                      *table(["projection", *(f"σ = {s}" for s in noise)],
                             [[row, *(f"{100 * n[s]['drop']:+.2f} / {n[s]['logit_rms_move']:.3g}" for s in noise)]
                              for row, n in drops.items()]), ""]
        if "m6" in next(iter(models.values())):
            keys = list(next(iter(models.values()))["m6"])
            lines += ["## M6: activation ranges (INT8 activations, no training)", "",
                      f"Dev {primary} ×100 with the encoder Linears' inputs on INT8, ranges calibrated on the "
                      "projected model; in brackets the median ratio of the ranges to the default calibration's "
                      f"({r['meta']['calib_batches']} batches, percentile {r['meta']['calib_percentile']}) on the same "
                      "model.", "", *table(["projection", *keys], [
                          [row, *(f"{100 * x['m6'][k]['dev']:.2f} ({x['m6'][k]['amax_vs_default_median']:.2f})"
                                  for k in keys)] for row, x in models.items()])]
            first = next(iter(models))
            for row, x in list(models.items())[1:]:
                if all("amax_vs_obs_model_median" in x["m6"][k] for k in keys):
                    lines.append("")
                    lines.append(f"{row}'s ranges against {first}'s, same calibration, median ratio: " + ", ".join(
                        f"{k} {x['m6'][k]['amax_vs_obs_model_median']:.3f}" for k in keys))
            lines.append("")
    lines.append(f"Command: `{m['command']}`")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.accuracy.admm_checks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", required=True, help="GLUE shortcut: sst2, mrpc, cola or stsb")
    ap.add_argument("--data-dir", required=True, help="the GLUE folder")
    ap.add_argument("--teacher", required=True,
                    help="a fine-tuned teacher folder (a compress run's <out>.state/teacher)")
    ap.add_argument("--preset", default="quick")
    ap.add_argument("--seed", type=int, default=0, help="the run's seed: the calibration order (default 0)")
    ap.add_argument("--checks", default=",".join(CHECKS), help="comma-separated: m1, m2, m6 (default: all)")
    ap.add_argument("--damps", default="0.01,0.1,1.0", help="m2: the dampings compared (default 0.01,0.1,1.0)")
    ap.add_argument("--noise", default="0.05,0.1,0.2",
                    help="m2: noise levels, as shares of each row's RMS (default 0.05,0.1,0.2)")
    ap.add_argument("--draws", type=int, default=3, help="m2: noise draws per level (default 3)")
    ap.add_argument("--taus", default="0,0.05,0.1,0.2,0.5", help="r2: the hysteresis values compared")
    ap.add_argument("--reproduce", type=float, default=0.9,
                    help="r2: the share of A's mask moves B must make too for a tau to be chosen (default 0.9)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results", required=True, help="folder for results.json and results.md")
    args = ap.parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}: choose from {', '.join(CHECKS)}")
    teacher = Path(args.teacher)
    if not (teacher / "config.json").is_file():
        print(f"error: {teacher} is not a model folder (no config.json)", file=sys.stderr)
        return 2

    import torch

    from holoserve.compress.pipeline import machine

    torch.set_num_threads(args.threads)
    out = Path(args.results)
    run, model, layers = open_teacher(args.task, args.data_dir, teacher, args.preset, args.seed, out)
    res: dict = {"meta": {"task": args.task, "teacher": str(teacher), "seed": args.seed, "preset": args.preset,
                          "primary": run.task.primary_metric, "calib_batches": run.preset.calib_batches,
                          "calib_percentile": run.preset.calib_percentile, "draws": args.draws,
                          "reproduce": args.reproduce,
                          "machine": machine(), "threads": args.threads, "torch": torch.__version__,
                          "command": "python -m bench.accuracy.admm_checks " + " ".join(
                              sys.argv[1:] if argv is None else argv)}}

    def save():
        write_record(res, out, "results", markdown)

    t0 = time.perf_counter()
    with torch.no_grad():
        if "m1" in checks:
            res["m1"] = check_m1(run, model, layers)
            save()
        if "r2" in checks:
            res["r2"] = check_r2(run, model, layers, [float(t) for t in args.taus.split(",")])
            res["r2_choice"], res["r2_why"] = choose_tau(res["r2"], args.reproduce)
            save()
        if "m2" in checks:
            res["m2_layers"] = check_m2_layers(run, model, layers, [float(d) for d in args.damps.split(",")])
            save()
        if "m2" in checks or "m6" in checks:
            res["models"] = {}
            obs_ranges = None
            for row, projected, record in projected_models(run, teacher, layers):
                metrics, _ = _dev(run, projected)
                entry = {"projection": record, "dev": metrics[run.task.primary_metric]}
                if "m2" in checks:
                    entry["m2_noise"] = check_m2_noise(run, projected, layers,
                                                       [float(s) for s in args.noise.split(",")],
                                                       args.draws, args.seed)
                if "m6" in checks:
                    entry["m6"], ranges = check_m6(run, projected, layers, obs_ranges)
                    obs_ranges = obs_ranges or ranges
                res["models"][row] = entry
                print(f"{row}: dev {entry['dev']:.4f}", flush=True)
                save()
                del projected
    res["meta"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    save()
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
