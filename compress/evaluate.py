"""Dev-set evaluation, optionally with the activation fake-quant that the exported model reproduces."""
from __future__ import annotations

import contextlib
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
