"""PyTorch reference backend: the checkpoint's safetensors in transformers, fp32, CPU or CUDA.

Slow and heavy compared with ONNX Runtime or TensorRT, but it runs the checkpoint exactly as it
was trained, so it is the reference for parity checks and a fallback where no export exists.

On a GPU it is also the dense baseline a GPU user would serve: `torch_precision="fp16"` runs the model in
FP16 (CUDA only; a precision change, so predictions can differ from fp32 in a few rows), and
`torch_compile=True` runs it through `torch.compile` (Inductor; dynamic shapes, so the server's varying
batch and sequence lengths do not each compile anew; the first calls compile, which the server's warm-up pays).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from holoserve import HoloServeError
from holoserve.core.artifact import Artifact
from holoserve.core.choices import TORCH_PRECISIONS
from .base import BackendUnavailable


class TorchBackend:
    name = "torch"
    # on a CPU, length groups save the padded tokens' work; on a GPU one padded launch costs less than several
    whole_batches = False

    def __init__(self, artifact: Artifact, *, device: str = "auto", threads: int | None = None,
                 precision: str = "fp32", compile_model: bool = False):
        if precision not in TORCH_PRECISIONS:
            raise HoloServeError(f"torch_precision must be one of {TORCH_PRECISIONS}, not {precision!r}")
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
        if precision == "fp16" and not device.startswith("cuda"):
            raise BackendUnavailable("torch_precision='fp16' runs on a CUDA GPU only (CPU matmuls in FP16 are slow and "
                                 "not what a CPU serves): use torch_precision='fp32' on the CPU")
        if threads:
            torch.set_num_threads(int(threads))
        self.torch = torch
        self.device = torch.device(device)
        self.whole_batches = self.device.type == "cuda"
        # safetensors only: never fall back to a pickled weights file
        self.model = AutoModelForSequenceClassification.from_pretrained(str(artifact.path), local_files_only=True,
                                                                        use_safetensors=True)
        self.model.eval().to(self.device)
        self.precision = precision
        if precision == "fp16":
            self.model.half()
        self.compiled = bool(compile_model)
        self._forward = torch.compile(self.model, dynamic=True) if compile_model else self.model

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray) -> np.ndarray:
        t = self.torch
        with t.inference_mode():
            out = self._forward(
                input_ids=t.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).to(self.device),
                attention_mask=t.from_numpy(np.ascontiguousarray(attention_mask, dtype=np.int64)).to(self.device),
                token_type_ids=t.from_numpy(np.ascontiguousarray(token_type_ids, dtype=np.int64)).to(self.device),
            )
        return out.logits.float().cpu().numpy()

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "device": str(self.device), "torch_version": self.torch.__version__,
                "precision": f"{self.precision} (weights hold the checkpoint's values; dense GEMMs)",
                "compiled": "torch.compile (dynamic shapes)" if self.compiled else False}


def load(artifact: Artifact, **options: Any) -> TorchBackend:
    """`options`: device ("auto", "cpu", "cuda"), threads, torch_precision (TORCH_PRECISIONS), torch_compile."""
    return TorchBackend(artifact, device=options.get("device", "auto"), threads=options.get("threads"),
                        precision=options.get("torch_precision", "fp32"),
                        compile_model=bool(options.get("torch_compile")))
