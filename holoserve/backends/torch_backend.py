"""PyTorch reference backend: the checkpoint's safetensors in transformers, fp32, CPU or CUDA.

Slow and heavy compared with ONNX Runtime or TensorRT, but it runs the checkpoint exactly as it
was trained, so it is the reference for parity checks and a fallback where no export exists.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from holoserve.core.artifact import Artifact
from .base import BackendUnavailable


class TorchBackend:
    name = "torch"
    whole_batches = False  # on a CPU, length groups save the padded tokens' work

    def __init__(self, artifact: Artifact, *, device: str = "auto", threads: int | None = None):
        try:
            import torch
            from transformers import AutoModelForSequenceClassification
        except ImportError as e:
            raise BackendUnavailable(
                f"the torch backend needs torch and transformers ({e}): pip install 'holoserve[compress]', "
                "or serve the ONNX export with --backend onnxruntime"
            ) from None
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("torch cannot see a CUDA GPU; use device=cpu")
        if threads:
            torch.set_num_threads(int(threads))
        self.torch = torch
        self.device = torch.device(device)
        # safetensors only: never fall back to a pickled weights file
        self.model = AutoModelForSequenceClassification.from_pretrained(str(artifact.path), local_files_only=True,
                                                                        use_safetensors=True)
        self.model.eval().to(self.device)

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray) -> np.ndarray:
        t = self.torch
        with t.inference_mode():
            out = self.model(
                input_ids=t.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).to(self.device),
                attention_mask=t.from_numpy(np.ascontiguousarray(attention_mask, dtype=np.int64)).to(self.device),
                token_type_ids=t.from_numpy(np.ascontiguousarray(token_type_ids, dtype=np.int64)).to(self.device),
            )
        return out.logits.float().cpu().numpy()

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "device": str(self.device), "torch_version": self.torch.__version__,
                "precision": "fp32 (weights hold the int8-grid values)"}


def load(artifact: Artifact, **options: Any) -> TorchBackend:
    return TorchBackend(artifact, device=options.get("device", "auto"), threads=options.get("threads"))
