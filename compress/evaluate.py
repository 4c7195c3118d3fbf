"""Evaluation: a model's logits and task metrics on encoded rows, optionally with the activation fake-quant
that the exported model reproduces; and a checkpoint's metrics on labelled rows, through the PyTorch model or
an export through the server's own backend (`evaluate_checkpoint`, what `holoserve eval` runs)."""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from holoserve import HoloServeError
from holoserve.core.choices import EVAL_BACKEND_ALIASES, EVAL_BACKENDS, OPENVINO_KERNELS_DEFAULT
from holoserve.core.manifest import ONNXRUNTIME
from holoserve.data.metrics import score
from holoserve.data.tasks import Task

from .data import Encoded, eval_batches, to_device
from .quant import input_quantizers, tensorrt_quantizers


# a dev row's forward pass, in dense training steps (one forward and backward over a training batch), for the
# overall progress bar's ETA
EVAL_ROW_COST = 0.7 / 128


def format_metrics(metrics: Mapping[str, float]) -> str:
    """Metrics as one log line's `name=value` pairs."""
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


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


@dataclass(frozen=True)
class EvalOptions:
    """What `evaluate_checkpoint` scores, and through what."""

    # the rows: `data` (DataOptions with a dev file, the user's own rows), else a GLUE shortcut's split
    data: Any = None  # holoserve.data.sources.DataOptions
    task: str | None = None  # GLUE shortcut (default: the checkpoint's task)
    data_dir: str | os.PathLike | None = None  # GLUE folder (default: $HOLOSERVE_DATA_DIR, or the embedded sample)
    split: str = "dev"
    limit: int | None = None  # the first N rows only
    batch_size: int = 128
    # what computes the logits: "torch" (the checkpoint's own numerics), or an export through the server's
    # backend of that name ("onnxruntime", "openvino"); `onnx` is the same as backend="onnxruntime"
    backend: str | None = None
    onnx: bool = False
    onnx_export: str = ONNXRUNTIME  # with onnxruntime: which ONNX export
    fp32: bool = False  # torch: no activation fake-quant (weights still as stored)
    threads: int = 0  # the backend's threads (0: its default)
    device: str = "auto"  # where the PyTorch model runs
    openvino_precision: str | None = None
    openvino_kernels: str | None = None
    compare: bool = False  # also score the checkpoint's own numerics and say how the backend's predictions differ
    predictions: Path | None = None  # also write each row's prediction here, as JSON Lines


