"""`holoserve eval CHECKPOINT`: dev metrics with the numerics the export reproduces, on the checkpoint's own
dev rows (the embedded sample it was trained on), a GLUE split (--data-dir DIR) or the user's file (--dev FILE).

Weights are used exactly as stored (int8 × per-channel scale); with INT8 activations in the
manifest, every encoder Linear input is fake-quantized per tensor with the manifest's amax.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from holoserve import HoloServeError
from holoserve.cli_options import advanced
from holoserve.core.choices import OPENVINO_KERNELS, OPENVINO_KERNELS_DEFAULT, OPENVINO_PRECISIONS
from holoserve.core.manifest import ONNXRUNTIME, TENSORRT_ONNX

# What `holoserve eval` can score through: the PyTorch fake-quant model (the checkpoint's own numerics),
# or an export through the server's own CPU backend.
EVAL_BACKENDS = ("pytorch", "onnxruntime", "openvino")


def add_arguments(p: argparse.ArgumentParser) -> None:
    adv = advanced(p)
    p.add_argument("checkpoint", type=Path, help="HoloServe checkpoint folder")
    g = p.add_argument_group("data", "the rows to score: --dev FILE (your own labelled rows, labels spelled as in "
                                     "training), or a GLUE shortcut's split in --data-dir; a checkpoint trained on "
                                     "the embedded sample is scored on the sample's dev rows by default")
    g.add_argument("--dev", metavar="FILE", help="labelled rows: CSV, TSV, JSON Lines, Parquet or a "
                                                 "datasets.save_to_disk folder")
    g.add_argument("--text-column", metavar="NAME", help="text column (default: text, sentence, sentence1, question)")
    g.add_argument("--text-pair-column", metavar="NAME", help="second text of a pair task")
    g.add_argument("--label-column", metavar="NAME", help="label column (default: label, labels or score)")
    g.add_argument("--no-header", action="store_true", help="CSV/TSV without a header line")
    g.add_argument("--task", help="GLUE shortcut (default: the checkpoint's task)")
    g.add_argument("--data-dir", help="GLUE folder (default: $HOLOSERVE_DATA_DIR)")
    g.add_argument("--split", default="dev", help="GLUE split to score (default: dev)")
    adv.add_argument("--limit", type=int, help="score only the first N rows")
    adv.add_argument("--batch-size", type=int, default=128)
    adv.add_argument("--fp32", action="store_true", help="skip activation fake-quant (weights still as stored)")
    p.add_argument("--backend", choices=EVAL_BACKENDS, default=None,
                   help="what computes the logits: pytorch (default), the fake-quant model with the checkpoint's "
                        "numerics; onnxruntime or openvino, an export through the server's own backend of that "
                        "name, on the same batches (`holoserve export --target onnxruntime|openvino` first)")
    p.add_argument("--onnx", action="store_true", help="the same as --backend onnxruntime")
    p.add_argument("--compare", action="store_true",
                   help="with --backend onnxruntime or openvino: also score the checkpoint's own numerics on the "
                        "same rows and report how the backend's predictions differ: identical share, rows only "
                        "one of them gets right, McNemar's exact test of whether their accuracies differ "
                        "(a regression: the correlation of the two scores and their largest difference), and whether "
                        "that is within what float rounding explains (the rule `holoserve export` checks)")
    adv.add_argument("--openvino-precision", choices=OPENVINO_PRECISIONS, default=None,
                     help="with --backend openvino: the precision of OpenVINO's float ops, as `holoserve serve "
                          "--openvino-precision` takes it (default: auto, the CPU plugin's choice, bf16 on CPUs "
                          "with bf16 units)")
    adv.add_argument("--openvino-kernels", choices=OPENVINO_KERNELS, default=None,
                     help="with --backend openvino: run the 2:4 INT8 Linears on HoloServe's kernels, as `holoserve "
                          "serve --openvino-kernels` takes it (default: " + OPENVINO_KERNELS_DEFAULT + ")")
    adv.add_argument("--onnx-export", default=ONNXRUNTIME, choices=(ONNXRUNTIME, TENSORRT_ONNX),
                   help="with --onnx: which export; 'onnxruntime' (what `holoserve serve` runs on a CPU) or "
                        "'tensorrt-onnx' (the TensorRT placement, emulated on the CPU)")
    adv.add_argument("--threads", type=int, default=0,
                     help="the backend's threads with --backend onnxruntime|openvino (0 = its default)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the PyTorch model runs: auto = a CUDA GPU when torch sees one (default: auto)")
    p.add_argument("--predictions", metavar="FILE", type=Path,
                   help="also write one JSON line per scored row: its texts, gold label and prediction (with "
                        "the class probabilities, or the score of a regression), in row order")


def evaluate_checkpoint(path, task=None, data_dir=None, split="dev", limit=None, batch_size=128, fp32=False,
                        onnx=False, threads=0, onnx_export=ONNXRUNTIME, device="auto", data=None,
                        predictions=None, backend=None, openvino_precision=None, compare=False,
                        openvino_kernels=None) -> dict:
    """Dev metrics of a checkpoint: on `data` (DataOptions with a dev file), else a GLUE split; with
    `predictions` (a path) also each row's prediction, as JSON Lines. `backend` (or `onnx=True`, the same as
    backend="onnxruntime") scores an export through the server's backend of that name; with `compare` the
    result also says how its predictions differ from the checkpoint's own numerics on the same rows."""
    import time

    from holoserve.data import sample
    from holoserve.data.glue import read_split
    from holoserve.data.sources import rows_for, trained_on_embedded
    from holoserve.data.tasks import get_task, task_of

    from .checkpoint import load_model
    from holoserve.core.tokenizer import load_tokenizer

    from .data import encode
    from .evaluate import score

    backend = _check_backend_options(backend, onnx, fp32, openvino_precision, compare, onnx_export, openvino_kernels)
    if predictions is not None:  # a bad path fails now, not after the scoring
        _predictions_folder(predictions)
    model = None
    if backend == "pytorch" or compare:
        from .pipeline import resolve_device

        model, art = load_model(path)
        model.to(resolve_device(device))
    else:
        from holoserve.core.artifact import load_artifact

        art = load_artifact(path)
    tok = load_tokenizer(art.path, art.max_seq_length)
    if data is not None and data.dev is not None:
        task_obj = task_of(art)
        rows = rows_for(task_obj, "dev", data, limit=limit)
        split = data.dev.name
    else:
        task_obj = get_task(task or art.task_name)
        if task_obj.name != art.task_name:
            raise HoloServeError(f"{path} was trained for {art.task_name!r}, not {task_obj.name!r}; pass its dev "
                                 "rows with --dev FILE")
        if data_dir is None and trained_on_embedded(art):  # its own rows: the sample that ships with HoloServe
            data_dir = sample.root()
        rows = read_split(task_obj, split, data_dir, limit=limit)
    data = encode(tok, rows, task_obj.is_regression)
    t0 = time.perf_counter()
    if backend == "onnxruntime":
        logits, numerics = _onnx_logits(art, data, batch_size, threads, onnx_export)
    elif backend == "openvino":
        logits, numerics = _openvino_logits(art, data, batch_size, threads, openvino_precision or "auto",
                                            openvino_kernels or OPENVINO_KERNELS_DEFAULT)
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


