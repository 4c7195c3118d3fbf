"""Task metrics as pure numpy functions (no sklearn/scipy needed at serving time)."""
from __future__ import annotations

import math

import numpy as np


def accuracy(pred, gold) -> float:
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float((pred == gold).mean())


def f1(pred, gold, positive: int = 1) -> float:
    pred, gold = np.asarray(pred) == positive, np.asarray(gold) == positive
    tp = float(np.sum(pred & gold))
    denom = float(np.sum(pred) + np.sum(gold))
    return 0.0 if denom == 0 else 2 * tp / denom


def mcc(pred, gold) -> float:
    """Matthews correlation for binary labels; 0 when a row or column of the confusion matrix is empty."""
    pred, gold = np.asarray(pred).astype(bool), np.asarray(gold).astype(bool)
    tp = float(np.sum(pred & gold))
    tn = float(np.sum(~pred & ~gold))
    fp = float(np.sum(pred & ~gold))
    fn = float(np.sum(~pred & gold))
    denom = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denom == 0 else float((tp * tn - fp * fn) / denom)


def pearson(pred, gold) -> float:
    pred, gold = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    if pred.std() == 0 or gold.std() == 0:
        return 0.0
    return float(np.corrcoef(pred, gold)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks for ties, as Spearman requires."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def spearman(pred, gold) -> float:
    pred, gold = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    return pearson(_ranks(pred), _ranks(gold))


def macro_f1(pred, gold) -> float:
    """Unweighted mean of the per-class F1 over the classes present in gold or pred."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    classes = np.union1d(np.unique(pred), np.unique(gold))
    return float(np.mean([f1(pred, gold, positive=c) for c in classes])) if len(classes) else 0.0


METRICS = {"accuracy": accuracy, "f1": f1, "macro_f1": macro_f1, "mcc": mcc, "pearson": pearson, "spearman": spearman}
CLASSIFICATION = ("accuracy", "f1", "macro_f1", "mcc")
REGRESSION = ("pearson", "spearman")


def compute(names, pred, gold) -> dict[str, float]:
    return {name: METRICS[name](pred, gold) for name in names}


def score(task, logits, labels) -> dict[str, float]:
    """A task's metrics for a model's logits [rows, classes] (regression: [rows, 1]) against its labels."""
    logits = np.asarray(logits)
    pred = logits[:, 0] if task.is_regression else logits.argmax(axis=1)
    return compute(task.metrics, pred, np.asarray(labels))


# What another runtime may change on the dev rows against the checkpoint's numerics (the export's
# check). A quantized network turns any change of float rounding (another kernel, summation order or
# runtime) into a few flipped borderline predictions, and which way they flip depends on the checkpoint
# (where more of its borderline rows happen to be wrong, any such change gains accuracy), so a test of
# "the changes favour neither side" would refuse valid exports: it is reported, not enforced. How many
# rows rounding flips: docs/results/2026-11-26-rounding-noise.md (bench/accuracy/rounding_noise.py).
MAX_CHANGED_SHARE = 0.01  # of the dev predictions (at least one row may change)
# A change of float precision the user chose (a float16 graph) changes more rows than rounding: there the
# check asks whether the accuracy differs, by McNemar's exact test on the changed rows.
MIN_MCNEMAR_P = 0.05
REGRESSION_MAX_DIFF = 0.2  # points of a regression metric, which moves continuously


def compare_predictions(task, logits: np.ndarray, ref_logits: np.ndarray, labels: np.ndarray) -> dict:
    """How `logits` differ from `ref_logits` on the same rows. Classification: the share of identical
    predictions, the rows only one of the two gets right, and McNemar's exact two-sided p-value for "both
    have the same accuracy" (from those discordant rows only: small p, a real difference; large p, what
    flipping a few borderline rows either way would give). Regression: the two scores' Pearson correlation
    and their mean and largest absolute difference."""
    if task.is_regression:
        a, b = logits[:, 0].astype(np.float64), ref_logits[:, 0].astype(np.float64)
        diff = np.abs(a - b)
        corr = float(np.corrcoef(a, b)[0, 1]) if len(a) > 1 and a.std() > 0 and b.std() > 0 else float("nan")
        return {"pearson_with_reference": round(corr, 6), "mean_abs_difference": round(float(diff.mean()), 6),
                "max_abs_difference": round(float(diff.max()), 6)}
    pred, ref = logits.argmax(axis=1), ref_logits.argmax(axis=1)
    right, ref_right = pred == labels, ref == labels
    only_here, only_ref = int((right & ~ref_right).sum()), int((~right & ref_right).sum())
    return {"identical_predictions": round(float((pred == ref).mean()), 6),
            "different_predictions": int((pred != ref).sum()),
            "right_here_only": only_here, "right_in_reference_only": only_ref,
            "mcnemar_exact_p": round(mcnemar_exact_p(only_here, only_ref), 6)}


def mcnemar_exact_p(b: int, c: int) -> float:
    """McNemar's exact test: the two-sided binomial p-value of b rows against c under equal odds."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2 ** n)


