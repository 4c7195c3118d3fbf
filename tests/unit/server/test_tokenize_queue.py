"""Bounded work without a server: the tokenizing queue (requests merged into one encode call off the event
loop, bounded), the memory releaser (glibc's free pages handed back once a burst of large bodies is over) and
the batcher taking a large request one batch at a time."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from holoserve.server.batcher import BatchPolicy, DynamicBatcher
from holoserve.server.memory import MemoryReleaser
from holoserve.server.tokenize import TokenizeQueue, TokenizeQueueFull
from tests.unit.server.test_token_budget import seq


class _Encoder:
    """Records each call (its items and thread) and can hold the worker at a gate."""

    def __init__(self):
        self.calls: list[tuple[list, str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, items):
        self.gate.wait(10)
        self.calls.append((list(items), threading.current_thread().name))
        if "boom" in items:
            raise ValueError("cannot encode boom")
        return [f"enc:{x}" for x in items]


def test_requests_waiting_together_are_encoded_in_one_call_off_the_loop():
    enc = _Encoder()

    async def main():
        q = TokenizeQueue(enc, max_pending=100, inline_bytes=10, busy=lambda: True)
        enc.gate.clear()
        first = asyncio.ensure_future(q.encode(["a"], 1))  # the worker takes it and waits at the gate
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(q.encode([f"t{i}", f"u{i}"], 4)) for i in range(5)]
        await asyncio.sleep(0.05)
        assert q.pending == 11
        enc.gate.set()
        got = await asyncio.gather(first, *rest)
        q.close()
        return got, q.pending

    got, pending = asyncio.run(main())
    assert got[0] == ["enc:a"] and got[3] == ["enc:t2", "enc:u2"] and pending == 0
    assert len(enc.calls) == 2 and len(enc.calls[1][0]) == 10  # the five that waited: one call
    assert all(name.startswith("holoserve-tokenize") for _, name in enc.calls)


def test_a_small_request_at_low_load_is_encoded_inline():
    enc = _Encoder()

    async def main():
        q = TokenizeQueue(enc, max_pending=100, inline_bytes=10, busy=lambda: False)
        out = await q.encode(["short"], 5), await q.encode(["x" * 50], 50)
        q.close()
        return out

    assert asyncio.run(main()) == (["enc:short"], ["enc:" + "x" * 50])
    assert enc.calls[0][1] == threading.current_thread().name  # inline
    assert enc.calls[1][1].startswith("holoserve-tokenize")  # over the inline size


def test_past_its_bound_the_queue_refuses_and_one_bad_request_fails_alone():
    enc = _Encoder()

    async def main():
        q = TokenizeQueue(enc, max_pending=5, inline_bytes=0)
        enc.gate.clear()
        held = asyncio.ensure_future(q.encode(["a", "b", "c"], 3))
        await asyncio.sleep(0.05)
        with pytest.raises(TokenizeQueueFull):
            await q.encode(["d", "e", "g"], 3)
        ok = asyncio.ensure_future(q.encode(["f"], 1))
        bad = asyncio.ensure_future(q.encode(["boom"], 4))
        enc.gate.set()
        results = await asyncio.gather(held, ok, bad, return_exceptions=True)
        q.close()
        return results

    held, ok, bad = asyncio.run(main())
    assert held == ["enc:a", "enc:b", "enc:c"] and ok == ["enc:f"] and isinstance(bad, ValueError)


def test_memory_is_handed_back_once_enough_was_freed_and_nothing_large_is_held(monkeypatch):
    trims = []
    rel = MemoryReleaser(min_freed_bytes=1000, min_interval_s=0.2)
    rel._trim = lambda pad: trims.append(time.monotonic()) or 1
    rel.freed(600, idle=True)
    rel.freed(600, idle=False)  # enough, but a large body is still held
    time.sleep(0.05)
    assert trims == []
    rel.freed(10, idle=True)
    deadline = time.monotonic() + 2
    while not trims and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(trims) == 1
    rel.freed(2000, idle=True)  # again, but at most once per interval: later, not now
    time.sleep(0.05)
    assert len(trims) == 1
    while len(trims) < 2 and time.monotonic() < deadline + 2:
        time.sleep(0.01)
    assert len(trims) == 2 and trims[1] - trims[0] >= 0.2


def test_a_request_behind_a_large_one_joins_its_next_batch():
    """A request of 4 batches' worth enters the queue one batch at a time: a one-text request sent just after
    it runs in the second batch, not after all four."""
    batches: list[list[int]] = []

    def infer(ids, mask, types):
        batches.append(ids[:, 0].tolist())
        time.sleep(0.02)
        return ids[:, :1].astype(np.float32)

    async def main():
        b = DynamicBatcher(infer, BatchPolicy(max_batch_size=8, max_queue_delay_ms=0, max_queue_size=64,
                                              max_padding_waste=-1.0, inline_single=False))
        b.start()
        large = asyncio.ensure_future(b.submit([seq(4, 1)] * 32))
        await asyncio.sleep(0.005)
        small = await b.submit([seq(4, 2)])
        got = await large
        await b.stop(5)
        return small, got

    small, got = asyncio.run(main())
    assert len(got) == 32 and all(int(r.logits[0]) == 1 for r in got) and int(small[0].logits[0]) == 2
    where = next(i for i, b in enumerate(batches) if 2 in b)
    assert where == 1 and len(batches) == 5, batches


def test_requests_waiting_together_share_a_batch_in_turns():
    """Two requests of 8 sequences and one of 1 wait behind a running batch: the next batch (8) takes the
    lone one and turns of the others, instead of the first request's 8."""
    batches: list[list[int]] = []
    gate = threading.Event()

    def infer(ids, mask, types):
        batches.append(ids[:, 0].tolist())
        if len(batches) == 1:
            gate.wait(5)
        return ids[:, :1].astype(np.float32)

    async def main():
        b = DynamicBatcher(infer, BatchPolicy(max_batch_size=8, max_queue_delay_ms=0, max_queue_size=64,
                                              max_padding_waste=-1.0, inline_single=False))
        b.start()
        first = asyncio.ensure_future(b.submit([seq(4, 9)]))
        while not batches:
            await asyncio.sleep(0.001)
        parts = [asyncio.ensure_future(b.submit([seq(4, t)] * n)) for t, n in ((1, 8), (2, 8), (3, 1))]
        await asyncio.sleep(0.02)
        gate.set()
        out = await asyncio.gather(first, *parts)
        await b.stop(5)
        return out

    out = asyncio.run(main())
    assert [len(r) for r in out] == [1, 8, 8, 1]
    assert 3 in batches[1] and batches[1].count(1) >= 3 and batches[1].count(2) >= 3, batches


def test_large_requests_leave_room_for_small_ones():
    from holoserve.server.batcher import admission_limit

    assert admission_limit(256, 1, 32) == 256 and admission_limit(256, 32, 32) == 256
    assert admission_limit(256, 64, 32) == 192  # past three quarters, a request of two batches waits its turn
    assert admission_limit(64, 64, 32) == 64  # but an idle server always takes the largest request allowed
