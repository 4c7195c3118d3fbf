"""Tiny random BERT models and tokenizers built on the fly, for fast tests (no downloads)."""
from __future__ import annotations

from pathlib import Path

WORDS = (
    "the a an and or but not no very too so is was are be good bad great awful fine movie film story "
    "plot actor actors acting fun boring dull love loved hate hated best worst funny sad it this that "
    "i you he she they we of to in on with for at by from as his her their its one two man woman "
    "child dog cat horse car plane is playing riding taking off said company year new"
).split()


def make_tokenizer_dir(path: Path) -> Path:
    """A WordPiece tokenizer.json + vocab.txt over a small vocabulary (uncased, BERT special tokens)."""
    from tokenizers import BertWordPieceTokenizer

    path.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'\"-")
    vocab = specials + sorted(set(WORDS)) + chars + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertWordPieceTokenizer(str(path / "vocab.txt"), lowercase=True)
    tok.enable_truncation(max_length=512)
    tok.save(str(path / "tokenizer.json"))
    return path


def make_tiny_bert(path: Path, num_labels: int = 2, hidden: int = 32, layers: int = 2, heads: int = 2,
                   intermediate: int = 64, seed: int = 0, hidden_act: str = "gelu") -> Path:
    """A random BertForSequenceClassification folder (config.json, model.safetensors, tokenizer files)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    make_tokenizer_dir(path)
    vocab_size = len((path / "vocab.txt").read_text().split())
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate, max_position_embeddings=128, num_labels=num_labels, hidden_act=hidden_act,
    )
    BertForSequenceClassification(cfg).save_pretrained(str(path), safe_serialization=True)
    return path


def random_batches(vocab: int, n: int = 3, b: int = 4, s: int = 12, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(5, vocab, (b, s), generator=g)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[1, s // 2:] = 0  # one padded row, like a real batch
        ids[1, s // 2:] = 0
        tt = torch.zeros(b, s, dtype=torch.long)
        tt[:, s // 2:] = 1
        out.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": tt})
    return out


def calibrated_tiny_checkpoint(root: Path, *, hidden: int, intermediate: int, max_seq_length: int,
                               hidden_act: str = "gelu"):
    """A tiny BERT projected onto 2:4 ∩ INT8, calibrated on random batches and saved as a checkpoint.

    Returns (model, encoder Linear names, activation ranges, artifact)."""
    from transformers import AutoModelForSequenceClassification

    from holoserve.compress.checkpoint import CheckpointContents, save_checkpoint
    from holoserve.compress.layers import encoder_linear_names
    from holoserve.compress.quant import calibrate_amax
    from holoserve.compress.sparsify import project_layers
    from holoserve.data.tasks import get_task

    src = make_tiny_bert(root / "base", hidden=hidden, layers=2, heads=2, intermediate=intermediate,
                         hidden_act=hidden_act)
    model = AutoModelForSequenceClassification.from_pretrained(str(src)).eval()
    layers = encoder_linear_names(model)
    scales = project_layers(model, layers)
    amax = calibrate_amax(model, layers, random_batches(model.config.vocab_size, seed=1))
    art = save_checkpoint(model, src, root / "ckpt", CheckpointContents(task=get_task("sst2"), base_model="tiny",
        max_seq_length=max_seq_length, sparse_layers=layers, weight_scales=scales, act_amax=amax))
    return model, layers, amax, art
