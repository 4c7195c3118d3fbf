"""Dynamic batching: merge sequences from concurrent requests into one backend call.

One asyncio task owns the queue. It takes the oldest waiting sequence, waits until the batch is full or that
sequence has waited `max_queue_delay` (Triton's rule), pads the batch to its longest member and runs the
backend in a worker thread so the event loop keeps accepting requests (a lone sequence with nothing queued
behind it may run on the loop itself, see `inline_single`; with one instance only, as a request arriving
meanwhile could start on another). Each sequence carries its own future, so results go back to exactly the
caller that sent it. A batch is full at `max_batch_size` sequences or, with a token budget
(`max_batch_tokens`, as in text-embeddings-inference), when one more sequence would take its padded size
(sequences x the longest) past the budget: sequences are taken in arrival order, and one longer than the
budget runs alone. The queue is bounded in sequences: a request that does not fit is refused at once
(`QueueFull` -> 503 + Retry-After) instead of growing an unbounded backlog. When a merged batch fails, its
sequences are run again one by one, so a sequence the backend cannot take fails alone (`InferenceFailed`) and
the requests batched with it are still answered. With `instances` > 1 (Triton's instance count) up to that
many batches run at once, each on its own worker thread; the next batch forms while they run and starts when
one ends.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from holoserve.core.tokenizer import GROUP_WASTE, Encoded, pad_batch, split_by_length
from .metrics import ServerMetrics

InferFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]

log = logging.getLogger("holoserve.server")


# A request of more than one batch is admitted only while the queue stays under this share of its bound, so
# that one-text requests still find room behind a few large ones.
LARGE_REQUEST_SHARE = 0.75


def admission_limit(bound: int, items: int, batch: int) -> int:
    """How many sequences may wait, counting a request of `items`: the bound, or for a request of more than one
    batch its LARGE_REQUEST_SHARE (never less than the request itself, which an idle server always takes)."""
    return bound if items <= batch else max(int(LARGE_REQUEST_SHARE * bound), items)


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"the inference queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    pass


class InferenceFailed(Exception):
    """The backend failed on this sequence even when it ran alone."""

    def __init__(self, error: BaseException):
        self.kind = type(error).__name__
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        super().__init__(f"{self.kind}: {first_line}" if first_line else self.kind)


@dataclass(frozen=True)
class Result:
    logits: np.ndarray  # [num_labels]
    queue_s: float
    infer_s: float
    batch_id: int
    batch_size: int


class _Item:
    __slots__ = ("enc", "future", "t_enqueue", "group")

    def __init__(self, enc: Encoded, future: asyncio.Future, t: float, group: int = 0):
        self.enc, self.future, self.t_enqueue, self.group = enc, future, t, group


@dataclass(frozen=True)
class BatchPolicy:
    """How the batcher forms batches (the module docstring says how each limit acts)."""

    max_batch_size: int  # sequences per backend call
    max_queue_delay_ms: float  # the longest the oldest waiting sequence waits for company
    max_queue_size: int  # waiting sequences; one more is refused with QueueFull
    max_padding_waste: float = GROUP_WASTE  # the padded share above which a merged batch runs in length groups
    inline_single: bool = False  # a lone sequence with nothing queued runs on the event loop itself
    max_batch_tokens: int = 0  # padded tokens per batch (sequences x the longest); 0: no token budget
    instances: int = 1  # batches run at once (the backend must take concurrent calls)


class DynamicBatcher:
    def __init__(self, infer: InferFn, policy: BatchPolicy, *, pad_id: int = 0, metrics: ServerMetrics | None = None):
        self._infer = infer
        self.policy = policy
        self.max_batch_tokens = policy.max_batch_tokens
        self.max_batch_size = policy.max_batch_size
        self.max_delay = policy.max_queue_delay_ms / 1000.0
        self.max_queue_size = policy.max_queue_size
        self.pad_id = pad_id
        self.max_padding_waste = policy.max_padding_waste
        self.metrics = metrics
        self.instances = max(1, int(policy.instances))
        # with several instances a request read after an inline run could have started on another instance
        self.inline_single = policy.inline_single and self.instances == 1
        self._queue: deque[_Item] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._slots = asyncio.Semaphore(self.instances)
        self._running: set[asyncio.Task] = set()
        self._batch_ids = itertools.count(1)
        self._groups = itertools.count(1)  # one per enqueued part of a request
        self.waiting = 0  # sequences of the requests submitted and not yet answered (queued or not yet)
        self._avg_batch_s = 0.01
        # `instances` inferences at a time; each backend call parallelises inside itself (intra-op threads).
        self._executor = ThreadPoolExecutor(max_workers=self.instances, thread_name_prefix="holoserve-infer")

    # ---- lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="holoserve-batcher")

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Refuse new work, finish what is queued (up to `timeout_s`), then stop the loop."""
        self._closing = True
        self._wakeup.set()
        deadline = time.monotonic() + timeout_s
        while (self._queue or self._running) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(ShuttingDown("the server is shutting down"))
        self._queue.clear()
        self._executor.shutdown(wait=True)

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        """A batch is running or sequences wait: the server is under load."""
        return bool(self._running) or bool(self._queue)

    def retry_after_s(self) -> int:
        batches_ahead = math.ceil(max(1, len(self._queue)) / self.max_batch_size) + 1
        return max(1, math.ceil(batches_ahead * self._avg_batch_s / self.instances))

    # ---- producer side
    async def submit(self, encs: Sequence[Encoded]) -> list[Result]:
        """The results of a request's sequences, in order. A request of more than one batch enters the queue
        one batch's worth at a time, the next once the previous is answered, so the requests that arrive
        behind a large one join its next batch instead of waiting for all of it."""
        if self._closing:
            raise ShuttingDown("the server is shutting down")
        if self.waiting + len(encs) > admission_limit(self.max_queue_size, len(encs), self.max_batch_size):
            raise QueueFull(self.retry_after_s())
        step = self.max_batch_size
        self.waiting += len(encs)
        try:
            if len(encs) <= step:
                return await self._enqueue(encs)
            results: list[Result] = []
            for i in range(0, len(encs), step):
                if self._closing:
                    raise ShuttingDown("the server is shutting down")
                results += await self._enqueue(encs[i:i + step])
            return results
        finally:
            self.waiting -= len(encs)

    async def _enqueue(self, encs: Sequence[Encoded]) -> list[Result]:
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        futures = []
        group = next(self._groups)
        for enc in encs:
            fut = loop.create_future()
            self._queue.append(_Item(enc, fut, now, group))
            futures.append(fut)
        if self.metrics:
            self.metrics.pending_l.set(len(self._queue))
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:
            for f in futures:  # a client that went away: its queued sequences are skipped
                f.cancel()
            raise

    # ---- consumer side
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._slots.acquire()  # a free instance; meanwhile the batch grows
            try:
                await self._gather(loop)
                batch = self._take()
            except BaseException:
                self._slots.release()
                raise
            if self.metrics:
                self.metrics.pending_l.set(len(self._queue))
            if not batch:
                self._slots.release()
                continue
            if self.inline_single and len(batch) == 1 and not self._queue:
                # Alone in the server (one instance, whose slot this holds): run here, sparing the thread
                # hand-off and its wake-ups.
                self._run_inline(batch)
                self._slots.release()
                continue
            task = loop.create_task(self._execute(loop, batch))
            self._running.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._slots.release()
        self._wakeup.set()  # the loop may be waiting for this instance to go on

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for company until the batch is full or the oldest sequence has waited long enough."""
        while not self._queue:  # the queue may have emptied while waiting for an instance
            if self._closing:
                return
            self._wakeup.clear()
            await self._wakeup.wait()
        deadline = self._queue[0].t_enqueue + self.max_delay
        while self.max_delay > 0 and not self._closing and not self._full():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            # Woken by a new arrival or by the timer, whichever comes first (cheaper than wait_for).
            self._wakeup.clear()
            timer = loop.call_later(remaining, self._wakeup.set)
            await self._wakeup.wait()
            timer.cancel()

    def _run_inline(self, batch: list[_Item]) -> None:
        t_start = time.perf_counter()
        try:
            logits, calls = self._run_batch([batch[0].enc])
        except Exception as e:
            self._settle(batch, [e], t_start)
            return
        self._answer(batch, logits, calls, t_start)

    async def _execute(self, loop: asyncio.AbstractEventLoop, batch: list[_Item]) -> None:
        """Run one batch on a worker thread and answer its sequences."""
        t_start = time.perf_counter()
        try:
            logits, calls = await loop.run_in_executor(self._executor, self._run_batch, [it.enc for it in batch])
        except Exception as e:  # a backend failure: find the sequence(s) it belongs to
            if len(batch) > 1:
                log.warning("a batch of %d sequences failed (%s: %s); running them one by one",
                            len(batch), type(e).__name__, str(e)[:200])
                try:
                    outcomes = await loop.run_in_executor(self._executor, self._run_each, [it.enc for it in batch])
                except Exception as again:  # the executor itself is gone (shutting down)
                    outcomes = [again] * len(batch)
            else:
                outcomes = [e]
            self._settle(batch, outcomes, t_start)
            return
        self._answer(batch, logits, calls, t_start)

    def _answer(self, batch: list[_Item], logits: np.ndarray, calls: int, t_start: float) -> None:
        infer_s = time.perf_counter() - t_start
        self._avg_batch_s = 0.9 * self._avg_batch_s + 0.1 * infer_s
        bid = next(self._batch_ids)
        if self.metrics:
            self.metrics.exec_count_l.inc(calls)
            self.metrics.count_l.inc(len(batch))
            self.metrics.batch_size_l.observe(len(batch))
            self.metrics.infer_duration_l.observe(infer_s)
        for i, it in enumerate(batch):
            if not it.future.done():
                it.future.set_result(Result(logits[i], t_start - it.t_enqueue, infer_s, bid, len(batch)))

    def _full(self) -> bool:
        """The queue holds a full batch: by count, or by padded tokens under a token budget."""
        q = self._queue
        if len(q) >= self.max_batch_size:
            return True
        budget = self.max_batch_tokens
        if budget:
            longest = 0
            for n, it in enumerate(q, 1):
                longest = max(longest, it.enc.length)
                if n * longest >= budget:
                    return True
        return False

    def _take(self) -> list[_Item]:
        """The next batch: up to `max_batch_size` sequences and, under a token budget, as many as fit in it padded
        to their longest (always at least one). Requests waiting together share it in turns, oldest first (one
        sequence of each in arrival order, then a second of each, ...), so a request with many sequences
        queued does not hold up the one-text requests behind it."""
        q = self._queue
        while q and q[0].future.done():  # cancelled by a departed client
            q.popleft()
        if not q:
            return []
        if q[-1].group == q[0].group:  # one request waiting (the common case under light load)
            order = range(min(len(q), self.max_batch_size))
        else:
            order = self._turns()
        batch: list[_Item] = []
        taken: set[int] = set()
        budget = self.max_batch_tokens
        longest = 0
        for i in order:
            item = q[i]
            if item.future.done():
                taken.add(i)
                continue
            if budget:
                longest_with = max(longest, item.enc.length)
                if batch and (len(batch) + 1) * longest_with > budget:
                    break
                longest = longest_with
            batch.append(item)
            taken.add(i)
            if len(batch) == self.max_batch_size:
                break
        if taken == set(range(len(taken))):  # a prefix of the queue
            for _ in range(len(taken)):
                q.popleft()
        else:
            self._queue = deque(it for i, it in enumerate(q) if i not in taken)
        return batch

    def _turns(self) -> list[int]:
        """Queue positions in turns across requests: the first sequence of each, then the second of each, ..."""
        per_group: dict[int, list[int]] = {}
        for i, item in enumerate(self._queue):
            per_group.setdefault(item.group, []).append(i)
        lists = list(per_group.values())
        out: list[int] = []
        for k in range(max(len(x) for x in lists)):
            out.extend(x[k] for x in lists if k < len(x))
            if len(out) >= self.max_batch_size * 4:  # enough candidates for one batch, with skips
                break
        return out

    def _run_each(self, encs: list[Encoded]) -> list[np.ndarray | Exception]:
        """Each sequence alone: its logits, or the exception the backend raised for it."""
        out: list[np.ndarray | Exception] = []
        for enc in encs:
            try:
                out.append(self._run_batch([enc])[0][0])
            except Exception as e:
                out.append(e)
        return out

    def _settle(self, batch: list[_Item], outcomes: list[np.ndarray | Exception], t_start: float) -> None:
        """Answer each sequence of a batch that failed as a whole with what its own run gave."""
        infer_s = time.perf_counter() - t_start
        bid = next(self._batch_ids)
        ok = sum(not isinstance(o, Exception) for o in outcomes)
        if self.metrics and ok:
            self.metrics.exec_count_l.inc(ok)
            self.metrics.count_l.inc(ok)
        for it, o in zip(batch, outcomes):
            if it.future.done():
                continue
            if isinstance(o, Exception):
                it.future.set_exception(InferenceFailed(o))
            else:
                it.future.set_result(Result(o, t_start - it.t_enqueue, infer_s, bid, 1))

    def _run_batch(self, encs: list[Encoded]) -> tuple[np.ndarray, int]:
        """Run one merged batch; returns logits in input order and the number of backend calls.

        Sequences are sorted by length and cut into sub-batches, each padded to its own longest
        member, whenever one padded batch would waste more than `max_padding_waste` of its
        tokens on padding: on a CPU a batch of mixed lengths padded to the longest can cost more
        than running the short and the long ones apart.
        """
        groups = split_by_length([e.length for e in encs], self.max_padding_waste)
        out: np.ndarray | None = None
        for idx in groups:
            ids, mask, types = pad_batch([encs[i] for i in idx], self.pad_id)
            logits = np.asarray(self._infer(ids, mask, types), dtype=np.float32)
            if logits.ndim != 2 or logits.shape[0] != len(idx):
                raise RuntimeError(f"backend returned logits of shape {logits.shape} for a batch of {len(idx)}")
            if out is None:
                out = np.empty((len(encs), logits.shape[1]), dtype=np.float32)
            out[idx] = logits
        return out, len(groups)
