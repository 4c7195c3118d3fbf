"""The backend interface: load(artifact) -> infer(input_ids, attention_mask, token_type_ids) -> logits.

Inputs are int64 numpy arrays of shape [batch, seq]; the result is float32 logits [batch, num_labels].
Each implementation lives in its own module and registers a loader under a short name; the module
is imported only when that backend is asked for, so a missing library costs nothing until used.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

import numpy as np

from .. import HoloServeError
from holoserve.core.artifact import Artifact


class BackendUnavailable(HoloServeError):
    """This machine cannot run the requested backend; the message says why and what would fix it."""


class Backend(Protocol):
    name: str
    # True where one padded launch costs less than several smaller ones (GPU backends): the server then
    # runs a merged batch whole instead of in length groups (ServerConfig.max_padding_waste="auto").
    whole_batches: bool

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray) -> np.ndarray: ...

    def info(self) -> dict[str, Any]: ...


# name -> "module:function"; the function takes (artifact, **options) and returns a Backend.
_LOADERS: dict[str, str] = {
    "onnxruntime": "holoserve.backends.onnxruntime:load",
    "openvino": "holoserve.backends.openvino:load",
    "tensorrt": "holoserve.backends.tensorrt:load",
    "torch": "holoserve.backends.torch_backend:load",
    "torch-cuda": "holoserve.backends.torch_cuda:load",
}


def register(name: str, target: str) -> None:
    _LOADERS[name] = target


def available_backends() -> list[str]:
    return list(_LOADERS)


def load_backend(name: str, artifact: Artifact, **options: Any) -> Backend:
    if name not in _LOADERS:
        raise HoloServeError(f"unknown backend {name!r}: choose one of {', '.join(_LOADERS)} or 'auto'")
    module, func = _LOADERS[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailable(f"backend {name!r} cannot be imported here: {e}") from None
    loader: Callable[..., Backend] = getattr(mod, func)
    return loader(artifact, **options)
