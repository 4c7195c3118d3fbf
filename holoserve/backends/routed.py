"""Two CPU backends served side by side, each batch run by the one that is faster for batches of its size."""
from __future__ import annotations

from typing import Any

from .base import Backend


class RoutedCpuBackend:
    """Two CPU backends loaded side by side, each batch run by the one that was faster for batches of its
    size (in the serving profile, or timed at start-up): `small` up to `max_small_tokens` tokens (rows x
    sequence), `large` above."""

    whole_batches = False

    def __init__(self, small: Backend, large: Backend, max_small_tokens: int):
        # HoloServe's ONNX Runtime sessions stop spinning when a run returns (core.ort.session), so they do not
        # take the cores the other runtime's next batch needs
        self.small, self.large, self.max_small_tokens = small, large, int(max_small_tokens)
        self.name = f"{small.name}+{large.name}"
        self.runs = {small.name: 0, large.name: 0}

    def infer(self, input_ids, attention_mask, token_type_ids):
        backend = self.small if input_ids.size <= self.max_small_tokens else self.large
        self.runs[backend.name] += 1
        return backend.infer(input_ids, attention_mask, token_type_ids)

    def route(self) -> dict[str, Any]:
        return {"small": self.small.name, "large": self.large.name, "max_small_tokens": self.max_small_tokens}

    def info(self) -> dict[str, Any]:
        parts = {b.name: b.info() for b in (self.small, self.large)}
        out: dict[str, Any] = {"backend": self.name, "routing": {**self.route(), "runs": dict(self.runs)},
                               "backends": parts}
        for part in parts.values():
            for key in ("kernels", "static_shapes"):  # OpenVINO's, where the server reports them for one backend
                if key in part:
                    out[key] = part[key]
        return out
