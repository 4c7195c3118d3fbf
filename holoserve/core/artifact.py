"""The checkpoint/artifact contract shared by compress, export and the server.

A checkpoint is a folder:

    manifest.json       this module's format (versioned), written last
    config.json         Hugging Face config (BertForSequenceClassification, id2label/label2id)
    model.safetensors   fp32 weights; every sparse Linear weight equals int8 codes x per-channel scale
    tokenizer.json      fast tokenizer (the server needs only this)
    ...                 optional: vocab.txt, tokenizer_config.json, model.onnx, model.plan + .json sidecar

Writers are atomic: a new checkpoint is built in a temporary sibling folder, fsynced and renamed
into place; files added later (an ONNX export) are written to a temporary name and renamed, and
the manifest is rewritten the same way. Readers validate everything they rely on and raise
`ArtifactError` with a message that names the problem and the fix. Nothing is ever unpickled.
"""
from __future__ import annotations

import json
import os
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from .manifest import DENSE_MODULES, FORMAT, SCHEMA_VERSION, ArtifactError, Manifest, parse
from .files import (atomic_copy, atomic_write_bytes, atomic_write_json, file_entry, replace_dir, sha256_file,
                    sweep_stale, temp_sibling)
from .numerics import is_on_int8_grid, nm_violations

log = logging.getLogger("holoserve.artifact")

MANIFEST = "manifest.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
WEIGHTS = "model.safetensors"


# ------------------------------------------------- activation-range keys (quantization.activations.amax)


def act_key(layer: str) -> str:
    """The input of an encoder Linear: present in every INT8 checkpoint."""
    return f"{layer}.input"


def output_key(layer: str) -> str:
    """The output of a Linear (TensorRT QAT only: Q/K/V and the sub-layer dense before its residual Add)."""
    return f"{layer}.output"


def residual_key(block: str) -> str:
    """The skip-connection input of a residual block's Add (TensorRT QAT only)."""
    return f"{block}.residual"


def softmax_key(attention: str) -> str:
    """The attention probabilities of a self-attention module, the P in P·V (TensorRT QAT only)."""
    return f"{attention}.softmax"


def input_layers(amax: Mapping[str, float]) -> list[str]:
    """The Linears whose inputs have a range, in manifest order."""
    suffix = act_key("")
    return [k[: -len(suffix)] for k in amax if k.endswith(suffix)]


# --------------------------------------------------------------------------- manifest


def new_manifest(
    *,
    base_model: str,
    task: Mapping[str, Any],
    max_seq_length: int,
    sparsity: Mapping[str, Any] | None,
    quantization: Mapping[str, Any] | None,
    metrics: Mapping[str, Any] | None = None,
    training: Mapping[str, Any] | None = None,
    sequence_length: Mapping[str, Any] | None = None,
) -> Manifest:
    """A manifest in the current schema (holoserve.core.manifest); `files` is filled in by the writer."""
    return parse(
        {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "base_model": base_model,
            "task": dict(task),
            "max_seq_length": int(max_seq_length),
            "sequence_length": dict(sequence_length) if sequence_length else None,
            "sparsity": dict(sparsity) if sparsity else None,
            "quantization": dict(quantization) if quantization else None,
            "dense_modules": list(DENSE_MODULES),
            "metrics": dict(metrics or {}),
            "training": dict(training or {}),
        },
        where="new checkpoint",
    )


def _require(cond: bool, where: Path, msg: str) -> None:
    if not cond:
        raise ArtifactError(f"{where}: {msg}")


# --------------------------------------------------------------------------- artifact


