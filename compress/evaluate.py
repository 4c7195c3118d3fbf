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


# a dev row's forward pass, in dense training steps (one forward and backward over a 32-row batch; the ratio
# of one quick-preset run on a CPU), for the overall progress bar's ETA
EVAL_ROW_COST = 0.7 / 128


def predict(model: nn.Module, data: Encoded, batch_size: int = 128, progress: str | None = None) -> np.ndarray:
    """Logits for every row of `data`, in row order; `progress` names a progress phase (holoserve.core.progress)."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        with torch.inference_mode():
            return predict_with(lambda batch: model(**to_device(batch, device)).logits.float().cpu().numpy(),
                                data, batch_size, progress)
    finally:
        model.train(was_training)


def predict_with(run, data: Encoded, batch_size: int = 128, progress: str | None = None) -> np.ndarray:
    """Logits from `run(batch of int64 tensors, no labels) -> [rows, labels] array` for every row of
    `data`, in row order, over `holoserve eval`'s batches (length-sorted, padded to each longest); with
    `progress`, a progress phase of that name counts the batches."""
    from holoserve.core.progress import current

    out: np.ndarray | None = None
    with current().phase(progress or "", math.ceil(len(data) / batch_size), unit="batch",
                         weight=batch_size * EVAL_ROW_COST, enabled=progress is not None) as bar:
        for idx, batch in eval_batches(data, batch_size):
            batch.pop("labels")
            logits = np.asarray(run(batch))
            if out is None:
                out = np.zeros((len(data), logits.shape[1]), dtype=np.float32)
            out[idx] = logits
            bar.update(1)
    assert out is not None
    return out


def evaluate(
    model: nn.Module,
    task: Task,
    data: Encoded,
    *,
    batch_size: int = 128,
    act_amax: Mapping[str, float] | None = None,
    quant_layers: list[str] | None = None,
    tensorrt: bool = False,
    progress: str | None = None,
) -> dict[str, float]:
    """Task metrics on `data`; with `act_amax` the named Linears see fake-quantized inputs, and with
    `tensorrt` also the TensorRT placement's extra tensors (a TensorRT-QAT checkpoint's deployed numerics).
    `progress` names the progress phase that counts its batches (none without)."""
    logits = predict_quantized(model, data, batch_size=batch_size, act_amax=act_amax, quant_layers=quant_layers,
                               tensorrt=tensorrt, progress=progress)
    return score(task, logits, data.labels)


def predict_quantized(model: nn.Module, data: Encoded, *, batch_size: int = 128,
                      act_amax: Mapping[str, float] | None = None, quant_layers: list[str] | None = None,
                      tensorrt: bool = False, progress: str | None = None) -> np.ndarray:
    """`predict` under the activation fake-quant that `evaluate` describes."""
    with contextlib.ExitStack() as stack:
        if act_amax is not None:
            stack.enter_context(input_quantizers(model, act_amax, quant_layers or [], exact=True))
            if tensorrt:
                stack.enter_context(tensorrt_quantizers(model, act_amax, quant_layers or []))
        return predict(model, data, batch_size, progress)
