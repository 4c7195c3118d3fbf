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

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Mapping

import numpy as np

from .. import HoloServeError, __version__
from .numerics import int8_codes, nm_violations

SCHEMA_VERSION = 1
FORMAT = "holoserve-checkpoint"
MANIFEST = "manifest.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
WEIGHTS = "model.safetensors"
# Parts of a BERT classifier that stay dense and unquantized; recorded in every manifest.
DENSE_MODULES = ("embeddings", "LayerNorm", "pooler", "classifier")


class ArtifactError(HoloServeError):
    """A checkpoint that cannot be used, with the reason and what to do about it."""


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


def input_layers(amax: Mapping[str, float]) -> list[str]:
    """The Linears whose inputs have a range, in manifest order."""
    suffix = act_key("")
    return [k[: -len(suffix)] for k in amax if k.endswith(suffix)]


# --------------------------------------------------------------------------- files


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _public_mode(fd_or_path, directory: bool = False) -> None:
    """mkstemp/mkdtemp create 0600/0700 entries; give checkpoint files the usual umask-based modes so a
    server running as another user (e.g. in a container) can read them."""
    mode = (0o777 if directory else 0o666) & ~_umask()
    if isinstance(fd_or_path, int):
        os.fchmod(fd_or_path, mode)
    else:
        os.chmod(fd_or_path, mode)


