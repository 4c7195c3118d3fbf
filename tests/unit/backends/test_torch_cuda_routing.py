"""torch-cuda's per-bucket routing between the 2:4 and the dense INT8 GEMMs: the decision, the option
checks, and the runner's routed buckets, on the CPU (the exact reference kernel stands in for cuSPARSELt;
torch._int_mm runs on the CPU too)."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from holoserve import HoloServeError  # noqa: E402
from holoserve.backends import load_backend  # noqa: E402
from holoserve.backends.base import BackendUnavailable  # noqa: E402
from holoserve.backends import torch_cuda as tc  # noqa: E402
from holoserve.backends.torch_cuda import routing  # noqa: E402
from holoserve.core.artifact import load_artifact  # noqa: E402
from tests.helpers.tiny import calibrated_tiny_checkpoint, random_batches  # noqa: E402

S, D = routing.SPARSE, routing.DENSE


def test_dense_takes_a_bucket_only_when_faster_by_more_than_the_margin():
    assert tc.choose_kernel({S: 1.0, D: 0.80}, margin=0.05) == D
    assert tc.choose_kernel({S: 1.0, D: 0.96}, margin=0.05) == S  # inside the noise margin
    assert tc.choose_kernel({S: 1.0, D: 0.95}, margin=0.05) == S  # exactly at the margin: the 2:4 GEMMs
    assert tc.choose_kernel({S: 1.0, D: 1.0}, margin=0.0) == S  # a tie goes to sparse
    assert tc.choose_kernel({S: 1.0, D: 0.99}, margin=0.0) == D
    assert tc.choose_kernel({S: 0.5, D: 0.9}) == S


@pytest.mark.parametrize("bad", [None, math.nan, math.inf, 0.0, -1.0])
def test_an_unusable_time_keeps_the_2to4_gemms(bad):
    assert tc.choose_kernel({S: 1.0, D: bad}) == S
    assert tc.choose_kernel({S: bad, D: 0.1}) == S
    assert tc.choose_kernel({S: 1.0}) == S


def test_margin_out_of_range_is_refused():
    with pytest.raises(ValueError, match="margin"):
        tc.choose_kernel({S: 1.0, D: 0.5}, margin=1.5)


def test_timing_plan_times_each_token_count_once_up_to_the_cap():
    plan = tc.timing_plan([1, 2, 4, 8], [16, 32, 64], max_tokens=128)
    # 2x16 and 1x32 share 32 tokens; 4x16, 2x32 and 1x64 share 64: each count once, at its smallest batch
    assert plan == {16: (1, 16), 32: (1, 32), 64: (1, 64), 128: (2, 64)}
    assert list(plan) == sorted(plan)
    assert tc.timing_plan([1, 2], [16], max_tokens=0) == {}
    assert tc.timing_plan([8, 1], [64, 16], max_tokens=10**6) == {16: (1, 16), 64: (1, 64), 128: (8, 16), 512: (8, 64)}


def test_route_table_gives_equal_token_counts_the_same_kernel_and_untimed_ones_sparse():
    timings = {32: {S: 1.0, D: 0.5}, 64: {S: 1.0, D: 2.0}}
    table = tc.route_table([1, 2, 4], [16, 32], timings)
    assert table == {"1x16": S, "1x32": D, "2x16": D, "2x32": S, "4x16": S, "4x32": S}


def test_route_option_errors_say_what_to_write():
    with pytest.raises(HoloServeError, match=r"route must be one of \('auto', 'sparse', 'dense-int8'\)"):
        tc.check_route("dense", "cslt")
    with pytest.raises(HoloServeError, match="leave kernel at 'cslt' to use route, or drop route"):
        tc.check_route("dense-int8", "reference")
    tc.check_route("auto", "reference")  # auto with another kernel: nothing to route, not an error
    for bad in (-1, 1.5, "4096", True):
        with pytest.raises(HoloServeError, match="route_max_tokens must be a whole number >= 0"):
            tc.check_route("auto", "cslt", bad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    model, _, _, art = calibrated_tiny_checkpoint(tmp_path_factory.mktemp("route"), hidden=32, intermediate=64,
                                                  max_seq_length=32)
    return art, model.config.vocab_size


def test_bad_route_is_refused_before_the_device_check(tiny):
    art, _ = tiny
    with pytest.raises(HoloServeError, match="route must be one of"):
        load_backend("torch-cuda", load_artifact(art.path), route="fastest")
    with pytest.raises(HoloServeError, match="leave kernel at 'cslt'"):
        load_backend("torch-cuda", load_artifact(art.path), route="sparse", kernel="reference")
    opts = tc.TorchCudaOptions.from_options({"route": "dense-int8", "route_max_tokens": 512, "threads": 2})
    assert (opts.route, opts.route_max_tokens) == ("dense-int8", 512)
    # not set: the kernel given serves every bucket (auto is opt-in until its GPU test has passed on a GPU), and
    # a kernel other than cslt is not refused for it
    assert tc.TorchCudaOptions().route is None
    with pytest.raises(BackendUnavailable, match="needs an NVIDIA GPU"):
        load_backend("torch-cuda", load_artifact(art.path), kernel="reference")


def _variants(art):
    """The reference-kernel encoder (standing in for the 2:4 one) and the dense INT8 one of the same
    checkpoint, FP32, sharing their float tensors as the backend builds them."""
    sparse, dense = tc.build_variants(art, linear=tc.LinearOptions(kernel="reference", dtype=torch.float32))
    assert dense is not None
    return sparse, dense


def test_dense_int8_variant_shares_float_params_and_gives_the_exact_integer_result(tiny):
    """Both variants multiply the same INT8 codes exactly and dequantize in FP32 with the same ops, so
    their logits are bit-identical; embeddings, LayerNorm, pooler and classifier are held once."""
    art, vocab = tiny
    sparse, dense = _variants(art)
    assert sum(isinstance(m, tc.QuantLinear) and m.kernel == "int_mm" for m in dense.modules()) == 2 * 4
    assert dense.word_emb is sparse.word_emb and dense.pos_emb is sparse.pos_emb and dense.type_emb is sparse.type_emb
    assert dense.lns is sparse.lns and dense.classifier is sparse.classifier and dense.emb_ln is sparse.emb_ln
    for batch in random_batches(vocab, n=3, b=5, s=20, seed=11):
        with torch.inference_mode():
            a, b = sparse(**batch), dense(**batch)
        assert torch.equal(a, b), (a - b).abs().max()


def test_share_float_params_refuses_another_shape(tiny, tmp_path):
    art, _ = tiny
    sparse, _ = _variants(art)
    _, _, _, other = calibrated_tiny_checkpoint(tmp_path, hidden=64, intermediate=128, max_seq_length=32)
    wide, none = tc.build_variants(other, linear=tc.LinearOptions(kernel="int_mm", dtype=torch.float32))
    assert none is None  # every quantized layer already runs dense INT8: nothing to route to
    with pytest.raises(ValueError, match="same shape and dtype"):
        tc.share_float_params(wide, sparse)
    assert tc.build_variants(art, linear=tc.LinearOptions(kernel="reference", dtype=torch.float32),
                             dense=False)[1] is None


def _calls(model):
    seen = []
    model.register_forward_hook(lambda *_: seen.append(1))
    return seen


def test_runner_serves_each_bucket_on_its_routed_variant_and_frees_unused_ones(tiny):
    art, vocab = tiny
    sparse, dense = _variants(art)
    runner = tc.GraphRunner(sparse, device="cpu", batch_buckets=[1, 4], seq_buckets=[16, 32], graphs=False,
                            variants={D: dense})
    names = {S: "", D: D}
    plan = tc.timing_plan(runner.batch_buckets, runner.seq_buckets, 64)
    assert plan == {16: (1, 16), 32: (1, 32), 64: (4, 16)}

    def timer(fn, iters):  # the calls really run; the times are whatever the test says
        for _ in range(iters):
            fn()
        return [1.0] * iters

    timings = tc.measure_routes(runner, plan, names, timer, tc.RouteTiming(warmup=1, iters=2, rounds=2))
    assert timings == {16: {S: 1.0, D: 1.0}, 32: {S: 1.0, D: 1.0}, 64: {S: 1.0, D: 1.0}}
    table = tc.route_table(runner.batch_buckets, runner.seq_buckets, {32: {S: 1.0, D: 0.5}})
    assert table == {"1x16": S, "1x32": D, "4x16": S, "4x32": S}
    assert routing.apply_routes(runner, table, names) == []
    assert runner.routes == {(1, 32): D}
    on_sparse, on_dense = _calls(sparse), _calls(dense)
    batch = random_batches(vocab, n=1, b=2, s=20, seed=2)[0]
    feed = [batch[k][:1] for k in ("input_ids", "attention_mask", "token_type_ids")]  # 1 x 20: bucket 1x32
    got = runner.run_bucket(*feed)
    assert (len(on_sparse), len(on_dense)) == (0, 1)
    with torch.inference_mode():  # the padded bucket's logits are the unpadded batch's
        assert torch.allclose(got, sparse(*feed), atol=1e-5, rtol=1e-5)
    runner.run_bucket(*(x[:, :10] for x in feed))  # bucket 1x16: the 2:4 stand-in
    assert (len(on_sparse), len(on_dense)) == (2, 1)
    # a table without dense buckets frees the dense variant
    assert routing.apply_routes(runner, {k: S for k in table}, names) == [D]
    assert runner.variants == {} and runner.routes == {}


def test_a_variant_that_fails_gets_no_time_and_so_no_bucket(tiny):
    art, _ = tiny
    sparse, dense = _variants(art)
    runner = tc.GraphRunner(sparse, device="cpu", batch_buckets=[1], seq_buckets=[16], graphs=False,
                            variants={D: dense})

    def broken(*a, **k):
        raise RuntimeError("no kernel for this shape")

    dense.forward = broken
    timings = tc.measure_routes(runner, {16: (1, 16)}, {S: "", D: D}, lambda fn, n: [fn() is not None and 1.0] * n,
                                tc.RouteTiming(warmup=1, iters=1, rounds=1))
    assert timings == {16: {S: 1.0, D: None}}
    assert tc.route_table([1], [16], timings) == {"1x16": S}


def test_backend_routing_step_reports_the_table_it_serves(tiny, monkeypatch):
    """load()'s routing step on the CPU, with a timer under which the dense INT8 GEMMs are the faster: the timed
    token counts go dense, the ones above route_max_tokens stay 2:4, and info() gets the table with both times."""
    from holoserve.backends.torch_cuda import backend as tcb

    art, _ = tiny
    sparse, dense = _variants(art)
    last = []
    sparse.register_forward_hook(lambda *_: last.append(S))
    dense.register_forward_hook(lambda *_: last.append(D))

    def timer(fn, iters):
        fn()
        return [{S: 1.0, D: 0.5}[last[-1]]] * iters

    monkeypatch.setattr(tcb, "cuda_event_timer", lambda device: timer)
    runner = tc.GraphRunner(sparse, device="cpu", batch_buckets=[1, 2, 4], seq_buckets=[16, 32], graphs=False,
                            variants={D: dense})
    info = tcb._route(runner, tc.TorchCudaOptions(route_max_tokens=32), "cslt", dense)
    assert info["routes"] == {"1x16": D, "1x32": D, "2x16": D, "2x32": S, "4x16": S, "4x32": S}
    assert info["route_ms"] == {"1x16": {"tokens": 16, S: 1.0, D: 0.5}, "1x32": {"tokens": 32, S: 1.0, D: 0.5}}
    assert "up to 32" in info["route_note"] and runner.routes == {(1, 16): D, (1, 32): D, (2, 16): D}
    forced = tcb._route(runner, tc.TorchCudaOptions(route="dense-int8"), "int_mm", None)
    assert set(forced["routes"].values()) == {"int_mm"} and "as requested" in forced["route_note"]
    off = tcb._route(runner, tc.TorchCudaOptions(route="auto", route_max_tokens=0), "cslt", None)
    assert off["route_note"] == "off: route_max_tokens=0 times nothing" and set(off["routes"].values()) == {S}
