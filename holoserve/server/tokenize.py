"""Tokenizing off the event loop: the texts of requests that arrive together are encoded in one call of the
tokenizer, on one worker thread, so that a long text (or many) never stalls the loop that reads every other
request, and many short requests cost one hand-off instead of one each.

A small request (a few hundred bytes of text) that arrives while the server is idle is encoded on the loop
itself: alone, the hand-off to a thread would cost more than its tokenizing. Under load (`busy()`: the
batcher runs or has work waiting) every request goes to the worker, where the requests that arrived together
are encoded in one `encode_batch` call, which runs outside the interpreter lock. Texts waiting to be encoded are
bounded (`max_pending`); a request that would pass the bound is refused at once (`TokenizeQueueFull`, 503 +
Retry-After), as the batcher's queue refuses work past its own bound, and a request of more than one batch
already past three quarters of it (batcher.admission_limit), so one-text requests still find room.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from holoserve.core.tokenizer import Encoded

from .batcher import admission_limit

EncodeFn = Callable[[Sequence], list[Encoded]]


class TokenizeQueueFull(Exception):
    def __init__(self, pending: int, limit: int):
        super().__init__(f"{pending} texts are waiting to be tokenized (the limit is {limit}); retry in 1 s")


class TokenizeQueue:
    """Encodes requests' items (texts or pairs) with `encode`, merging the requests that wait together."""

    def __init__(self, encode: EncodeFn, max_pending: int, inline_bytes: int = 1024,
                 busy: Callable[[], bool] = lambda: False, batch: int = 32):
        self._encode = encode
        self.batch = batch  # a request of more items is "large" (batcher.admission_limit)
        self._server_busy = busy
        self.max_pending = max_pending
        self.inline_bytes = inline_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="holoserve-tokenize")
        self._lock = threading.Lock()
        self._waiting: list[tuple[Sequence, asyncio.Future]] = []
        self._busy = False  # the worker is encoding or about to
        self.pending = 0  # items handed to the worker and not yet delivered (event-loop thread only)

    async def encode(self, items: Sequence, nbytes: int) -> list[Encoded]:
        if nbytes <= self.inline_bytes and not self._busy and not self._server_busy():
            return self._encode(items)
        limit = admission_limit(self.max_pending, len(items), self.batch)
        if self.pending + len(items) > limit:
            raise TokenizeQueueFull(self.pending, limit)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending += len(items)
        with self._lock:
            self._waiting.append((items, future))
            start, self._busy = not self._busy, True
        if start:
            self._pool.submit(self._drain, loop)
        return await future

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the worker: encode everything waiting, in one call, until nothing is."""
        while True:
            with self._lock:
                if not self._waiting:
                    self._busy = False
                    return
                batch, self._waiting = self._waiting, []
            try:
                results: list = self._split(batch, self._encode([it for items, _ in batch for it in items]))
            except Exception:  # one request's input fails alone
                results = []
                for items, _ in batch:
                    try:
                        results.append(self._encode(items))
                    except Exception as e:
                        results.append(e)
            try:
                loop.call_soon_threadsafe(self._deliver, batch, results)
            except RuntimeError:  # the loop has closed: nobody waits any more
                return

    @staticmethod
    def _split(batch: list[tuple[Sequence, asyncio.Future]], encs: list[Encoded]) -> list[list[Encoded]]:
        out, i = [], 0
        for items, _ in batch:
            out.append(encs[i:i + len(items)])
            i += len(items)
        return out

    def _deliver(self, batch: list[tuple[Sequence, asyncio.Future]], results: list) -> None:
        for (items, future), result in zip(batch, results):
            self.pending -= len(items)
            if future.done():  # the request was cancelled (its client left)
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
