"""Dev-set evaluation, optionally with the activation fake-quant that the exported model reproduces."""
from __future__ import annotations

import contextlib
import math
from typing import Mapping

import numpy as np
import torch
from torch import nn

from holoserve.data.metrics import score
from holoserve.data.tasks import Task

from .data import Encoded, eval_batches, to_device
from .quant import input_quantizers, tensorrt_quantizers


def predict(model: nn.Module, data: Encoded, batch_size: int = 128) -> np.ndarray:
    """Logits for every row of `data`, in row order."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        with torch.inference_mode():
            return predict_with(lambda batch: model(**to_device(batch, device)).logits.float().cpu().numpy(),
                                data, batch_size)
    finally:
        model.train(was_training)


def predict_with(run, data: Encoded, batch_size: int = 128) -> np.ndarray:
    """Logits from `run(batch of int64 tensors, no labels) -> [rows, labels] array` for every row of
    `data`, in row order, over `holoserve eval`'s batches (length-sorted, padded to each longest)."""
    out: np.ndarray | None = None
    for idx, batch in eval_batches(data, batch_size):
        batch.pop("labels")
        logits = np.asarray(run(batch))
        if out is None:
            out = np.zeros((len(data), logits.shape[1]), dtype=np.float32)
        out[idx] = logits
    assert out is not None
    return out


def compare_predictions(task: Task, logits: np.ndarray, ref_logits: np.ndarray, labels: np.ndarray) -> dict:
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


def evaluate(
    model: nn.Module,
    task: Task,
    data: Encoded,
    *,
    batch_size: int = 128,
    act_amax: Mapping[str, float] | None = None,
    quant_layers: list[str] | None = None,
    tensorrt: bool = False,
) -> dict[str, float]:
    """Task metrics on `data`; with `act_amax` the named Linears see fake-quantized inputs, and with
    `tensorrt` also the TensorRT placement's extra tensors (a TensorRT-QAT checkpoint's deployed numerics)."""
    logits = predict_quantized(model, data, batch_size=batch_size, act_amax=act_amax, quant_layers=quant_layers,
                               tensorrt=tensorrt)
    return score(task, logits, data.labels)


def predict_quantized(model: nn.Module, data: Encoded, *, batch_size: int = 128,
                      act_amax: Mapping[str, float] | None = None, quant_layers: list[str] | None = None,
                      tensorrt: bool = False) -> np.ndarray:
    """`predict` under the activation fake-quant that `evaluate` describes."""
    with contextlib.ExitStack() as stack:
        if act_amax is not None:
            stack.enter_context(input_quantizers(model, act_amax, quant_layers or [], exact=True))
            if tensorrt:
                stack.enter_context(tensorrt_quantizers(model, act_amax, quant_layers or []))
        return predict(model, data, batch_size)