def _check_backend_options(backend, onnx: bool, fp32: bool, openvino_precision, compare: bool, onnx_export,
                           openvino_kernels=None) -> str:
    """The backend to score through, or a clear error for options that do not go together."""
    if onnx and backend not in (None, "onnxruntime"):
        raise HoloServeError(f"--onnx means --backend onnxruntime, not --backend {backend}: give one of them")
    backend = "onnxruntime" if onnx else (backend or "pytorch")
    if backend not in EVAL_BACKENDS:
        raise HoloServeError(f"unknown backend {backend!r}: choose one of {', '.join(EVAL_BACKENDS)}")
    if fp32 and backend != "pytorch":
        raise HoloServeError(f"--fp32 and --backend {backend} (or --onnx) do not combine: an export always has the "
                             "checkpoint's numerics; drop --fp32")
    for flag, value in (("--openvino-precision", openvino_precision), ("--openvino-kernels", openvino_kernels)):
        if value is not None and backend != "openvino":
            raise HoloServeError(f"{flag} only applies to --backend openvino (got --backend {backend})")
    if onnx_export != ONNXRUNTIME and backend != "onnxruntime":
        raise HoloServeError(f"--onnx-export only applies to --backend onnxruntime (got --backend {backend})")
    if compare and backend == "pytorch":
        raise HoloServeError("--compare compares a backend's predictions with the checkpoint's numerics: add "
                             "--backend onnxruntime or --backend openvino")
    return backend


def _pytorch_logits(model, art, data, batch_size: int, fp32: bool) -> tuple[np.ndarray, str]:
    """The PyTorch model's logits: the checkpoint's numerics (int8 activations fake-quantized with exact
    integer sums), or with `fp32` its stored weights on float activations."""
    from holoserve.core.artifact import input_layers

    from .evaluate import predict_quantized

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
    from .evaluate import predict_with

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


def run(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit <= 0:
        raise HoloServeError("--limit must be a positive number")
    from holoserve.data.sources import data_options

    out = evaluate_checkpoint(args.checkpoint, args.task, args.data_dir, args.split, args.limit, args.batch_size,
                              args.fp32, args.onnx, args.threads, args.onnx_export, args.device,
                              data=data_options(args), predictions=args.predictions, backend=args.backend,
                              openvino_precision=args.openvino_precision, compare=args.compare,
                              openvino_kernels=args.openvino_kernels)
    print(json.dumps(out, indent=2))
    return 0
