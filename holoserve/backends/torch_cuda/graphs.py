"""CUDA graphs: one captured graph per (batch, sequence) bucket, so a request costs a few launches.

Inputs are padded into the bucket's static buffers (padded rows attend to one position, so they
stay finite, and are discarded); a bucket is captured on its first request. A failed capture turns
graphs off for the runner and it goes on eagerly, with the error recorded.

A runner can hold more than one build of the same weights (`variants`, by name): `routes` sends each
bucket to one of them (routing.py measures which is faster per bucket at load), `trial` runs a bucket on
a given variant for that measurement, and `adopt` keeps the winner's graph for serving.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Mapping

from ._torch import torch


def _bucket(value: int, buckets: Iterable[int]) -> int:
    for b in sorted(buckets):
        if value <= b:
            return b
    raise ValueError(value)


class GraphRunner:
    """Replays one captured CUDA graph per (batch, seq) bucket; inputs are padded into static buffers."""

    def __init__(self, model, *, device, batch_buckets, seq_buckets, vocab_pad_id: int = 0, graphs: bool = True,
                 variants: Mapping[str, Any] | None = None):
        self.model = model  # what a bucket without a route runs
        # other builds of the same weights, by name; routes[(batch, seq)] names the one a bucket runs
        self.variants: dict[str, Any] = dict(variants or {})
        self.routes: dict[tuple[int, int], str] = {}
        self._trials: dict[tuple[int, int, str], tuple[Any, dict[str, Any], Any]] = {}
        self.device = device
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.seq_buckets = tuple(sorted(seq_buckets))
        self.pad_id = vocab_pad_id
        self.graphs = graphs
        self._graphs: dict[tuple[int, int], tuple[Any, dict[str, Any], Any]] = {}
        self._pool = None
        self._lock = threading.Lock()
        self.capture_seconds: dict[str, float] = {}
        self.graph_error: str | None = None

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    def buckets_for(self, batch: int, seq: int) -> tuple[int, int]:
        return _bucket(batch, self.batch_buckets), _bucket(seq, self.seq_buckets)

    def _static(self, b: int, n: int):
        ids = torch.full((b, n), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((b, n), dtype=torch.long, device=self.device)
        mask[:, 0] = 1
        tt = torch.zeros((b, n), dtype=torch.long, device=self.device)
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": tt}

    def model_for(self, b: int, n: int):
        """The model bucket (b, n) runs: its routed variant, else the runner's model."""
        name = self.routes.get((b, n))
        return self.model if name is None else self.variants[name]

    def _capture(self, b: int, n: int, model=None):
        t0 = time.perf_counter()
        model = model if model is not None else self.model_for(b, n)
        static = self._static(b, n)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up outside capture (cuSPARSELt/cuBLAS workspaces, SDPA choice)
                model(**static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            out = model(**static)
        torch.cuda.synchronize(self.device)
        self.capture_seconds[f"{b}x{n}"] = round(time.perf_counter() - t0, 3)
        return graph, static, out

    def run_bucket(self, input_ids, attention_mask, token_type_ids):
        """Run torch int64 tensors (already on the device, shape [b, n] within the largest bucket)."""
        b, n = input_ids.shape
        bb, nb = self.buckets_for(b, n)
        if not self.graphs:
            static = self._static(bb, nb)
            self._fill(static, input_ids, attention_mask, token_type_ids)
            with torch.inference_mode():
                return self.model_for(bb, nb)(**static)[:b]
        with self._lock:
            entry = self._graphs.get((bb, nb))
            if entry is None:
                try:
                    entry = self._graphs[(bb, nb)] = self._capture(bb, nb)
                except Exception as e:  # noqa: BLE001 - a capture failure must not take the backend down
                    self.graphs = False
                    self.graph_error = f"{type(e).__name__}: {e}"
                    torch.cuda.synchronize(self.device)
                    return self.run_bucket(input_ids, attention_mask, token_type_ids)
            graph, static, out = entry
            self._fill(static, input_ids, attention_mask, token_type_ids)
            graph.replay()
            return out[:b].clone()

    def trial(self, b: int, n: int, name: str) -> Callable[[], Any]:
        """A call that runs bucket (b, n) once on variant `name` (the variants or "" for the runner's model),
        on the bucket's static inputs: its graph's replay, captured here and kept for `adopt`, or an eager
        forward where graphs are off or the capture failed (then graphs are off for the runner, as in
        run_bucket). For timing the variants against each other."""
        model = self.variants[name] if name else self.model
        if self.graphs:
            try:
                with self._lock:
                    key = (b, n, name)
                    if key not in self._trials:
                        self._trials[key] = self._capture(b, n, model)
                    return self._trials[key][0].replay
            except Exception as e:  # noqa: BLE001 - a capture failure must not take the backend down
                self.graphs = False
                self.graph_error = f"{type(e).__name__}: {e}"
                self._trials.clear()
                torch.cuda.synchronize(self.device)
        static = self._static(b, n)

        def eager():
            with torch.inference_mode():
                return model(**static)

        return eager

    def adopt(self, b: int, n: int, name: str) -> None:
        """Route bucket (b, n) to variant `name` ("" for the runner's model); its graph from `trial`, if any,
        serves the bucket from now on and the other variants' trial graphs of the bucket are dropped."""
        with self._lock:
            if name:
                self.routes[(b, n)] = name
            else:
                self.routes.pop((b, n), None)
            kept = self._trials.pop((b, n, name), None)
            for key in [k for k in self._trials if k[:2] == (b, n)]:
                del self._trials[key]
            if kept is not None and self.graphs:
                self._graphs[(b, n)] = kept

    def drop_unrouted(self) -> list[str]:
        """Free the variants no bucket is routed to (and any trial graph left); returns their names."""
        with self._lock:
            used = set(self.routes.values())
            dropped = [name for name in self.variants if name not in used]
            for name in dropped:
                del self.variants[name]
            self._trials.clear()
            return dropped

    @staticmethod
    def _fill(static, input_ids, attention_mask, token_type_ids):
        b, n = input_ids.shape
        for key, src in (("input_ids", input_ids), ("attention_mask", attention_mask),
                         ("token_type_ids", token_type_ids)):
            dst = static[key]
            if dst.shape != src.shape:
                dst.zero_()
                if key == "attention_mask":
                    dst[:, 0] = 1  # padded rows attend to one position: finite, and discarded
            dst[:b, :n].copy_(src, non_blocking=True)