@dataclass
class Artifact:
    path: Path
    manifest: Manifest

    # -- convenience views of the manifest
    @property
    def task_name(self) -> str:
        return self.manifest.task.name

    @property
    def labels(self) -> list[str]:
        return list(self.manifest.task.labels)

    @property
    def num_labels(self) -> int:
        return self.manifest.task.num_labels

    @property
    def is_pair(self) -> bool:
        return self.manifest.task.pair

    @property
    def max_seq_length(self) -> int:
        return self.manifest.max_seq_length

    @property
    def base_model(self) -> str:
        return self.manifest.base_model

    @property
    def sparse_layers(self) -> list[str]:
        sp = self.manifest.sparsity
        return list(sp.layers) if sp else []

    @property
    def nm(self) -> tuple[int, int] | None:
        sp = self.manifest.sparsity
        return (sp.n, sp.m) if sp else None

    @property
    def quantized(self) -> bool:
        return self.manifest.quantization is not None

    def weight_scales(self, layer: str) -> np.ndarray:
        q = self.manifest.quantization
        if not q or layer not in q.weights.scales:
            raise ArtifactError(f"{self.path}: no INT8 weight scales for layer {layer!r} in manifest.json")
        return np.asarray(q.weights.scales[layer], dtype=np.float32)

    def all_weight_scales(self) -> dict[str, np.ndarray]:
        q = self.manifest.quantization
        return {k: np.asarray(v, dtype=np.float32) for k, v in (q.weights.scales.items() if q else ())}

    def embedding_scales(self, name: str | None = None) -> np.ndarray | None:
        """Per-row int8 scales of an embedding table the checkpoint quantized (the word embeddings by
        default), or None when it is stored as plain fp32."""
        q = self.manifest.quantization
        tables = (q.embeddings if q else None) or {}
        if not tables:
            return None
        key = name or next((k for k in tables if k.endswith("word_embeddings")), None)
        if key is None or key not in tables:
            return None
        return np.asarray(tables[key].scales, dtype=np.float32)

    def activation_amax(self) -> dict[str, float]:
        q = self.manifest.quantization
        a = q.activations if q else None
        return {k: float(v) for k, v in (a.amax.items() if a else ())}

    def file(self, name: str) -> Path:
        p = self.path / name
        if name not in self.manifest.files or not p.is_file():
            raise ArtifactError(f"{self.path}: file {name!r} is not part of this checkpoint")
        return p

    def export(self, kind: str):
        """The typed entry of a recorded export ('onnxruntime', 'tensorrt-onnx', 'tensorrt'), or None."""
        return self.manifest.exports.get(kind)

    def export_path(self, kind: str) -> Path | None:
        """Path of a recorded export (e.g. 'onnxruntime', 'tensorrt'), or None."""
        entry = self.export(kind)
        return self.path / entry.file if entry else None

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        sp = m.sparsity
        return {
            "task": m.task.model_dump(mode="json"),
            "base_model": m.base_model,
            "max_seq_length": m.max_seq_length,
            "sparsity": None
            if not sp
            else sp.model_dump(mode="json", exclude={"layers"}) | {"num_layers": len(sp.layers)},
            "precision": "int8" if self.quantized else "fp32",
            "metrics": m.metrics.model_dump(mode="json", exclude_none=True),
            "training": {k: v for k, v in m.training.items() if k in ("method", "preset", "seed")},
        }


# Far above any real manifest (per-channel scales of a BERT-large are a few MB); a larger file is
# refused before it is read.
MAX_MANIFEST_BYTES = 64 << 20
MAX_CONFIG_BYTES = 4 << 20


def _read_json(path: Path, limit: int, where: Path, what: str) -> Any:
    """A small JSON file of the checkpoint: a regular file inside it, bounded, parsed without pickle."""
    _require_regular(where, path.name)
    size = path.stat().st_size
    _require(size <= limit, where, f"{what} is {size / 2**20:.0f} MiB, more than the {limit >> 20} MiB any "
             "checkpoint needs; the file is not a HoloServe checkpoint's")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{where}: {what} is not valid JSON ({e}); the checkpoint is damaged") from None
    except RecursionError:
        raise ArtifactError(f"{where}: {what} is nested too deeply to be a checkpoint's; the file is damaged") from None


def read_manifest(path: str | os.PathLike) -> Manifest:
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        raise ArtifactError(f"checkpoint folder {path} does not exist")
    if not mpath.exists() and not mpath.is_symlink():
        raise ArtifactError(
            f"{path}: missing {MANIFEST}; this is not a HoloServe checkpoint (create one with `holoserve compress`)"
        )
    return parse(_read_json(mpath, MAX_MANIFEST_BYTES, path, MANIFEST), where=str(path))


def _require_regular(path: Path, name: str) -> Path:
    """`name` as a regular file inside the checkpoint folder `path`: no links, nothing outside it."""
    p = path / name
    _require(not p.is_symlink(), path, f"{name} is a symbolic link; a checkpoint holds its files itself "
             "(copy the file into the folder)")
    _require(p.exists(), path, f"missing file {name!r} listed in manifest.json; copy the whole checkpoint folder")
    _require(p.is_file(), path, f"{name} is not a regular file")
    _require(p.resolve().parent == path.resolve(), path, f"{name} is not inside the checkpoint folder")
    return p


def check_config(path: Path, manifest: Manifest) -> dict[str, Any]:
    """config.json read as JSON and checked against the manifest: the number of outputs the model has
    must be the number of labels the manifest answers with, and the position table must hold
    max_seq_length tokens."""
    config = _read_json(path / "config.json", MAX_CONFIG_BYTES, path, "config.json")
    _require(isinstance(config, dict), path, "config.json is not a JSON object; the checkpoint is damaged")
    id2label = config.get("id2label")
    outputs = len(id2label) if isinstance(id2label, dict) and id2label else config.get("num_labels", 2)
    task = manifest.task
    _require(outputs == task.num_labels, path,
             f"the model has {outputs} outputs (config.json) but manifest.json says task.num_labels = "
             f"{task.num_labels}; re-create the checkpoint with `holoserve compress`")
    _require(task.regression or len(task.labels) == task.num_labels, path,
             f"manifest.json names {len(task.labels)} labels for a model with {task.num_labels} outputs")
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int):
        _require(manifest.max_seq_length <= positions, path,
                 f"manifest.json max_seq_length {manifest.max_seq_length} exceeds the model's position table "
                 f"({positions} in config.json)")
    return config


