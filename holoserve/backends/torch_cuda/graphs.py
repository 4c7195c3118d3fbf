"""CUDA graphs: one captured graph per (batch, sequence) bucket, so a request costs a few launches.

Inputs are padded into the bucket's static buffers (padded rows attend to one position, so they
stay finite, and are discarded); a bucket is captured on its first request. A failed capture turns
graphs off for the runner and it goes on eagerly, with the error recorded.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterable

from ._torch import torch


def _bucket(value: int, buckets: Iterable[int]) -> int:
    for b in sorted(buckets):
        if value <= b:
            return b
    raise ValueError(value)


class GraphRunner:
    """Replays one captured CUDA graph per (batch, seq) bucket; inputs are padded into static buffers."""

    def __init__(self, model, *, device, batch_buckets, seq_buckets, vocab_pad_id: int = 0, graphs: bool = True):
        self.model = model
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

    def _capture(self, b: int, n: int):
        t0 = time.perf_counter()
        static = self._static(b, n)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up outside capture (cuSPARSELt/cuBLAS workspaces, SDPA choice)
                self.model(**static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            out = self.model(**static)
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
                return self.model(**static)[:b]
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

    @staticmethod
    def _fill(static, input_ids, attention_mask, token_type_ids):
        b, n = input_ids.shape
        for key, src in (("input_ids", input_ids), ("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            dst = static[key]
            if dst.shape != src.shape:
                dst.zero_()
                if key == "attention_mask":
                    dst[:, 0] = 1  # padded rows attend to one position: finite, and discarded
            dst[:b, :n].copy_(src, non_blocking=True)
