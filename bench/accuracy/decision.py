"""The ADMM decision rule applied to the paired table (run.paired): go, parity or no-go for each ADMM projection.

Differences are the row minus the default recipe on the same seed, teacher and dev rows, ×100 (points).
- go: the mean over the four tasks > 0, the lower end of its 90 % bootstrap interval (seeds resampled within each
  task, paired) ≥ -0.1, every task's mean ≥ -0.2 (CoLA ≥ -0.5), and a full-preset check on two tasks whose mean
  difference is not below 0;
- parity: ADMM on the default's mask (R1) within ±0.2 of the default on the mean: R1 becomes the one projection;
- no-go: otherwise; the default stays.
The verdict is final only when every task has its seeds (REQUIRED); before that it is marked provisional.
"""
from __future__ import annotations

import random
import statistics

REQUIRED = {"mrpc": 5, "stsb": 5, "cola": 10, "sst2": 5}  # seeds per task the decisive run needs
FLOOR = {"cola": -0.5}  # a task's mean difference may not fall below this (points); others: TASK_FLOOR
TASK_FLOOR = -0.2
MEAN_LOWER = -0.1  # the 90 % interval's lower end on the mean may not fall below this
PARITY = 0.2
R1 = "oneshot_act05_admm_fixed"
CANDIDATES = ("oneshot_act05_admm_fixed", "oneshot_act05_admm_stable")


def bootstrap_interval(per_task: dict[str, list[float]], level: float = 0.9, draws: int = 10000,
                       seed: int = 0) -> tuple[float, float]:
    """The `level` percentile interval of the mean over tasks of each task's mean difference, the seeds of each
    task resampled with replacement (paired: a seed's difference is one draw)."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(statistics.fmean(rng.choices(v, k=len(v))) for v in per_task.values())
                   for _ in range(draws))
    lo = means[int((1 - level) / 2 * draws)]
    hi = means[min(draws - 1, int((1 + level) / 2 * draws))]
    return lo, hi


def verdict(key: str, row: dict, full_check: dict | None = None) -> dict:
    """The rule for one paired row ({"tasks": {task: {"values", "seeds", ...}}}, values as fractions)."""
    per_task = {t: [100 * x for x in st["values"]] for t, st in row["tasks"].items()}
    missing = {t: n - len(per_task.get(t, [])) for t, n in REQUIRED.items() if len(per_task.get(t, [])) < n}
    out: dict = {"row": key, "final": not missing, "missing_seeds": missing}
    if set(per_task) != set(REQUIRED) or any(len(v) < 2 for v in per_task.values()):
        out["verdict"] = "incomplete"
        return out
    task_means = {t: statistics.fmean(v) for t, v in per_task.items()}
    mean = statistics.fmean(task_means.values())
    lo, hi = bootstrap_interval(per_task)
    low_tasks = [t for t, m in task_means.items() if m < FLOOR.get(t, TASK_FLOOR)]
    full = None if full_check is None else full_check.get(key)
    out.update(mean=mean, interval=[lo, hi], task_means=task_means, low_tasks=low_tasks, full_preset_mean=full)
    if mean > 0 and lo >= MEAN_LOWER and not low_tasks:
        out["verdict"] = "go" if full is not None and full >= 0 else (
            "go, pending the full-preset check" if full is None else "no-go: the full-preset check reverses it")
    elif key == R1 and abs(mean) <= PARITY:
        out["verdict"] = "parity"
    else:
        out["verdict"] = "no-go"
    return out


def decide(pair: dict, full_check: dict | None = None) -> list[dict]:
    """Each candidate row of the paired table (run.paired's output) through the rule."""
    return [verdict(k, pair["rows"][k], full_check) for k in CANDIDATES if k in pair.get("rows", {})]


def markdown(decisions: list[dict], labels: dict[str, str]) -> list[str]:
    if not decisions:
        return []
    lines = ["", "The decision rule (go: mean > 0, its 90 % bootstrap interval's lower end ≥ -0.1, every task "
             "≥ -0.2 and CoLA ≥ -0.5, a full-preset check on two tasks not reversing it; parity: R1 within ±0.2; "
             f"seeds needed: {', '.join(f'{t} {n}' for t, n in REQUIRED.items())}):", ""]
    for d in decisions:
        status = "final" if d["final"] else "provisional, seeds missing: " + ", ".join(
            f"{t} {n}" for t, n in d["missing_seeds"].items())
        if d["verdict"] == "incomplete":
            lines.append(f"- {labels[d['row']]}: not enough paired seeds yet ({status})")
            continue
        low = f"; below its floor: {', '.join(d['low_tasks'])}" if d["low_tasks"] else ""
        lines.append(f"- {labels[d['row']]}: mean {d['mean']:+.2f} (90 % interval {d['interval'][0]:+.2f} to "
                     f"{d['interval'][1]:+.2f}){low} → **{d['verdict']}** ({status})")
    return lines
