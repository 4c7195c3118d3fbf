"""Which modules are compressed: every nn.Linear inside the encoder layers of a BERT-family model."""
from __future__ import annotations

from torch import nn


def encoder_linear_names(model: nn.Module) -> list[str]:
    """Names of Q, K, V, attention-output, FFN-in and FFN-out Linears of every encoder layer.

    Embeddings, LayerNorm, the pooler and the classifier head are not included: they stay dense.
    """
    names = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and ".encoder.layer." in f".{name}"
    ]
    if not names:
        raise ValueError("no encoder Linear layers found: is this a BERT-family model (…encoder.layer.N…)?")
    return names


def get_linear(model: nn.Module, name: str) -> nn.Linear:
    mod = model.get_submodule(name)
    if not isinstance(mod, nn.Linear):
        raise ValueError(f"{name} is not an nn.Linear")
    return mod
