"""Two CPU backends served side by side, each batch run by the one that is faster for batches of its size."""
from __future__ import annotations

import threading
from typing import Any, Mapping

from holoserve import HoloServeError

from .base import Backend


class RoutedCpuBackend:
    """Two CPU backends loaded side by side, each batch run by the one that was faster for batches of its
    size (in the serving profile, or timed at start-up): `small` up to `max_small_tokens` tokens (rows x
    sequence), or up to `max_small_rows` rows (the light-load route: one-row batches, what a lightly loaded
    server runs), `large` above. Exactly one of the two limits is given."""

    whole_batches = False

    def __init__(self, small: Backend, large: Backend, max_small_tokens: int | None = None,
                 max_small_rows: int | None = None):
        if (max_small_tokens is None) == (max_small_rows is None):
            raise HoloServeError("a routed pair takes either a token limit or a row limit for its small batches")
        # HoloServe's ONNX Runtime sessions stop spinning when a run returns (core.ort.session), so they do not
        # take the cores the other runtime's next batch needs
        self.small, self.large = small, large
        self.max_small_tokens = int(max_small_tokens) if max_small_tokens is not None else None
        self.max_small_rows = int(max_small_rows) if max_small_rows is not None else None
        self.name = f"{small.name}+{large.name}"
        self.runs = {small.name: 0, large.name: 0}
        # batches at once: as many as both sides take (each side's threads are shared by its instances)
        self.instances = min(int(getattr(small, "instances", 1)), int(getattr(large, "instances", 1)))
        self._count = threading.Lock()

    @classmethod
    def from_route(cls, backends: Mapping[str, Backend], route: Mapping[str, Any]) -> "RoutedCpuBackend":
        """The pair a routed decision (or route()'s dict) names, from the loaded backends. Raises KeyError,
        TypeError, ValueError or HoloServeError (not exactly one limit) where the route is not one."""
        tokens, rows = route.get("max_small_tokens"), route.get("max_small_rows")
        return cls(backends[route["small"]], backends[route["large"]],
                   max_small_tokens=int(tokens) if tokens is not None else None,
                   max_small_rows=int(rows) if rows is not None else None)

    def infer(self, input_ids, attention_mask, token_type_ids):
        if self.max_small_rows is not None:
            backend = self.small if input_ids.shape[0] <= self.max_small_rows else self.large
        else:
            backend = self.small if input_ids.size <= self.max_small_tokens else self.large
        with self._count:
            self.runs[backend.name] += 1
        return backend.infer(input_ids, attention_mask, token_type_ids)

    def route(self) -> dict[str, Any]:
        limit = ({"max_small_rows": self.max_small_rows} if self.max_small_rows is not None
                 else {"max_small_tokens": self.max_small_tokens})
        return {"small": self.small.name, "large": self.large.name, **limit}

    def info(self) -> dict[str, Any]:
        parts = {b.name: b.info() for b in (self.small, self.large)}
        out: dict[str, Any] = {"backend": self.name, "routing": {**self.route(), "runs": dict(self.runs)},
                               "backends": parts}
        for part in parts.values():
            for key in ("kernels", "static_shapes"):  # OpenVINO's, where the server reports them for one backend
                if key in part:
                    out[key] = part[key]
        return out
