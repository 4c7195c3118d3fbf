"""The optional PyTorch import shared by the torch-cuda modules.

torch is optional for the server: this package imports without it, and every entry point calls
`torch_or_raise()` before it needs torch.
"""
from __future__ import annotations

from holoserve.backends.base import BackendUnavailable

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - exercised only where torch is absent
    torch = None  # type: ignore[assignment]
    F = None  # type: ignore[assignment]

# Base class of the backend's modules; a placeholder where torch is absent, so the classes still define.
Module = torch.nn.Module if torch is not None else object


def torch_or_raise():
    if torch is None:
        raise BackendUnavailable(
            "backend 'torch-cuda' needs PyTorch with CUDA: install a CUDA build of torch "
            "(e.g. pip install 'holoserve[compress]' on a GPU machine), or use --backend onnxruntime"
        )
    return torch
