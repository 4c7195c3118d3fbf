#!/usr/bin/env python3
"""Bundle what `holoserve compress` needs on a GPU machine: the base model and GLUE splits, small enough to copy.

    python -m bench.gpu.bundle_train --data-dir GLUE_DIR [--tasks sst2,mrpc,cola] [--model DIR]

writes, git-ignored:
    .carry-train/base/              the base model (default all-MiniLM-L6-v2) with its weights in FP16
                                    (half the size; `holoserve compress` loads them as float32)
    .carry-train/glue/<TASK>/       train.tsv and dev.tsv of each task
    .carry-train/carry.json         what is inside and how big
    .whl-train/                     `datasets` and the few of its needs a GPU image with torch, transformers,
                                    tokenizers and safetensors lacks; apart from .whl/, whose serving and
                                    torchao wheels training does not need

It prints the sizes of the checkout and these folders, and exits with status 1 when together they exceed
--max-mib. bench/gpu/README.md has the command to run on the GPU machine.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from bench.gpu.bundle import SIZE_LIMIT_MIB, data_wheels, fetch_wheels, folder_bytes, report_sizes, tree_bytes

ROOT = Path(__file__).resolve().parents[2]
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def pack_base(src: Path, dest: Path) -> dict:
    """Copy a HF BERT folder with its float weights stored as FP16; returns the largest rounding error."""
    import numpy as np
    from safetensors.numpy import load_file, save

    from holoserve.core.files import atomic_write_bytes

    dest.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
    tensors = load_file(str(src / "model.safetensors"))
    out, worst = {}, 0.0
    for key, v in tensors.items():
        if v.dtype == np.float32:
            h = v.astype(np.float16)
            if not np.isfinite(h).all():
                raise SystemExit(f"{key} overflows FP16; copy this model in FP32 instead")
            worst = max(worst, float(np.abs(h.astype(np.float32) - v).max()))
            out[key] = h
        else:
            out[key] = v
    atomic_write_bytes(dest / "model.safetensors", save(out, metadata={"format": "pt"}))
    atomic_write_bytes(dest / "FP16.txt",
                       b"weights rounded to FP16 for travel; holoserve compress loads them as float32\n")
    return {"tensors": len(out), "fp16_max_abs_error": worst}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.bundle_train", description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=os.environ.get("HOLOSERVE_DATA_DIR"), help="GLUE folder")
    ap.add_argument("--tasks", default="sst2,mrpc,cola")
    ap.add_argument("--model", type=Path, help="base model folder (default: all-MiniLM-L6-v2 from its package)")
    ap.add_argument("--out", type=Path, default=ROOT / ".carry-train")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl-train",
                    help="wheel folder (default .whl-train, git-ignored; copy it with .carry-train)")
    ap.add_argument("--wheel-script", help="script that downloads GPU wheels into --wheels (default: pip download)")
    ap.add_argument("--no-wheels", action="store_true", help="skip downloading wheels")
    ap.add_argument("--max-mib", type=float, default=SIZE_LIMIT_MIB,
                    help="exit with status 1 when the checkout plus these folders exceed this "
                         f"(default {SIZE_LIMIT_MIB:.0f})")
    args = ap.parse_args(argv)
    if not args.data_dir:
        ap.error("--data-dir (or HOLOSERVE_DATA_DIR) is required")

    from holoserve.data.tasks import get_task

    name = args.model.name if args.model else None
    if args.model is None:
        from holoserve.compress.context import DEFAULT_MODEL_NAME, default_model_dir

        args.model, name = default_model_dir(), DEFAULT_MODEL_NAME
    if args.out.exists():
        shutil.rmtree(args.out)
    info = pack_base(Path(args.model), args.out / "base")
    print(f"base model {name}: {info['tensors']} tensors in FP16 (max abs rounding error "
          f"{info['fp16_max_abs_error']:.2e})")
    copied = {}
    for task_name in args.tasks.split(","):
        task = get_task(task_name)
        for split in ("train", "dev"):
            src = Path(args.data_dir) / task.folder / f"{split}.tsv"
            if not src.is_file():
                raise SystemExit(f"{src} is missing: the GPU runs need {task.name}'s {split} split")
            dst = args.out / "glue" / task.folder / src.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            copied[f"{task.folder}/{src.name}"] = src.stat().st_size
    if not args.no_wheels:
        print(f"wheels: {', '.join(fetch_wheels(data_wheels(), args.wheels, args.wheel_script))}")
    sizes = {"carry": folder_bytes(args.out), "wheels": folder_bytes(args.wheels), "tree": tree_bytes()}
    from holoserve.core.files import atomic_write_json

    atomic_write_json(args.out / "carry.json", {"base_model": name, "glue": copied, "bytes": sizes, **info})
    return report_sizes(sizes, args.max_mib)


if __name__ == "__main__":
    sys.exit(main())