def evaluate_checkpoint(path, options: EvalOptions = EvalOptions()) -> dict:
    """Metrics of a checkpoint on labelled rows (EvalOptions: which rows, through what); with
    `options.predictions` (a path) also each row's prediction, as JSON Lines. With `options.compare` the result
    also says how a backend's predictions differ from the checkpoint's own numerics on the same rows."""
    import time

    from holoserve.core.tokenizer import load_tokenizer
    from holoserve.data import sample
    from holoserve.data.glue import read_split
    from holoserve.data.sources import rows_for, trained_on_embedded
    from holoserve.data.tasks import get_task, task_of

    from .checkpoint import load_model
    from .data import encode
    from .distributed import resolve_device

    o = options
    data, data_dir, split, limit, batch_size = o.data, o.data_dir, o.split, o.limit, o.batch_size
    predictions, compare, fp32, threads = o.predictions, o.compare, o.fp32, o.threads
    backend = _check_backend_options(o)
    if predictions is not None:  # a bad path fails now, not after the scoring
        _predictions_folder(predictions)
    model = None
    if backend == "torch" or compare:
        model, art = load_model(path)
        model.to(resolve_device(o.device))
    else:
        from holoserve.core.artifact import load_artifact

        art = load_artifact(path)
    tok = load_tokenizer(art.path, art.max_seq_length)
    if data is not None and data.dev is not None:
        task_obj = task_of(art)
        rows = rows_for(task_obj, "dev", data, limit=limit)
        split = data.dev.name
    else:
        task_obj = get_task(o.task or art.task_name)
        if task_obj.name != art.task_name:
            raise HoloServeError(f"{path} was trained for {art.task_name!r}, not {task_obj.name!r}; pass its dev "
                                 "rows with --dev FILE")
        if data_dir is None and trained_on_embedded(art):  # its own rows: the sample that ships with HoloServe
            data_dir = sample.root()
        rows = read_split(task_obj, split, data_dir, limit=limit)
    data = encode(tok, rows, task_obj.is_regression)
    t0 = time.perf_counter()
    if backend == "onnxruntime":
        logits, numerics = _onnx_logits(art, data, batch_size, threads, o.onnx_export)
    elif backend == "openvino":
        logits, numerics = _openvino_logits(art, data, batch_size, threads, o.openvino_precision or "auto",
                                            o.openvino_kernels or OPENVINO_KERNELS_DEFAULT)
    else:
        logits, numerics = _pytorch_logits(model, art, data, batch_size, fp32)
    metrics = score(task_obj, logits, data.labels)
    if predictions is not None:
        write_predictions(predictions, rows, logits, task_obj.is_regression, art.labels)
    out = {
        "checkpoint": str(art.path),
        "task": task_obj.name,
        "split": split,
        "rows": len(data),
        "numerics": numerics,
        "metrics": metrics,
        "primary": task_obj.primary_metric,
        "manifest_metrics": art.manifest.metrics.model_dump(mode="json", exclude_none=True),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if compare:
        from holoserve.data.metrics import compare_within_rounding

        ref, ref_numerics = _pytorch_logits(model, art, data, batch_size, False)
        ref_metrics = score(task_obj, ref, data.labels)
        primary = task_obj.primary_metric
        out["compare"] = {"reference": ref_numerics + ", the checkpoint's numerics", "reference_metrics": ref_metrics,
                          "primary_difference": round(metrics[primary] - ref_metrics[primary], 6),
                          # with the export's own rule: float rounding alone flips a few borderline rows
                          **compare_within_rounding(task_obj, logits, ref, data.labels)}
    return out


def _check_backend_options(o: EvalOptions) -> str:
    """The backend to score through, or a clear error for options that do not go together."""
    backend, onnx, fp32, compare = o.backend, o.onnx, o.fp32, o.compare
    openvino_precision, openvino_kernels, onnx_export = o.openvino_precision, o.openvino_kernels, o.onnx_export
    if onnx and backend not in (None, "onnxruntime"):
        raise HoloServeError(f"--onnx means --backend onnxruntime, not --backend {backend}: give one of them")
    backend = "onnxruntime" if onnx else EVAL_BACKEND_ALIASES.get(backend, backend or "torch")
    if backend not in EVAL_BACKENDS:
        raise HoloServeError(f"unknown backend {backend!r}: choose one of {', '.join(EVAL_BACKENDS)}")
    if fp32 and backend != "torch":
        raise HoloServeError(f"--fp32 and --backend {backend} (or --onnx) do not combine: an export always has the "
                             "checkpoint's numerics; drop --fp32")
    for flag, value in (("--openvino-precision", openvino_precision), ("--openvino-kernels", openvino_kernels)):
        if value is not None and backend != "openvino":
            raise HoloServeError(f"{flag} only applies to --backend openvino (got --backend {backend})")
    if onnx_export != ONNXRUNTIME and backend != "onnxruntime":
        raise HoloServeError(f"--onnx-export only applies to --backend onnxruntime (got --backend {backend})")
    if compare and backend == "torch":
        raise HoloServeError("--compare compares a backend's predictions with the checkpoint's numerics: add "
                             "--backend onnxruntime or --backend openvino")
    return backend


def _pytorch_logits(model, art, data, batch_size: int, fp32: bool) -> tuple[np.ndarray, str]:
    """The PyTorch model's logits: the checkpoint's numerics (int8 activations fake-quantized with exact
    integer sums), or with `fp32` its stored weights on float activations."""
    from holoserve.core.artifact import input_layers

    amax = art.activation_amax()
    layers = input_layers(amax)
    use_quant = bool(amax) and not fp32
    logits = predict_quantized(model, data, batch_size=batch_size, act_amax=amax if use_quant else None,
                               quant_layers=layers if use_quant else None)
    numerics = ("int8 weights + int8 activations (fake-quant)" if use_quant
                else ("int8 weights, fp32 activations" if art.quantized else "fp32"))
    return logits, numerics


def _onnx_logits(art, data, batch_size: int, threads: int, export_key: str) -> tuple[np.ndarray, str]:
    """An ONNX export through the server's own ONNX Runtime backend, on `holoserve eval`'s batches."""
    from holoserve.backends.onnxruntime import OrtBackend

    # a clear error when there is no such export
    backend = OrtBackend(art, device="cpu", threads=threads or None, export_key=export_key)
    return _backend_logits(backend, data, batch_size), f"ONNX Runtime ({backend.path.name}, {export_key} export, CPU)"


def _openvino_logits(art, data, batch_size: int, threads: int, precision: str, kernels: str) -> tuple[np.ndarray, str]:
    """The `openvino` export through the server's own OpenVINO backend, on `holoserve eval`'s batches."""
    from holoserve.backends.openvino import OpenVinoBackend, inference_precision

    # clear errors (BackendUnavailable) without OpenVINO installed or without the export
    backend = OpenVinoBackend(art, threads=threads or None, precision=precision, kernels=kernels)
    return _backend_logits(backend, data, batch_size), (
        f"OpenVINO ({backend.path.name}, float ops in {inference_precision(backend.compiled)}, CPU; 2:4 kernels "
        f"{backend.kernels.get('status', 'off')})")


def _backend_logits(backend, data, batch_size: int) -> np.ndarray:
    return predict_with(lambda b: backend.infer(b["input_ids"].numpy(), b["attention_mask"].numpy(),
                                                b["token_type_ids"].numpy()), data, batch_size)


def write_predictions(path: Path, rows, logits: np.ndarray, regression: bool, labels: list[str] | None) -> None:
    """One JSON object per row, in row order, written atomically: the row's index, text (and text_pair),
    gold label and prediction; class probabilities (softmax of the logits), or a regression's score."""
    from holoserve.core.files import atomic_write_text

    _predictions_folder(path)
    lines = []
    for i, (row, z) in enumerate(zip(rows, logits)):
        rec: dict = {"row": i, "text": row.text}
        if row.text_pair is not None:
            rec["text_pair"] = row.text_pair
        if regression:
            rec.update(label=float(row.label), score=round(float(z[0]), 6))
        else:
            p = np.exp(z - z.max())
            p /= p.sum()
            names = labels or [str(k) for k in range(len(z))]
            rec.update(label=names[int(row.label)], prediction=names[int(z.argmax())],
                       probabilities={n: round(float(q), 6) for n, q in zip(names, p)})
        lines.append(json.dumps(rec, ensure_ascii=False))
    try:
        atomic_write_text(path, "\n".join(lines) + "\n" if lines else "")
    except OSError as e:
        raise HoloServeError(f"--predictions {path}: cannot write it ({e.strerror}); choose a writable path") from None


def _predictions_folder(path) -> None:
    """Make the folder of a --predictions file, or say clearly why the path cannot be one."""
    path = Path(path)
    if path.is_dir():
        raise HoloServeError(f"--predictions {path} is a folder; give a file name, e.g. {path / 'predictions.jsonl'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HoloServeError(f"--predictions {path}: cannot make its folder {path.parent} ({e.strerror}); "
                             "choose a writable path") from None
