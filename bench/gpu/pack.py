"""Pack a checkpoint folder into a compact one, quick to copy to a GPU machine, and unpack it there.

Packed:
  - every INT8 layer as its int8 codes (exact: the contract says weight == codes x per-channel scale,
    and unpacking recomputes codes x scale in float32, which is bit-identical to the saved weight);
    embedding tables the checkpoint put on a per-row INT8 grid are stored the same way;
  - other large float tensors (fp32 embedding tables) as fp16;
  - everything else (biases, LayerNorm, pooler, classifier) as fp32.
Unpacking writes a real checkpoint with holoserve.core.artifact.write_artifact, so a benchmark loads it
through the same validated path as the server. Only fp32 embedding tables differ from the original
(fp16 rounding, recorded in pack.json); the parity check compares both sides on the unpacked weights.

    python -m bench.gpu.pack unpack PACKED_DIR DEST_DIR
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

PACK = "pack.json"
WEIGHTS = "weights.packed.safetensors"
CODES_SUFFIX = ".weight.int8"
FP16_MIN_ELEMENTS = 1_000_000  # float tensors at least this large are stored as fp16
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def _int8_scales(manifest) -> dict[str, list]:
    """Per-channel scales of the encoder Linears and per-row scales of INT8 embedding tables, by module."""
    q = manifest.quantization
    if q is None:
        return {}
    scales = dict(q.weights.scales)
    scales.update({k: v.scales for k, v in (q.embeddings or {}).items()})
    return scales


def pack(checkpoint: str | Path, out: str | Path, *, fp16_min_elements: int | None = None) -> dict[str, Any]:
    """Write `out/` (config, tokenizer, manifest, packed weights, pack.json). Returns pack.json's content.

    Float tensors with at least `fp16_min_elements` elements are stored as FP16 (default
    FP16_MIN_ELEMENTS; pass a huge number to keep everything exact)."""
    fp16_min = FP16_MIN_ELEMENTS if fp16_min_elements is None else fp16_min_elements
    from safetensors.numpy import load_file, save_file

    from holoserve.core.artifact import load_artifact
    from holoserve.core.files import atomic_write_json
    from holoserve.core.numerics import grid_codes

    art = load_artifact(checkpoint)
    scales = _int8_scales(art.manifest)
    tensors = load_file(str(art.path / "model.safetensors"))
    packed: dict[str, np.ndarray] = {}
    kinds: dict[str, str] = {}
    fp16_err: dict[str, float] = {}
    for key, w in tensors.items():
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        if layer in scales:
            s = np.asarray(scales[layer], dtype=np.float32)
            codes = grid_codes(w, s)
            if codes is None:
                raise ValueError(f"{key} is not exactly int8 codes x scale; the checkpoint breaks the contract")
            packed[layer + CODES_SUFFIX] = codes
            kinds[key] = "int8"
        elif w.dtype == np.float32 and w.size >= fp16_min:
            h = w.astype(np.float16)
            fp16_err[key] = float(np.abs(h.astype(np.float32) - w).max())
            packed[key] = h
            kinds[key] = "fp16"
        else:
            packed[key] = w
            kinds[key] = str(w.dtype)
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
    try:
        save_file(packed, str(tmp / WEIGHTS))
        for name in SIDE_FILES:
            if (art.path / name).is_file():
                shutil.copy2(art.path / name, tmp / name)
        manifest = art.manifest.to_json()
        manifest["exports"] = {}  # exported files are not packed
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        info = {
            "source": art.path.name,
            "source_sha256": art.manifest.files["model.safetensors"].sha256,
            "kinds": kinds,
            "fp16_max_abs_error": fp16_err,
            "bytes": (tmp / WEIGHTS).stat().st_size,
        }
        atomic_write_json(tmp / PACK, info)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def unpack(packed_dir: str | Path, dest: str | Path):
    """Rebuild a valid checkpoint folder at `dest` from a packed folder; returns its Artifact."""
    from safetensors.numpy import load_file, save_file

    from holoserve.core.artifact import read_manifest, write_artifact

    src = Path(packed_dir)
    manifest = read_manifest(src)
    scales = _int8_scales(manifest)
    packed = load_file(str(src / WEIGHTS))
    tensors: dict[str, np.ndarray] = {}
    for key, v in packed.items():
        if key.endswith(CODES_SUFFIX):
            layer = key[: -len(CODES_SUFFIX)]
            s = np.asarray(scales[layer], dtype=np.float32).reshape(-1, 1)
            tensors[layer + ".weight"] = v.astype(np.float32) * s
        elif v.dtype == np.float16:
            tensors[key] = v.astype(np.float32)
        else:
            tensors[key] = v
    with tempfile.TemporaryDirectory(prefix="holoserve-unpack-") as tmp:
        weights = Path(tmp) / "model.safetensors"
        save_file(tensors, str(weights), metadata={"format": "pt"})
        files: dict[str, Any] = {"model.safetensors": weights}
        for name in SIDE_FILES:
            if (src / name).is_file():
                files[name] = src / name
        return write_artifact(dest, manifest, files, overwrite=True)


if __name__ == "__main__":  # python -m bench.gpu.pack unpack PACKED DEST, from the repository root
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "unpack":
        sys.exit("usage: python -m bench.gpu.pack unpack PACKED_DIR DEST_DIR")
    print(f"unpacked to {unpack(sys.argv[2], sys.argv[3]).path}")
