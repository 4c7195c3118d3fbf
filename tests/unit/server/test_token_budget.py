"""Token-budget batching (--max-batch-tokens): a batch closes on padded tokens, not only on count."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from holoserve import HoloServeError
from holoserve.core.tokenizer import Encoded
from holoserve.server.batcher import BatchPolicy, DynamicBatcher
from holoserve.server.config import ServerConfig


def seq(length: int, tag: int) -> Encoded:
    ids = np.full(length, 5, dtype=np.int64)
    ids[0] = tag
    return Encoded(input_ids=ids, token_type_ids=np.zeros(length, dtype=np.int64), truncated=False)


def run(lengths: list[int], *, max_batch_tokens: int, max_batch_size: int = 32, delay_ms: float = 0.0):
    """Queue `lengths` behind a slow first inference; the (rows, padded length) of every backend call, and
    each sequence's result tag (its first token id)."""
    calls: list[tuple[int, int]] = []
    gate = threading.Event()

    def infer(ids, mask, types):
        calls.append(tuple(ids.shape))
        if len(calls) == 1:
            gate.wait(5)
        return ids[:, :1].astype(np.float32)

    async def main():
        b = DynamicBatcher(infer, BatchPolicy(max_batch_size=max_batch_size, max_queue_delay_ms=delay_ms,
                                              max_queue_size=256, max_padding_waste=-1.0,
                                              max_batch_tokens=max_batch_tokens))
        b.start()
        first = asyncio.ensure_future(b.submit([seq(4, 1)]))
        while not calls:
            await asyncio.sleep(0.001)
        rest = [asyncio.ensure_future(b.submit([seq(L, 10 + i)])) for i, L in enumerate(lengths)]
        await asyncio.sleep(0.05)
        gate.set()
        out = [await first] + [await r for r in rest]
        await b.stop(5)
        return [int(r[0].logits[0]) for r in out]

    tags = asyncio.run(main())
    return calls[1:], tags


def test_off_by_default_batches_on_count():
    calls, tags = run([8, 8, 60, 8, 8], max_batch_tokens=0)
    assert calls == [(5, 60)]  # everything padded to the long one
    assert tags == [1, 10, 11, 12, 13, 14]


def test_budget_closes_batches_on_padded_tokens_in_arrival_order():
    # budget 64: [8, 8] fits (2 x 8); adding 60 would be 3 x 60 = 180 > 64: the long one goes next, alone
    # (1 x 60); then 60 with an 8 would be 2 x 60 > 64, so [8, 8] runs after it.
    calls, tags = run([8, 8, 60, 8, 8], max_batch_tokens=64)
    assert calls == [(2, 8), (1, 60), (2, 8)]
    assert tags == [1, 10, 11, 12, 13, 14]  # every caller gets its own answer


def test_longer_than_budget_runs_alone_and_count_still_caps():
    calls, _ = run([100, 3, 3, 3, 3, 3], max_batch_tokens=50, max_batch_size=3)
    assert calls == [(1, 100), (3, 3), (2, 3)]


def test_budget_counts_as_full_for_the_queue_delay():
    """With a queue delay, a queue that already fills the budget is a full batch: no waiting out the delay."""
    calls: list[tuple[int, int]] = []

    def infer(ids, mask, types):
        calls.append(tuple(ids.shape))
        return ids[:, :1].astype(np.float32)

    async def main():
        b = DynamicBatcher(infer, BatchPolicy(max_batch_size=32, max_queue_delay_ms=3000, max_queue_size=64,
                                              max_padding_waste=-1.0, max_batch_tokens=60))
        b.start()
        out = await asyncio.gather(*(b.submit([seq(30, 10 + i)]) for i in range(4)))
        await b.stop(5)
        return out

    t0 = time.perf_counter()
    asyncio.run(main())
    assert calls == [(2, 30), (2, 30)]
    assert time.perf_counter() - t0 < 2.0  # neither batch waited out the 3 s delay


def test_config_rejects_negative_budget():
    with pytest.raises(HoloServeError, match="max batch tokens must be >= 0"):
        ServerConfig(max_batch_tokens=-1).validate()
