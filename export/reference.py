"""What an export is calibrated and checked on: the checkpoint's rows, batched as `holoserve eval`
batches them (or built-in sentences without any), and the PyTorch fake-quant reference logits."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from holoserve import HoloServeError
from holoserve.core.artifact import Artifact, ArtifactError
from holoserve.core.tokenizer import load_tokenizer

# The rows for calibration and for the parity check when no data is given (the documented fallback).
BUILTIN_SENTENCES = (
    "the movie was a delight from start to finish .",
    "a dull , lifeless and overlong film that never finds its footing .",
    "it 's not a great story , but the actors make it worth watching .",
    "i hated every minute of it .",
    "an honest , funny and surprisingly moving portrait of a family .",
    "the plot is thin and the acting is worse .",
    "one of the best films of the year .",
    "a man is playing a guitar on the street while a dog watches .",
    "the company said its profit rose in the third quarter .",
    "she was not sure whether the plane had taken off .",
    "this is the kind of film that gives the genre a bad name , and it knows it .",
    "great fun .",
    "they said the new car was too expensive for a family of four .",
    "the story is sad but never sentimental , and the ending is earned .",
    "awful .",
    "two children are riding a horse near the river .",
)


def make_tokenizer(art: Artifact, max_length: int | None = None):
    """The checkpoint's tokenizer, padding each batch to its longest row (the export's fixed-shape batches)."""
    return load_tokenizer(art.path, max_length or art.max_seq_length, pad=True)


def encode_batches(tok, texts: Sequence[str], pairs: Sequence[str] | None = None, batch_size: int = 32):
    """Yield (indices, {input_ids, attention_mask, token_type_ids} int64) batches, grouped by length."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]) + (len(pairs[i]) if pairs else 0))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        if pairs:
            encs = tok.encode_batch([(texts[i], pairs[i]) for i in idx])
        else:
            encs = tok.encode_batch([texts[i] for i in idx])
        yield idx, {
            "input_ids": np.asarray([e.ids for e in encs], dtype=np.int64),
            "attention_mask": np.asarray([e.attention_mask for e in encs], dtype=np.int64),
            "token_type_ids": np.asarray([e.type_ids for e in encs], dtype=np.int64),
        }


def task_rows(art: Artifact, split: str, data, limit: int | None):
    """(task, texts, pairs, labels) of a split for the checkpoint's task, or None when no rows were given."""
    from holoserve.data.sources import rows_for, trained_on_embedded
    from holoserve.data.tasks import task_of

    task = task_of(art)
    ex = rows_for(task, split, data, limit=limit, embedded=trained_on_embedded(art))
    if ex is None:
        return None
    return task, [e.text for e in ex], ([e.text_pair for e in ex] if task.is_pair else None), [e.label for e in ex]


EVAL_BATCH_SIZE = 128  # `holoserve eval`'s default --batch-size


def eval_batches_np(art: Artifact, split: str, data, limit: int | None = None, batch_size: int = EVAL_BATCH_SIZE):
    """(task, [(row indices, numpy batch)], labels) exactly as `holoserve eval` batches the split, or None."""
    from holoserve.compress.data import encode, eval_batches
    from holoserve.data.sources import rows_for, trained_on_embedded
    from holoserve.data.tasks import task_of

    task = task_of(art)
    rows = rows_for(task, split, data, limit=limit, embedded=trained_on_embedded(art))
    if rows is None:
        return None
    data = encode(load_tokenizer(art.path, art.max_seq_length), rows, task.is_regression)
    out = []
    for idx, b in eval_batches(data, batch_size):
        b.pop("labels")
        out.append((idx, {k: v.numpy() for k, v in b.items()}))
    return task, out, data.labels


def load_torch_model(art: Artifact):
    """The checkpoint as an fp32 HF model with eager attention (explicit attention MatMuls)."""
    try:
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise HoloServeError(f"export needs torch and transformers ({e}): pip install 'holoserve[export]'") from None
    hf_logging.disable_progress_bar()  # a bar per load is noise (and carriage returns in a log file)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(art.path), local_files_only=True, attn_implementation="eager"
    )
    model.eval()
    return model


def quantized_layers(art: Artifact) -> list[str]:
    q = art.manifest.quantization
    if not q:
        raise ArtifactError(
            f"{art.path}: the manifest has no INT8 quantization section; only compressed (INT8) checkpoints "
            "can be exported with QDQ nodes — run `holoserve compress` first"
        )
    if not (q.activations and q.activations.amax):
        raise ArtifactError(
            f"{art.path}: the manifest has no calibrated activation ranges (quantization.activations.amax); "
            "re-run `holoserve compress` (calibration) before exporting"
        )
    return list(q.weights.scales)


def reference_logits(model, art: Artifact, batches, *, tensorrt: bool = False) -> np.ndarray:
    """The checkpoint's fake-quant numerics in PyTorch (what `holoserve eval` computes); with `tensorrt`,
    also the extra quantizers TensorRT QAT trained (what its `model.trt.onnx` computes).

    Pass the model from compress.checkpoint.load_model, as `holoserve eval` does: the quantized
    network amplifies float noise (e.g. eager against SDPA attention flips a few predictions).
    """
    import contextlib

    import torch

    from holoserve.compress.quant import input_quantizers, tensorrt_quantizers

    layers = quantized_layers(art)
    amax = art.activation_amax()
    out = []
    with torch.no_grad(), input_quantizers(model, amax, layers, exact=True), \
            (tensorrt_quantizers(model, amax, layers) if tensorrt else contextlib.nullcontext()):
        for b in batches:
            out.append(model(**{k: torch.from_numpy(v) for k, v in b.items()}).logits.float().numpy())
    return np.concatenate(out, axis=0)