def verify_files(path: Path, manifest: Manifest, names: Iterable[str] | None = None) -> None:
    files = manifest.files
    for req in REQUIRED_FILES:
        _require(req in files, path, f"manifest.json does not list required file {req!r}")
    for name in names if names is not None else files:
        entry = files.get(name)
        _require(entry is not None, path, f"manifest.json does not list {name!r}")
        p = _require_regular(path, name)
        _require(
            p.stat().st_size == entry.bytes,
            path,
            f"{name} has {p.stat().st_size} bytes, manifest says {entry.bytes}: the file is truncated or was replaced",
        )
        digest = sha256_file(p)
        _require(
            digest == entry.sha256,
            path,
            f"checksum mismatch for {name} (sha256 {digest[:12]}…, manifest {entry.sha256[:12]}…): "
            "the file is damaged or was changed after the checkpoint was written",
        )


def verify_weights(path: Path, manifest: Manifest) -> None:
    """Prove on the saved file that every sparse layer is N:M and, if quantized, on its INT8 grid."""
    from safetensors import safe_open

    sp = manifest.sparsity
    q = manifest.quantization
    sparse = set(sp.layers) if sp else set()
    layers = sparse | (set(q.weights.scales) if q else set())
    tables = dict((q.embeddings if q else None) or {})
    _require_regular(path, WEIGHTS)
    try:
        handle = safe_open(str(path / WEIGHTS), framework="numpy")
    except Exception as e:  # safetensors raises its own error types
        raise ArtifactError(f"{path}: {WEIGHTS} cannot be read as safetensors ({e})") from None
    with handle as f:
        keys = set(f.keys())
        for layer in sorted(layers):
            key = f"{layer}.weight"
            _require(key in keys, path, f"layer {layer!r} is listed in manifest.json but {key!r} is not in {WEIGHTS}")
            w = f.get_tensor(key)
            if layer in sparse:
                bad = nm_violations(w, sp.n, sp.m)
                _require(
                    bad == 0,
                    path,
                    f"layer {layer!r} is listed as {sp.n}:{sp.m} sparse but "
                    + (
                        f"its input dimension {w.shape[-1]} is not a multiple of {sp.m}"
                        if bad < 0
                        else f"{bad} groups of {sp.m} hold more than {sp.n} non-zeros"
                    )
                    + "; re-run `holoserve compress`",
                )
            if q:
                scales = q.weights.scales.get(layer)
                _require(scales is not None, path, f"layer {layer!r} has no INT8 weight scales in manifest.json")
                _require(
                    len(scales) == w.shape[0],
                    path,
                    f"layer {layer!r} has {w.shape[0]} output channels but {len(scales)} scales",
                )
                _require(
                    is_on_int8_grid(w, np.asarray(scales, dtype=np.float32)),
                    path,
                    f"layer {layer!r} is not exactly int8 x per-channel scale in {WEIGHTS}; "
                    "re-run `holoserve compress`",
                )
        for table, entry in sorted(tables.items()):
            key = f"{table}.weight"
            _require(key in keys, path, f"embedding {table!r} is listed in manifest.json but {key!r} "
                                        f"is not in {WEIGHTS}")
            w = f.get_tensor(key)
            _require(
                len(entry.scales) == w.shape[0],
                path,
                f"embedding {table!r} has {w.shape[0]} rows but {len(entry.scales)} scales",
            )
            _require(
                is_on_int8_grid(w, np.asarray(entry.scales, dtype=np.float32)),
                path,
                f"embedding {table!r} is not exactly int8 x per-row scale in {WEIGHTS}; re-run `holoserve compress`",
            )


