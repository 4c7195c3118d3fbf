"""Batches run at once (`--instances`, Triton's instance count): the batcher runs up to that many backend calls
concurrently, each answer goes to its own caller, and the CPU backends share their threads among the instances
(ONNX Runtime: one session whose runs each get their share; OpenVINO: one stream and infer request each)."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from holoserve.core import machine
from holoserve.core.artifact import load_artifact
from holoserve.core.tokenizer import Encoded
from holoserve.server import service
from holoserve.server.batcher import BatchPolicy, DynamicBatcher
from holoserve.server.config import ServerConfig
from tests.helpers.serving import tiny_checkpoint


def _seq(tag: int) -> Encoded:
    return Encoded(input_ids=np.array([tag, 7, 8], dtype=np.int64), token_type_ids=np.zeros(3, dtype=np.int64),
                   truncated=False)


def _tag_logits(ids: np.ndarray) -> np.ndarray:
    return np.stack([ids[:, 0].astype(np.float32), np.zeros(len(ids), np.float32)], axis=1)


def _overlapping_batches(instances: int) -> tuple[int, list[float]]:
    """Two batches where the first blocks until a second call is running: the most calls seen running at once
    (the first gives up waiting after a while where only one runs at a time), and the answers."""
    running, most = [0], [0]
    lock, second = threading.Lock(), threading.Event()

    def infer(ids, mask, types):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            if running[0] > 1:
                second.set()
        try:
            if ids[0, 0] == 100:
                second.wait(1.0)
            return _tag_logits(ids)
        finally:
            with lock:
                running[0] -= 1

    async def main():
        b = DynamicBatcher(infer, BatchPolicy(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=64,
                                              instances=instances))
        b.start()
        first = asyncio.ensure_future(b.submit([_seq(100)]))
        await asyncio.sleep(0.05)
        assert b.busy
        later = await b.submit([_seq(200)])
        results = (await first) + later
        await b.stop(5)
        assert not b.busy
        return [float(r.logits[0]) for r in results]

    answers = asyncio.run(main())
    return most[0], answers


def test_two_instances_run_two_batches_at_once_and_answer_each_caller():
    assert _overlapping_batches(2) == (2, [100.0, 200.0])


def test_one_instance_runs_one_batch_at_a_time():
    assert _overlapping_batches(1) == (1, [100.0, 200.0])


def test_a_failing_batch_fails_alone_while_the_other_instance_answers():
    from holoserve.server.batcher import InferenceFailed

    def infer(ids, mask, types):
        if (ids[:, 0] == 13).any():
            raise RuntimeError("bad row")
        return _tag_logits(ids)

    async def main():
        b = DynamicBatcher(infer, BatchPolicy(max_batch_size=2, max_queue_delay_ms=0, max_queue_size=64,
                                              instances=2))
        b.start()
        got = await asyncio.gather(*(b.submit([_seq(t)]) for t in (11, 13, 15, 17)), return_exceptions=True)
        await b.stop(5)
        return got

    got = asyncio.run(main())
    assert isinstance(got[1], InferenceFailed)
    assert [float(r[0].logits[0]) for i, r in enumerate(got) if i != 1] == [11.0, 15.0, 17.0]


def _instances(cores: int | None, monkeypatch, **cfg) -> int:
    monkeypatch.setattr(service, "usable_cores", lambda: cores)
    config = ServerConfig(**cfg).validate()
    return service.instances_plan(config, service.threads_plan(config).threads)


def test_auto_runs_two_batches_where_a_worker_has_two_cores(monkeypatch):
    monkeypatch.delenv("HOLOSERVE_ORT_THREADS", raising=False)
    monkeypatch.setattr(service, "cpu_budget", lambda workers: machine.CpuBudget(None, "the runtime's default"))
    assert _instances(2, monkeypatch) == 2
    assert _instances(16, monkeypatch) == 2
    assert _instances(1, monkeypatch) == 1
    assert _instances(2, monkeypatch, workers=2) == 1  # each worker has one core
    assert _instances(2, monkeypatch, threads=1) == 1  # --threads 1: one core's worth
    assert _instances(1, monkeypatch, instances="3") == 3  # given: as given


def test_bad_instances_say_what_to_give():
    from holoserve import HoloServeError

    for bad in ("0", "two", "-1"):
        with pytest.raises(HoloServeError, match="instances .* whole number >= 1"):
            ServerConfig(instances=bad).validate()


def test_per_instance_threads_share_the_threads_out():
    assert machine.per_instance_threads(4, 2) == 2
    assert machine.per_instance_threads(1, 2) == 1
    assert machine.per_instance_threads(0, 1) == 0  # one instance: the runtime's default
    assert machine.per_instance_threads(None, 2) == max(1, machine.usable_cores() // 2)


@pytest.fixture(scope="module")
def sst2():
    return tiny_checkpoint("sst2")


def rows(seed: int, n: int = 6):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 90, size=(n, 9)).astype(np.int64)
    return ids, np.ones_like(ids), np.zeros_like(ids)


def concurrent_matches_serial(backend) -> None:
    """Batches run from two threads at once give what they give one after another."""
    batches = [rows(s) for s in range(8)]
    want = [backend.infer(*b) for b in batches]
    got: list = [None] * len(batches)

    def worker(k: int):
        for i in range(k, len(batches), 2):
            got[i] = backend.infer(*batches[i])

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_onnxruntime_gives_each_instance_its_share_of_the_threads(sst2):
    from holoserve.backends import load_backend

    art = load_artifact(sst2)
    be = load_backend("onnxruntime", art, threads=2, instances=2)
    assert be.instances == 2 and be.info()["intra_op_threads"] == 1 and be.info()["instances"] == 2
    concurrent_matches_serial(be)
    one = load_backend("onnxruntime", art, threads=2)
    assert one.instances == 1 and one.info()["intra_op_threads"] == 2


def test_a_lone_sequence_runs_on_the_loop_only_with_one_instance():
    """inline_single spares the hand-off where one instance would make a request read meanwhile wait anyway;
    with two, that request could start on the other instance, so every batch goes to a worker thread."""
    async def main(instances: int):
        loop_thread = threading.current_thread()
        on_loop: list[bool] = []

        def infer(ids, mask, types):
            on_loop.append(threading.current_thread() is loop_thread)
            return _tag_logits(ids)

        b = DynamicBatcher(infer, BatchPolicy(max_batch_size=8, max_queue_delay_ms=0, max_queue_size=64,
                                              inline_single=True, instances=instances))
        b.start()
        got = await b.submit([_seq(5)])
        await b.stop(5)
        assert float(got[0].logits[0]) == 5.0
        return on_loop, b.inline_single

    assert asyncio.run(main(1)) == ([True], True)
    assert asyncio.run(main(2)) == ([False], False)
