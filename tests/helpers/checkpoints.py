"""Shared helpers for the compression tests: synthetic GLUE folders and an independent checker
that proves 2:4 sparsity and INT8 exactness by reading model.safetensors straight from disk."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

POS = ["good", "great", "fun", "best", "loved", "funny", "fine"]
NEG = ["bad", "awful", "boring", "dull", "worst", "hated", "sad"]
FILL = ["the", "movie", "film", "story", "plot", "acting", "this", "was", "very", "so", "it", "is"]


def _sentence(rng: np.random.Generator, label: int) -> str:
    words = list(rng.choice(FILL, size=int(rng.integers(3, 9))))
    words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(POS if label else NEG)))
    return " ".join(words)


def write_glue(root: Path, train_rows: int = 160, dev_rows: int = 48, seed: int = 0) -> Path:
    """SST-2 (header), CoLA (no header) and MRPC (BOM, header) folders with learnable labels."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", train_rows), ("dev", dev_rows)):
        labels = rng.integers(0, 2, size=n)
        sst = ["sentence\tlabel"] + [f"{_sentence(rng, int(y))}\t{y}" for y in labels]
        (root / "SST-2").mkdir(parents=True, exist_ok=True)
        (root / "SST-2" / f"{split}.tsv").write_text("\n".join(sst) + "\n")
        cola = [f"src{i}\t{y}\t\t{_sentence(rng, int(y))}" for i, y in enumerate(labels)]
        (root / "CoLA").mkdir(parents=True, exist_ok=True)
        (root / "CoLA" / f"{split}.tsv").write_text("\n".join(cola) + "\n")
        mrpc = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        for i, y in enumerate(labels):
            a = _sentence(rng, 1)
            b = a if y else _sentence(rng, 0)
            mrpc.append(f"{y}\t{i}\t{i + 1000}\t{a}\t{b}")
        (root / "MRPC").mkdir(parents=True, exist_ok=True)
        (root / "MRPC" / f"{split}.tsv").write_text("\n".join(mrpc) + "\n", encoding="utf-8-sig")
    return root


ENCODER_LINEAR = re.compile(r"encoder\.layer\.\d+\..*\.weight$")


def check_saved_checkpoint(path: Path, n: int = 2, m: int = 4) -> dict:
    """Read manifest.json and model.safetensors directly and prove the two weight constraints.

    Independent of holoserve.core.artifact: it re-derives int8 codes with numpy and checks every
    2-D encoder weight is listed as sparse, is N:M along the input dimension, and (if quantized)
    equals float32(int8 code) * per-channel scale bit for bit. Returns a summary.
    """
    from safetensors.numpy import load_file

    manifest = json.loads((path / "manifest.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    encoder = sorted(k[: -len(".weight")] for k, v in tensors.items() if ENCODER_LINEAR.search(k) and v.ndim == 2)
    sp = manifest["sparsity"]
    assert sp is not None and sp["n"] == n and sp["m"] == m
    assert sorted(sp["layers"]) == encoder, "every encoder Linear must be listed as sparse"
    q = manifest["quantization"]
    zeros = 0
    for layer in encoder:
        w = tensors[f"{layer}.weight"]
        assert w.dtype == np.float32
        nnz = (w.reshape(w.shape[0], -1, m) != 0).sum(-1)
        assert nnz.max() <= n, f"{layer} is not {n}:{m}"
        zeros += int((w == 0).sum())
        if q is not None:
            s = np.asarray(q["weights"]["scales"][layer], dtype=np.float32)[:, None]
            codes = np.rint(w / s)
            assert np.abs(codes).max() <= 127, f"{layer} has codes outside int8"
            assert np.array_equal(codes.astype(np.int8).astype(np.float32) * s, w), f"{layer} is off its INT8 grid"
    total = sum(tensors[f"{k}.weight"].size for k in encoder)
    return {"layers": len(encoder), "zero_share": zeros / total, "quantized": q is not None}