def load_artifact(path: str | os.PathLike, *, verify: bool = True, check_weights: bool = True) -> Artifact:
    """Open and validate a checkpoint.

    Always: the manifest against its schema (every file it names a plain name it lists), each file a
    regular file inside the folder, config.json against the manifest (outputs = labels). `verify`
    also checks the size and sha256 of every listed file; `check_weights` proves on the saved
    safetensors that every sparse layer is N:M and every quantized one on its INT8 grid.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if verify:
        verify_files(path, manifest)
    else:
        for name in (*REQUIRED_FILES, *manifest.files):
            _require_regular(path, name)
    check_config(path, manifest)
    if check_weights:
        verify_weights(path, manifest)
    return Artifact(path, manifest)


def write_artifact(
    out_dir: str | os.PathLike,
    manifest: Manifest | Mapping[str, Any],
    files: Mapping[str, str | os.PathLike | bytes],
    *,
    overwrite: bool = False,
) -> Artifact:
    """Create a checkpoint folder atomically from source files (paths or bytes) and a manifest.

    The new folder is assembled next to `out_dir`, validated, then put in place in one step
    (holoserve.core.files.replace_dir); an existing `out_dir` is replaced only with `overwrite=True`.
    Leftovers of writers that crashed earlier are removed first.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ArtifactError(f"{out} already exists; choose another --out or remove it first")
    missing = [r for r in REQUIRED_FILES if r not in files]
    if missing:
        raise ArtifactError(f"cannot write checkpoint {out}: missing {', '.join(missing)}")
    sweep_stale(out)
    tmp = temp_sibling(out, "tmp")
    try:
        entries = {}
        for name, src in files.items():
            if "/" in name or name in (MANIFEST, "", ".", ".."):
                raise ArtifactError(f"invalid checkpoint file name {name!r}")
            dst = tmp / name
            if isinstance(src, (bytes, bytearray)):
                atomic_write_bytes(dst, bytes(src))
            else:
                atomic_copy(src, dst)
            entries[name] = file_entry(dst)
        data = manifest.to_json() if isinstance(manifest, Manifest) else dict(manifest)
        manifest = parse(data | {"files": entries}, where=str(out))
        verify_weights(tmp, manifest)
        atomic_write_json(tmp / MANIFEST, manifest.to_json())
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Artifact(out, manifest)


def add_files(
    artifact: Artifact | str | os.PathLike,
    files: Mapping[str, str | os.PathLike],
    *,
    exports: Mapping[str, Mapping[str, Any]] | None = None,
    move: bool = True,
) -> Artifact:
    """Add (or replace) files in an existing checkpoint and record them, atomically for the folder.

    A new version of the folder is assembled next to it: hard links to the files that stay (no copy,
    and never modified in place), the new files, the rewritten manifest; then it replaces the old
    folder in one step. `exports` entries are validated against their typed schema
    (holoserve.core.manifest) before anything is written.
    """
    art = artifact if isinstance(artifact, Artifact) else Artifact(Path(artifact), read_manifest(artifact))
    data = art.manifest.to_json()
    for name in files:
        if "/" in name or name in (MANIFEST, *REQUIRED_FILES):
            raise ArtifactError(f"refusing to add {name!r}: it would replace a core checkpoint file")
        data["files"][name] = {"sha256": "0" * 64, "bytes": 0}  # placeholders until the file is in place
    if exports:
        data["exports"].update({k: dict(v) for k, v in exports.items()})
    parse(data, where=str(art.path))  # refuse a bad entry before any file is touched
    sweep_stale(art.path)
    try:
        tmp = temp_sibling(art.path, "tmp")
    except OSError as e:  # e.g. the checkpoint is a mount point whose parent is read-only
        log.warning("%s cannot be replaced as a whole (%s); replacing its files one by one", art.path, e)
        return _add_files_in_place(art, files, data, move)

    def ours(src) -> bool:  # a file of this checkpoint, or of a temporary folder a writer made beside it
        parent = Path(src).resolve().parent
        return parent == art.path.resolve() or (parent.parent == art.path.resolve().parent
                                                and parent.name.startswith(f".{art.path.name}."))

    try:
        for entry in art.path.iterdir():
            if entry.name in files or entry.name == MANIFEST or entry.name.startswith(".") or entry.is_symlink():
                continue  # hidden entries are never checkpoint files (temporary folders of writers)
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name, copy_function=os.link)
            else:
                os.link(entry, tmp / entry.name)
        for name, src in files.items():
            dst = tmp / name
            if move and ours(src):
                os.replace(src, dst)
            else:
                atomic_copy(src, dst)
            data["files"][name] = file_entry(dst)
        manifest = parse(data, where=str(art.path))
        atomic_write_json(tmp / MANIFEST, manifest.to_json())
        replace_dir(tmp, art.path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Artifact(art.path, manifest)


def _add_files_in_place(art: Artifact, files: Mapping[str, str | os.PathLike], data: dict[str, Any],
                        move: bool) -> Artifact:
    """add_files where the folder cannot be swapped: each file is renamed into place, then the manifest.
    Between the two a reader may see a new file with its old hash and refuse it (never a wrong one)."""
    for name, src in files.items():
        dst = art.path / name
        if move and Path(src).parent.resolve() == art.path.resolve():
            os.replace(src, dst)
        else:
            atomic_copy(src, dst)
        data["files"][name] = file_entry(dst)
    manifest = parse(data, where=str(art.path))
    atomic_write_json(art.path / MANIFEST, manifest.to_json())
    return Artifact(art.path, manifest)
