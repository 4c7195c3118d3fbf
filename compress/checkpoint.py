"""Write and read HoloServe checkpoints from PyTorch/transformers models (the artifact contract's torch side)."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from holoserve.core.artifact import Artifact, ArtifactError, load_artifact, new_manifest, write_artifact
from holoserve.core.manifest import ActivationQuant, EmbeddingQuant, Quantization, WeightQuant
from holoserve.data.tasks import Task

# Tokenizer files copied from the base model folder when present; tokenizer.json is required.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def task_manifest(task: Task) -> dict[str, Any]:
    return {
        "name": task.name,
        "labels": list(task.labels),
        "pair": task.is_pair,
        "num_labels": task.num_labels,
        "regression": task.is_regression,
        "metrics": list(task.metrics),
    }


def _floats(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t.detach().float().cpu().tolist()]


def set_label_config(model: nn.Module, task: Task) -> None:
    cfg = model.config
    if task.is_regression:
        cfg.problem_type = "regression"
        cfg.id2label, cfg.label2id = {0: "score"}, {"score": 0}
    else:
        cfg.problem_type = "single_label_classification"
        cfg.id2label = dict(enumerate(task.labels))
        cfg.label2id = {lab: i for i, lab in enumerate(task.labels)}


@dataclass(frozen=True)
class CheckpointContents:
    """What a checkpoint's manifest records besides the weights and the tokenizer."""

    task: Task
    base_model: str
    max_seq_length: int
    sparse_layers: list[str] | None  # the N:M sparse Linears (None: a dense model)
    nm: tuple[int, int] = (2, 4)
    weight_scales: Mapping[str, torch.Tensor] | None = None  # per-channel INT8 scales (None: float weights)
    act_amax: Mapping[str, float] | None = None  # INT8 activation ranges (None: float activations)
    embedding_scales: Mapping[str, torch.Tensor] | None = None  # per-row INT8 word-embedding scales
    metrics: Mapping[str, Any] | None = None
    training: Mapping[str, Any] | None = None
    sequence_length: Mapping[str, Any] | None = None  # how max_seq_length was chosen (compress.seqlen)


def save_checkpoint(
    model: nn.Module,
    tokenizer_dir: str | os.PathLike,
    out: str | os.PathLike,
    contents: CheckpointContents,
    *,
    overwrite: bool = False,
) -> Artifact:
    """Save `model` (plain HF modules, weights already projected) as a validated checkpoint.

    The writer re-reads the saved safetensors and proves every sparse layer is N:M and on its
    INT8 grid before the folder appears at `out`.
    """
    c = contents
    task, sparse_layers, nm, weight_scales = c.task, c.sparse_layers, c.nm, c.weight_scales
    act_amax, embedding_scales = c.act_amax, c.embedding_scales
    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ArtifactError(f"{tokenizer_dir} has no tokenizer.json (a fast tokenizer is required)")
    set_label_config(model, task)
    sparsity = None
    if sparse_layers:
        sparsity = {"pattern": f"{nm[0]}:{nm[1]}", "n": nm[0], "m": nm[1], "axis": "input",
                    "layers": list(sparse_layers)}
    quantization = None
    if weight_scales:
        quantization = Quantization(
            weights=WeightQuant(scales={k: _floats(v) for k, v in weight_scales.items()}),
            embeddings={k: EmbeddingQuant(scales=_floats(v)) for k, v in embedding_scales.items()}
            if embedding_scales else None,
            activations=None if act_amax is None
            else ActivationQuant(amax={k: float(v) for k, v in act_amax.items()}),
        ).model_dump(mode="json")
    manifest = new_manifest(
        base_model=c.base_model,
        task=task_manifest(task),
        max_seq_length=c.max_seq_length,
        sparsity=sparsity,
        quantization=quantization,
        metrics=c.metrics,
        training=c.training,
        sequence_length=c.sequence_length,
    )
    with tempfile.TemporaryDirectory(prefix="holoserve-save-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        files: dict[str, Any] = {"config.json": Path(tmp) / "config.json",
                                 "model.safetensors": Path(tmp) / "model.safetensors"}
        if not files["model.safetensors"].is_file():
            raise ArtifactError("save_pretrained did not write a single model.safetensors "
                                "(sharded models are not supported)")
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                files[name] = tokenizer_dir / name
        return write_artifact(out, manifest, files, overwrite=overwrite)


def load_model(path: str | os.PathLike | Artifact, *, verify: bool = True):
    """Load a checkpoint into a transformers model (eval mode). Returns (model, artifact)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load is noise (and carriage returns in a log file)
    art = path if isinstance(path, Artifact) else load_artifact(path, verify=verify)
    model = AutoModelForSequenceClassification.from_pretrained(str(art.path), local_files_only=True)
    model.eval()
    return model, art