def prediction_check(task, got: np.ndarray, ref: np.ndarray, labels: np.ndarray,
                     max_metric_diff: float | None = None, precision_change: bool = False) -> tuple[dict, str | None]:
    """Whether logits `got` compute what `ref` does on labelled rows, allowing for float rounding: at most
    MAX_CHANGED_SHARE of the predictions change (one row always may), with McNemar's test of the changed rows
    recorded; a regression metric moves by at most REGRESSION_MAX_DIFF points. With `precision_change` (`got`
    runs at a lower float precision on purpose) the changed rows may be more, but their accuracy may not
    differ (McNemar p >= MIN_MCNEMAR_P). `max_metric_diff` adds a fixed bound (points) on the primary metric.
    (record, why it fails or None)."""
    return _check(task, got, ref, labels, compare_predictions(task, got, ref, labels), max_metric_diff,
                  precision_change)


def compare_within_rounding(task, logits: np.ndarray, ref_logits: np.ndarray, labels: np.ndarray) -> dict:
    """compare_predictions' record plus prediction_check's verdict: `within_rounding`, and `beyond_rounding`
    (why) when the changes exceed what float rounding explains."""
    cmp = compare_predictions(task, logits, ref_logits, labels)
    why = _check(task, logits, ref_logits, labels, cmp)[1]
    return cmp | {"within_rounding": why is None} | ({"beyond_rounding": why} if why else {})


def _check(task, got, ref, labels, cmp: dict, max_metric_diff: float | None = None,
           precision_change: bool = False) -> tuple[dict, str | None]:
    """prediction_check's rule on compare_predictions' record `cmp` of the same logits."""
    key = task.primary_metric
    diff = 100.0 * abs(score(task, got, labels)[key] - score(task, ref, labels)[key])
    rec: dict = {"dev_metric_diff_points": round(diff, 4)}
    why = None
    if task.is_regression:
        rec["allowed_metric_diff_points"] = REGRESSION_MAX_DIFF
        if diff > REGRESSION_MAX_DIFF:
            why = f"{key} moved by {diff:.2f} points (allowed {REGRESSION_MAX_DIFF})"
    else:
        changed, allowed = cmp["different_predictions"], max(1, int(MAX_CHANGED_SHARE * len(labels)))
        rec.update(changed_predictions=changed, allowed_changed_predictions=allowed,
                   right_here_only=cmp["right_here_only"], right_in_reference_only=cmp["right_in_reference_only"],
                   mcnemar_exact_p=cmp["mcnemar_exact_p"])
        p = cmp["mcnemar_exact_p"]
        if precision_change and p < MIN_MCNEMAR_P:
            why = (f"the {changed} changed predictions change the accuracy ({cmp['right_here_only']} right only here, "
                   f"{cmp['right_in_reference_only']} only in the reference; McNemar p = {p:.3g} < {MIN_MCNEMAR_P})")
        elif not precision_change and changed > allowed:
            why = (f"{changed} of {len(labels)} predictions changed (allowed {allowed}, {MAX_CHANGED_SHARE:.0%}: float "
                   "rounding alone flips a few borderline rows)")
    if why is None and max_metric_diff is not None and diff > max_metric_diff:
        why = f"{key} moved by {diff:.2f} points (allowed by --max-metric-diff: {max_metric_diff})"
    return rec, why