def _atomic_write(path: str | os.PathLike, fill: Callable[[BinaryIO], None]) -> None:
    """Let `fill` write a temporary sibling of `path`, fsync it and rename it into place, so that
    readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        _public_mode(fd)
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    _atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_savefig(fig: Any, path: str | os.PathLike, dpi: int = 120) -> None:
    """Save a matplotlib figure atomically (its format from the file suffix, e.g. .png)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    _atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=dpi))


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy a (possibly large) file into place via a temporary sibling and a rename."""
    def fill(out: BinaryIO) -> None:
        with open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, 1 << 20)

    _atomic_write(dst, fill)


def file_entry(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    return {"sha256": sha256_file(p), "bytes": p.stat().st_size}


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
) -> dict[str, Any]:
    """A manifest dict in the current schema; `files` is filled in by the writer.

    task:         {"name", "labels": [...] (empty for regression), "pair": bool, "num_labels"}
    sparsity:     {"pattern": "2:4", "n": 2, "m": 4, "axis": "input", "layers": [module names]} or None
    quantization: {"weights": {"dtype": "int8", "scheme": "symmetric", "granularity": "per_output_channel",
                               "scales": {layer: [float, ...]}},
                   "activations": {"dtype": "int8", "scheme": "symmetric", "granularity": "per_tensor",
                                   "amax": {tensor name: float}}} or None
    metrics:      {"primary": "accuracy", "dense": {...}, "compressed": {...}}
    """
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "holoserve_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_model": base_model,
        "task": dict(task),
        "max_seq_length": int(max_seq_length),
        "sparsity": dict(sparsity) if sparsity else None,
        "quantization": dict(quantization) if quantization else None,
        "dense_modules": list(DENSE_MODULES),
        "metrics": dict(metrics or {}),
        "training": dict(training or {}),
        "exports": {},
        "files": {},
    }


def _require(cond: bool, where: Path, msg: str) -> None:
    if not cond:
        raise ArtifactError(f"{where}: {msg}")


def validate_manifest(m: Any, where: Path) -> None:
    """Structural checks; file and weight checks happen in `load_artifact`."""
    _require(isinstance(m, dict), where, "manifest.json is not a JSON object")
    _require(m.get("format") == FORMAT, where, f"manifest.json is not a {FORMAT} manifest (format={m.get('format')!r})")
    version = m.get("schema_version")
    _require(
        isinstance(version, int), where, "manifest.json has no integer schema_version; re-create the checkpoint"
    )
    _require(
        version <= SCHEMA_VERSION,
        where,
        f"manifest schema_version {version} is newer than this HoloServe understands ({SCHEMA_VERSION}); "
        "upgrade holoserve",
    )
    _require(version >= 1, where, f"unknown manifest schema_version {version}")
    for key, typ in (("task", dict), ("files", dict), ("max_seq_length", int), ("metrics", dict)):
        _require(isinstance(m.get(key), typ), where, f"manifest.json: {key!r} is missing or not a {typ.__name__}")
    task = m["task"]
    _require(isinstance(task.get("name"), str), where, "manifest.json: task.name is missing")
    _require(isinstance(task.get("labels"), list), where, "manifest.json: task.labels must be a list")
    _require(isinstance(task.get("pair"), bool), where, "manifest.json: task.pair must be true or false")
    _require(m["max_seq_length"] > 0, where, "manifest.json: max_seq_length must be positive")
    sp = m.get("sparsity")
    if sp is not None:
        _require(isinstance(sp, dict), where, "manifest.json: sparsity must be an object or null")
        n, mm = sp.get("n"), sp.get("m")
        _require(
            isinstance(n, int) and isinstance(mm, int) and 0 < n < mm,
            where,
            f"manifest.json: sparsity n/m invalid ({n}/{mm})",
        )
        _require(sp.get("axis", "input") == "input", where, "manifest.json: only N:M along the input axis is supported")
        _require(
            isinstance(sp.get("layers"), list) and all(isinstance(x, str) for x in sp["layers"]),
            where,
            "manifest.json: sparsity.layers must be a list of layer names",
        )
    q = m.get("quantization")
    if q is not None:
        _require(isinstance(q, dict), where, "manifest.json: quantization must be an object or null")
        w = q.get("weights")
        _require(
            isinstance(w, dict) and isinstance(w.get("scales"), dict),
            where,
            "manifest.json: quantization.weights.scales is missing",
        )
        e = q.get("embeddings")
        _require(
            e is None or (isinstance(e, dict) and all(isinstance(v, dict) and isinstance(v.get("scales"), list)
                                                      for v in e.values())),
            where,
            "manifest.json: quantization.embeddings must map table names to {\"scales\": [...]}",
        )
        a = q.get("activations")
        if a is not None:
            _require(
                isinstance(a, dict) and isinstance(a.get("amax"), dict),
                where,
                "manifest.json: quantization.activations.amax must map tensor names to numbers",
            )
            bad = [k for k, v in a["amax"].items() if not isinstance(v, (int, float)) or not v > 0]
            _require(not bad, where, f"manifest.json: activation amax must be positive numbers (bad: {bad[:3]})")


# --------------------------------------------------------------------------- artifact


@dataclass
class Artifact:
    path: Path
    manifest: dict[str, Any]

    # -- convenience views of the manifest
    @property
    def task_name(self) -> str:
        return self.manifest["task"]["name"]

    @property
    def labels(self) -> list[str]:
        return list(self.manifest["task"]["labels"])

    @property
    def is_pair(self) -> bool:
        return bool(self.manifest["task"]["pair"])

    @property
    def max_seq_length(self) -> int:
        return int(self.manifest["max_seq_length"])

    @property
    def sparse_layers(self) -> list[str]:
        sp = self.manifest.get("sparsity")
        return list(sp["layers"]) if sp else []

    @property
    def nm(self) -> tuple[int, int] | None:
        sp = self.manifest.get("sparsity")
        return (sp["n"], sp["m"]) if sp else None

    @property
    def quantized(self) -> bool:
        return self.manifest.get("quantization") is not None

    def weight_scales(self, layer: str) -> np.ndarray:
        q = self.manifest.get("quantization")
        if not q or layer not in q["weights"]["scales"]:
            raise ArtifactError(f"{self.path}: no INT8 weight scales for layer {layer!r} in manifest.json")
        return np.asarray(q["weights"]["scales"][layer], dtype=np.float32)

    def embedding_scales(self, name: str | None = None) -> np.ndarray | None:
        """Per-row int8 scales of an embedding table the checkpoint quantized (the word embeddings by
        default), or None when it is stored as plain fp32."""
        q = self.manifest.get("quantization") or {}
        tables = q.get("embeddings") or {}
        if not tables:
            return None
        key = name or next((k for k in tables if k.endswith("word_embeddings")), None)
        if key is None or key not in tables:
            return None
        return np.asarray(tables[key]["scales"], dtype=np.float32)

    def activation_amax(self) -> dict[str, float]:
        q = self.manifest.get("quantization") or {}
        a = q.get("activations") or {}
        return {k: float(v) for k, v in (a.get("amax") or {}).items()}

    def file(self, name: str) -> Path:
        p = self.path / name
        if name not in self.manifest["files"] or not p.is_file():
            raise ArtifactError(f"{self.path}: file {name!r} is not part of this checkpoint")
        return p

    def export_path(self, kind: str) -> Path | None:
        """Path of a recorded export (e.g. 'onnx:onnxruntime', 'tensorrt'), or None."""
        entry = self.manifest.get("exports", {}).get(kind)
        return self.path / entry["file"] if entry else None

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "task": m["task"],
            "base_model": m.get("base_model"),
            "max_seq_length": m["max_seq_length"],
            "sparsity": None
            if not m.get("sparsity")
            else {k: v for k, v in m["sparsity"].items() if k != "layers"} | {"num_layers": len(self.sparse_layers)},
            "precision": "int8" if self.quantized else "fp32",
            "metrics": m.get("metrics", {}),
            "training": {k: v for k, v in m.get("training", {}).items() if k in ("method", "preset", "seed")},
        }


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        raise ArtifactError(f"checkpoint folder {path} does not exist")
    if not mpath.is_file():
        raise ArtifactError(
            f"{path}: missing {MANIFEST}; this is not a HoloServe checkpoint (create one with `holoserve compress`)"
        )
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: {MANIFEST} is not valid JSON ({e}); the checkpoint is damaged") from None
    validate_manifest(m, path)
    return m


def verify_files(path: Path, manifest: Mapping[str, Any], names: Iterable[str] | None = None) -> None:
    files = manifest["files"]
    for req in REQUIRED_FILES:
        _require(req in files, path, f"manifest.json does not list required file {req!r}")
    for name in names if names is not None else files:
        entry = files.get(name)
        _require(entry is not None, path, f"manifest.json does not list {name!r}")
        p = path / name
        _require(p.is_file(), path, f"missing file {name!r} listed in manifest.json; copy the whole checkpoint folder")
        _require(
            p.stat().st_size == entry.get("bytes", p.stat().st_size),
            path,
            f"{name} has {p.stat().st_size} bytes, manifest says {entry.get('bytes')}: the file is truncated or was replaced",
        )
        digest = sha256_file(p)
        _require(
            digest == entry.get("sha256"),
            path,
            f"checksum mismatch for {name} (sha256 {digest[:12]}…, manifest {str(entry.get('sha256'))[:12]}…): "
            "the file is damaged or was changed after the checkpoint was written",
        )


def verify_weights(path: Path, manifest: Mapping[str, Any]) -> None:
    """Prove on the saved file that every sparse layer is N:M and, if quantized, on its INT8 grid."""
    from safetensors import safe_open

    sp = manifest.get("sparsity")
    q = manifest.get("quantization")
    layers = set(sp["layers"]) if sp else set()
    if q:
        layers |= set(q["weights"]["scales"])
    tables = dict((q or {}).get("embeddings") or {})
    if not layers and not tables:
        return
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
            if sp and layer in sp["layers"]:
                bad = nm_violations(w, sp["n"], sp["m"])
                _require(
                    bad == 0,
                    path,
                    f"layer {layer!r} is listed as {sp['n']}:{sp['m']} sparse but "
                    + (
                        f"its input dimension {w.shape[-1]} is not a multiple of {sp['m']}"
                        if bad < 0
                        else f"{bad} groups of {sp['m']} hold more than {sp['n']} non-zeros"
                    )
                    + "; re-run `holoserve compress`",
                )
            if q:
                scales = q["weights"]["scales"].get(layer)
                _require(scales is not None, path, f"layer {layer!r} has no INT8 weight scales in manifest.json")
                _require(
                    len(scales) == w.shape[0],
                    path,
                    f"layer {layer!r} has {w.shape[0]} output channels but {len(scales)} scales",
                )
                _require(
                    int8_codes(w, np.asarray(scales, dtype=np.float32)) is not None,
                    path,
                    f"layer {layer!r} is not exactly int8 x per-channel scale in {WEIGHTS}; re-run `holoserve compress`",
                )
        for table, entry in sorted(tables.items()):
            key = f"{table}.weight"
            _require(key in keys, path, f"embedding {table!r} is listed in manifest.json but {key!r} is not in {WEIGHTS}")
            w = f.get_tensor(key)
            _require(
                len(entry["scales"]) == w.shape[0],
                path,
                f"embedding {table!r} has {w.shape[0]} rows but {len(entry['scales'])} scales",
            )
            _require(
                int8_codes(w, np.asarray(entry["scales"], dtype=np.float32)) is not None,
                path,
                f"embedding {table!r} is not exactly int8 x per-row scale in {WEIGHTS}; re-run `holoserve compress`",
            )


def load_artifact(path: str | os.PathLike, *, verify: bool = True, check_weights: bool = True) -> Artifact:
    """Open and validate a checkpoint. `verify` checks sha256 of every listed file."""
    path = Path(path)
    manifest = read_manifest(path)
    if verify:
        verify_files(path, manifest)
    else:
        for req in REQUIRED_FILES:
            _require((path / req).is_file(), path, f"missing required file {req!r}")
    if check_weights:
        verify_weights(path, manifest)
    return Artifact(path, manifest)


def write_artifact(
    out_dir: str | os.PathLike,
    manifest: dict[str, Any],
    files: Mapping[str, str | os.PathLike | bytes],
    *,
    overwrite: bool = False,
) -> Artifact:
    """Create a checkpoint folder atomically from source files (paths or bytes) and a manifest.

    The new folder is assembled next to `out_dir`, validated, then renamed into place; an
    existing `out_dir` is replaced only with `overwrite=True`, and only after the new one is complete.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ArtifactError(f"{out} already exists; choose another --out or remove it first")
    missing = [r for r in REQUIRED_FILES if r not in files]
    if missing:
        raise ArtifactError(f"cannot write checkpoint {out}: missing {', '.join(missing)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _public_mode(tmp, directory=True)
        manifest = json.loads(json.dumps(manifest))  # deep copy, and proof it is JSON
        manifest["files"] = {}
        for name, src in files.items():
            if "/" in name or name in (MANIFEST, "", ".", ".."):
                raise ArtifactError(f"invalid checkpoint file name {name!r}")
            dst = tmp / name
            if isinstance(src, (bytes, bytearray)):
                atomic_write_bytes(dst, bytes(src))
            else:
                atomic_copy(src, dst)
            manifest["files"][name] = file_entry(dst)
        validate_manifest(manifest, out)
        verify_weights(tmp, manifest)
        atomic_write_json(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        _fsync_dir(out.parent)
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
    """Add (or replace) files in an existing checkpoint and record them, atomically per file.

    Each source is moved (or copied) to a temporary name inside the folder and renamed into
    place; the manifest, rewritten last, is what makes the addition visible to readers.
    """
    art = artifact if isinstance(artifact, Artifact) else Artifact(Path(artifact), read_manifest(artifact))
    manifest = json.loads(json.dumps(art.manifest))
    for name, src in files.items():
        if "/" in name or name in (MANIFEST, *REQUIRED_FILES):
            raise ArtifactError(f"refusing to add {name!r}: it would replace a core checkpoint file")
        dst = art.path / name
        if move and Path(src).parent.resolve() == art.path.resolve():
            os.replace(src, dst)
        else:
            atomic_copy(src, dst)
        manifest["files"][name] = file_entry(dst)
    if exports:
        manifest.setdefault("exports", {}).update({k: dict(v) for k, v in exports.items()})
    atomic_write_json(art.path / MANIFEST, manifest)
    _fsync_dir(art.path)
    return Artifact(art.path, manifest)
