"""`holoserve tune` and the serving profile: what it writes, when `serve --backend auto` follows it without
timing, when it is ignored (another machine's key, a damaged file) and the margin rule behind the decision."""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from holoserve import HoloServeError
from holoserve.backends import profile
from holoserve.backends.auto import RoutedCpuBackend, select_backend
from holoserve.core.artifact import add_files, load_artifact
from holoserve.core.tokenizer import Encoded
from holoserve.core.machine import cpu_flags

pytest.importorskip("openvino")

os.environ.setdefault("OMP_NUM_THREADS", "1")
QUICK = dict(duration=0.0, min_rounds=2, threads=1)


# --------------------------------------------------------------------------- the decision rule (no models)


def test_the_kernels_stay_only_where_they_are_faster_by_the_margin():
    from holoserve.tune import GEMMS, KERNELS, kernels_verdict

    sizes = [1, 8, 32]
    own = {1: 2.0, 8: 10.0, 32: 40.0}

    def verdict(*factors):
        return kernels_verdict({KERNELS: {b: own[b] * f for b, f in zip(sizes, factors)}, GEMMS: own}, sizes)

    kept = verdict(0.85, 0.9, 0.88)
    assert kept["kept"] is True and kept["ratio"] == round((0.85 * 0.9 * 0.88) ** (1 / 3), 4), kept
    assert "OpenVINO runs on them" in kept["reason"] and kept["median_ms"]["off"] == {"1": 2.0, "8": 10.0, "32": 40.0}
    tie = verdict(0.97, 0.96, 0.98)  # faster, but within the margin: the simpler path stays
    assert tie["kept"] is False and "OpenVINO keeps its own GEMMs" in tie["reason"], tie
    assert verdict(1.2, 1.0, 1.03)["kept"] is False
    # each batch size counts alike: a large win at one row does not outvote losses at the others
    assert verdict(0.5, 1.2, 1.2)["kept"] is True and verdict(0.7, 1.2, 1.2)["kept"] is False


def _times(ort, ov, sizes=(1, 2, 4, 8, 16, 32)):
    return {"onnxruntime": dict(zip(sizes, ort)), "openvino": dict(zip(sizes, ov))}


TOKENS = {1: 30.0, 2: 64.0, 4: 128.0, 8: 256.0, 16: 512.0, 32: 1024.0}


def test_margin_keeps_onnxruntime_on_a_tie_and_within_the_margin():
    same = [1.0, 1.5, 2.5, 4.0, 8.0, 16.0]
    assert profile.decide(_times(same, same), TOKENS)["backend"] == "onnxruntime"
    close = [t * 0.96 for t in same]  # 4 % faster: within the margin
    d = profile.decide(_times(same, close), TOKENS)
    assert d["backend"] == "onnxruntime" and "less than the 5% margin" in d["reason"]
    clear = [t * 0.90 for t in same]
    d = profile.decide(_times(same, clear), TOKENS)
    assert d["backend"] == "openvino" and "faster by more than the 5% margin" in d["reason"]
    # the same timings always give the same decision
    assert profile.decide(_times(same, clear), TOKENS) == d


def test_routes_by_batch_size_only_where_the_mix_gains_the_margin():
    ort = [1.0, 1.5, 2.5, 4.0, 8.0, 16.0]
    # openvino much slower alone, much faster at full batches: routed at the cut between 8 and 16 rows
    ov = [3.0, 3.0, 3.0, 4.4, 4.0, 6.0]
    d = profile.decide(_times(ort, ov), TOKENS)
    assert (d["backend"], d["small"], d["large"]) == ("routed", "onnxruntime", "openvino")
    assert d["max_small_tokens"] == int((256 * 512) ** 0.5)
    assert profile.needed(d) == ["onnxruntime", "openvino"]
    assert profile.describe(d) == f"onnxruntime for batches of up to {d['max_small_tokens']} tokens and openvino above"
    # openvino a little faster at 32 rows only: the mix gains under the margin, one backend serves
    ov = [3.0, 3.0, 3.0, 5.0, 9.0, 15.0]
    assert profile.decide(_times(ort, ov), TOKENS)["backend"] == "onnxruntime"


LIGHT_SLOW_OV = {"onnxruntime": 2.0, "openvino": 2.4}  # one-row batches after the pause: OpenVINO 20 % slower


def test_one_row_batches_go_where_they_run_faster_back_to_back_and_tie_after_the_pause():
    """One client in a closed loop runs one-row batches back to back: a backend slower there by the margin, and
    not faster after the pause, gives them to the other (the light-load route)."""
    ort = [1.0, 1.5, 2.5, 4.0, 8.0, 16.0]
    ov = [1.08, 1.2, 2.0, 3.2, 6.4, 12.8]  # 8 % slower at one row back to back, 20 % faster from 2 rows
    d = profile.decide(_times(ort, ov), TOKENS, light={"onnxruntime": 5.0, "openvino": 5.05})
    assert (d["backend"], d["small"], d["large"], d["max_small_rows"]) == ("routed", "onnxruntime", "openvino", 1)
    assert "0.99x the time on onnxruntime after a pause (light load) and 0.93x back to back" in d["reason"]
    # faster after the pause by the margin: no one-way loss to act on
    assert profile.decide(_times(ort, ov), TOKENS, light={"onnxruntime": 5.0, "openvino": 4.5})["backend"] == "openvino"
    # within the margin both ways: kept on the single backend
    assert profile.decide(_times(ort, [1.04, *ov[1:]]), TOKENS,
                          light={"onnxruntime": 5.0, "openvino": 5.05})["backend"] == "openvino"


def test_one_row_batches_go_where_light_load_runs_them_faster_by_the_margin():
    """The light-load route: one-row batches on the other backend where, after a pause, it is faster at them
    by the margin and, back to back, not slower by it; larger ones on the backend the geometric mean chose."""
    ort = [1.0, 1.5, 2.5, 4.0, 8.0, 16.0]
    ov = [1.0, 1.2, 2.0, 3.2, 6.4, 12.8]  # 20 % faster from 2 rows, a tie at one row back to back
    d = profile.decide(_times(ort, ov), TOKENS, light=LIGHT_SLOW_OV)
    assert (d["backend"], d["small"], d["large"], d["max_small_rows"]) == ("routed", "onnxruntime", "openvino", 1)
    assert "max_small_tokens" not in d and "(the light-load route)" in d["reason"]
    assert ("one-row batches take 0.83x the time on onnxruntime after a pause (light load) and 1.00x back "
            "to back") in d["reason"]
    assert profile.describe(d) == "onnxruntime for one-row batches (light load) and openvino above"
    assert profile.needed(d) == ["onnxruntime", "openvino"]
    # OpenVINO faster by the margin at one row back to back (one client in a closed loop): it keeps them
    assert profile.decide(_times(ort, [0.9, *ov[1:]]), TOKENS, light=LIGHT_SLOW_OV)["backend"] == "openvino"
    # within the margin after the pause: the single backend serves them too
    assert profile.decide(_times(ort, ov), TOKENS, light={"onnxruntime": 2.0, "openvino": 2.06})[
        "backend"] == "openvino"
    # the other way round: ONNX Runtime chosen, OpenVINO faster by the margin after the pause only
    d = profile.decide(_times(ort, [1.0, 1.6, 2.6, 4.2, 8.4, 16.8]), TOKENS,
                       light={"onnxruntime": 2.4, "openvino": 2.0})
    assert (d["backend"], d["small"], d["large"], d["max_small_rows"]) == ("routed", "openvino", "onnxruntime", 1)
    # with route=False (what confirm_routing compares against), or no light-load timings: no light-load route
    assert profile.decide(_times(ort, ov), TOKENS, route=False, light=LIGHT_SLOW_OV)["backend"] == "openvino"
    assert profile.decide(_times(ort, ov), TOKENS)["backend"] == "openvino"


def test_a_token_route_never_gives_one_row_batches_to_a_backend_slow_at_them():
    ort = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    # openvino much faster at 2 and 4 rows, slower from 8: routed, openvino taking the small batches
    ov = [1.0, 1.2, 2.4, 10.4, 20.8, 41.6]
    d = profile.decide(_times(ort, ov), TOKENS)
    assert (d["backend"], d["small"], d["large"]) == ("routed", "openvino", "onnxruntime")
    # the same, but openvino slower at one row by the margin after the pause and not faster back to back
    assert profile.decide(_times(ort, ov), TOKENS, light=LIGHT_SLOW_OV)["backend"] == "onnxruntime"


class _Clock:
    """A fake perf_counter that advances only when a fake backend runs."""

    def __init__(self):
        self.now, self.last = 0.0, None

    def __call__(self) -> float:
        return self.now


class _Fake:
    """A backend whose batch takes `per_row[rows]` fake ms, plus `switch` ms when the other backend ran last
    (what two runtimes' spinning pool threads cost each other)."""

    def __init__(self, name, per_row, clock, switch):
        self.name, self.per_row, self.clock, self.switch = name, per_row, clock, switch

    def infer(self, ids, mask, segments):
        ms = self.per_row[ids.shape[0]] + (self.switch if self.clock.last not in (None, self.name) else 0.0)
        self.clock.now += ms / 1000
        self.clock.last = self.name
        return np.zeros((ids.shape[0], 2), np.float32)

    def info(self):
        return {"backend": self.name}


@pytest.mark.parametrize("switch,kept", [(0.0, True), (12.0, False)])
def test_a_routed_pair_is_kept_only_where_it_wins_as_it_serves(monkeypatch, switch, kept):
    """confirm_routing runs the routed pair and the single backend as they serve, taking turns: a pair that
    wins on each backend's own timings but loses its gain to switching between runtimes is not kept."""

    ort_ms = [1.0, 1.5, 2.5, 4.0, 8.0, 16.0]
    ov_ms = [3.0, 3.0, 3.0, 4.4, 4.0, 6.0]
    medians = _times(ort_ms, ov_ms)
    decision = profile.decide(medians, TOKENS)
    assert decision["backend"] == "routed"
    clock = _Clock()
    monkeypatch.setattr(profile.time, "perf_counter", clock)
    fakes = {n: _Fake(n, medians[n], clock, switch) for n in ("onnxruntime", "openvino")}
    ids = np.arange(32, dtype=np.int64)  # 32 tokens a row, as TOKENS counts them: 8 rows go to ONNX Runtime
    items = [Encoded(input_ids=ids, token_type_ids=np.zeros_like(ids), truncated=False) for _ in range(40)]
    got = profile.confirm_routing(fakes, decision, medians, items, [1, 2, 4, 8, 16, 32], rounds=3)
    if kept:
        assert got["backend"] == "routed" and got["reason"].endswith(": kept"), got
    else:
        assert got["backend"] == "onnxruntime" and "routing by tokens was not kept" in got["reason"], got
        assert "not faster by the 5% margin" in got["reason"]
    # a decision that is not routed is left as it is, with nothing timed
    single = profile.decide(_times(ort_ms, ort_ms), TOKENS)
    assert profile.confirm_routing({}, single, medians, items, [1]) == single


class _Cold(_Fake):
    """A fake backend that runs `cold` ms slower after an idle pause (time.sleep), as runtimes do."""

    def __init__(self, name, per_row, clock, switch, cold):
        super().__init__(name, per_row, clock, switch)
        self.cold, self.idle = cold, False

    def infer(self, ids, mask, segments):
        if self.idle:
            self.clock.now += self.cold / 1000
            self.idle = False
        return super().infer(ids, mask, segments)


def _cold_fakes(monkeypatch, per_row, switch=0.0, cold=None):
    clock = _Clock()
    monkeypatch.setattr(profile.time, "perf_counter", clock)
    fakes = {n: _Cold(n, per_row[n], clock, switch, (cold or {}).get(n, 0.0)) for n in per_row}
    pauses = []

    def sleep(seconds):  # the pause: every backend's threads go idle
        pauses.append(seconds)
        clock.now += seconds
        for f in fakes.values():
            f.idle = True

    monkeypatch.setattr(profile.time, "sleep", sleep)
    return fakes, pauses


def test_one_row_batches_are_timed_after_a_pause(monkeypatch):
    """time_backends also runs one-row batches each after LIGHT_PAUSE_S idle, so what each runtime pays to
    start cold counts there (Timings.light), and only there; the pause itself is not timed."""
    sizes = [1, 2, 4]
    per_row = {"onnxruntime": {1: 1.0, 2: 2.0, 4: 4.0}, "openvino": {1: 1.0, 2: 1.5, 4: 3.0}}
    fakes, pauses = _cold_fakes(monkeypatch, per_row, cold={"openvino": 0.5})
    items = _texts_of([16] * 40)
    plan = profile.Plan(min_rounds=2, max_rounds=2, seconds=0.0, per_round=4, light_per_round=3)
    timings = profile.time_backends(fakes, items, sizes, plan)
    med = timings.medians()
    assert med["openvino"] == pytest.approx({1: 1.0, 2: 1.5, 4: 3.0})
    assert med["onnxruntime"] == pytest.approx({1: 1.0, 2: 2.0, 4: 4.0})
    assert timings.light_medians() == pytest.approx({"openvino": 1.5, "onnxruntime": 1.0})
    # three one-row batches per backend per round, each after the pause; rounds 0 (untimed) to 2
    assert pauses == [profile.LIGHT_PAUSE_S] * (3 * 2 * 3)
    d = profile.decide(med, timings.tokens, light=timings.light_medians())
    assert (d["backend"], d["small"], d["large"], d["max_small_rows"]) == ("routed", "onnxruntime", "openvino", 1)
    # the profile records the pause these timings ran with
    pauses.clear()
    plan = profile.Plan(min_rounds=1, max_rounds=1, seconds=0.0, per_round=4, light_per_round=1, pause_s=0.005)
    timings = profile.time_backends(fakes, items, sizes, plan)
    assert pauses == [0.005] * (1 * 2 * 2)
    assert profile.new_profile({}, d, timings, {})["timings"]["light_load"]["pause_ms"] == 5.0


@pytest.mark.parametrize("switch,kept", [(0.0, True), (2.0, False)])
def test_the_light_load_route_is_kept_unless_larger_batches_pay_for_it(monkeypatch, switch, kept):
    """confirm_routing runs the light-load route as it serves: kept unless switching runtimes makes the larger
    batches, which the single backend runs either way, slower by the margin. Its one-row batches are not
    timed there (taking turns would run them cold for both)."""
    sizes = [1, 2, 4, 8, 16, 32]
    per_row = _times([1.0, 2.0, 4.0, 8.0, 16.0, 32.0], [1.0, 1.5, 3.0, 6.0, 12.0, 24.0])
    decision = profile.decide(per_row, TOKENS, light=LIGHT_SLOW_OV)
    assert decision.get("max_small_rows") == 1
    fakes, pauses = _cold_fakes(monkeypatch, per_row, switch)
    got = profile.confirm_routing(fakes, decision, per_row, _texts_of([16] * 40), sizes, rounds=3)
    if kept:
        assert got["backend"] == "routed" and got["reason"].endswith("at batch sizes 2 to 32: kept"), got
    else:
        assert got["backend"] == "openvino" and "the light-load route was not kept" in got["reason"], got
        assert "slower by more than the 5% margin" in got["reason"]
    assert not pauses  # nothing of one row was timed


def test_a_token_route_not_kept_falls_back_to_the_light_load_route(monkeypatch):
    """Where the route by tokens loses its gain as served (switching runtimes costs it), the single backend
    serves, and one-row batches still go where light load runs them faster."""
    ort = [1.0, 1.1, 4.0, 8.0, 16.0, 32.0]
    ov = [1.3, 1.2, 2.4, 4.8, 9.6, 19.2]
    medians = _times(ort, ov)
    light = {"onnxruntime": 1.0, "openvino": 1.3}
    decision = profile.decide(medians, TOKENS, light=light)
    assert (decision["backend"], decision["small"], decision.get("max_small_tokens")) == (
        "routed", "onnxruntime", int((64 * 128) ** 0.5))
    clock = _Clock()
    monkeypatch.setattr(profile.time, "perf_counter", clock)
    monkeypatch.setattr(profile.time, "sleep", lambda s: None)
    # OpenVINO's batch after an ONNX Runtime one pays 0.3 ms: the route by tokens pays it at 4 rows, which
    # takes its gain under the margin; the light-load route pays it at 2 rows, 25 % of a batch there, under
    # the margin over the five batch sizes it leaves to OpenVINO
    fakes = {"onnxruntime": _Fake("onnxruntime", medians["onnxruntime"], clock, 0.0),
             "openvino": _Fake("openvino", medians["openvino"], clock, 0.3)}
    got = profile.confirm_routing(fakes, decision, medians, _texts_of([32] * 40), list(profile.BATCH_SIZES),
                                  rounds=3, light=light)
    assert (got["backend"], got["small"], got.get("max_small_rows")) == ("routed", "onnxruntime", 1), got
    assert "routing by tokens was not kept" in got["reason"] and got["reason"].endswith(": kept")


def test_a_routed_pair_by_rows():
    """RoutedCpuBackend routes by rows (the light-load route) or by tokens, from a decision's dict."""
    class _Named:
        def __init__(self, name):
            self.name, self.rows = name, []

        def infer(self, ids, mask, segments):
            self.rows.append(ids.shape[0])
            return np.zeros((ids.shape[0], 2), np.float32)

        def info(self):
            return {"backend": self.name}

    loaded = {"onnxruntime": _Named("onnxruntime"), "openvino": _Named("openvino")}
    route = {"small": "onnxruntime", "large": "openvino", "max_small_rows": 1}
    pair = RoutedCpuBackend.from_route(loaded, route)
    for rows, seq in ((1, 128), (2, 8), (1, 4), (16, 64)):
        ids = np.ones((rows, seq), np.int64)
        pair.infer(ids, ids, ids)
    assert loaded["onnxruntime"].rows == [1, 1] and loaded["openvino"].rows == [2, 16]
    assert pair.route() == route and pair.info()["routing"]["runs"] == {"onnxruntime": 2, "openvino": 2}
    by_tokens = RoutedCpuBackend.from_route(loaded, {"small": "onnxruntime", "large": "openvino",
                                                     "max_small_tokens": 100})
    assert by_tokens.route()["max_small_tokens"] == 100 and by_tokens.max_small_rows is None
    with pytest.raises(HoloServeError, match="either a token limit or a row limit"):
        RoutedCpuBackend(loaded["onnxruntime"], loaded["openvino"], max_small_tokens=10, max_small_rows=1)


def test_tune_compiles_no_one_row_shapes_that_the_light_load_route_keeps_from_openvino():
    from holoserve.tune import decide, served_shapes

    def per_size(ms):
        return {b: [t] for b, t in zip(profile.BATCH_SIZES, ms)}

    timings = profile.Timings(list(profile.BATCH_SIZES), {
        "onnxruntime": per_size([1.0, 2.0, 4.0, 8.0, 16.0, 32.0]),
        "openvino": per_size([1.5, 1.8, 3.6, 7.2, 14.4, 28.8]),
        profile.STATIC: per_size([1.15, 1.5, 3.0, 6.0, 12.0, 24.0])}, tokens=TOKENS,
        light={"onnxruntime": [1.0], "openvino": [1.5], profile.STATIC: [1.15]})
    grid = {1: [(1, 16)], 2: [(1, 16), (2, 16)], 4: [(2, 16), (4, 16)], 8: [(8, 16)], 16: [(16, 16)],
            32: [(32, 16)]}
    decision, _, shapes, light = decide(timings, grid)
    assert light == {"onnxruntime": 1.0, "openvino": 1.15}  # one-row batches run on OpenVINO's static shapes
    assert decision.get("max_small_rows") == 1 and decision["small"] == "onnxruntime"
    assert decision["openvino_shapes"] == ["2x16", "4x16", "8x16", "16x16", "32x16"]
    assert shapes == [(1, 16), (2, 16), (4, 16), (8, 16), (16, 16), (32, 16)]  # all kept: the pair may change
    assert served_shapes({"backend": "openvino"}, shapes) == ["1x16", *decision["openvino_shapes"]]
    assert served_shapes({"backend": "onnxruntime"}, shapes) == []


def test_static_shapes_are_kept_only_where_they_win_by_the_margin():
    dynamic = {1: 1.0, 8: 4.0, 32: 10.0}
    static = {1: 0.9, 8: 3.9, 32: 9.0}  # 10 % faster at 1 and 32 rows, 2.5 % at 8
    grid = {1: [(1, 16), (1, 32)], 8: [(4, 32), (8, 32)], 32: [(8, 48), (16, 48)]}
    kept, times = profile.keep_static(dynamic, static, grid)
    assert kept == [(1, 16), (1, 32), (8, 48), (16, 48)] and times == {1: 0.9, 8: 4.0, 32: 9.0}


def _texts_of(lengths):
    return [Encoded(input_ids=np.arange(n, dtype=np.int64), token_type_ids=np.zeros(n, dtype=np.int64),
                    truncated=False) for n in lengths]


def test_batches_are_timed_and_their_shapes_chosen_as_the_batcher_runs_them():
    """Tune runs each batch as the server's batcher does: cut into length groups (each padded to its own longest
    row) wherever one padded batch would waste more than the batcher's share; the static grid offers the shapes
    those groups run at most often."""
    from holoserve.core.tokenizer import GROUP_WASTE
    from holoserve.server.batcher import BatchPolicy
    from holoserve.server.config import ServerConfig

    items = _texts_of([8, 40, 9, 38])
    (groups,) = profile.round_batches(items, 4, 0, per_round=4)
    assert [g[0].shape for g in groups] == [(2, 9), (2, 40)]
    assert [[int(x) for x in g[1].sum(axis=1)] for g in groups] == [[8, 9], [38, 40]]  # masks: real tokens, sorted
    (whole,) = profile.round_batches(items, 4, 0, per_round=4, waste=-1.0)
    assert [g[0].shape for g in whole] == [(4, 40)]
    # the share tune cuts at is the batcher's, as a CPU server resolves it
    assert BatchPolicy(1, 0.0, 1).max_padding_waste == GROUP_WASTE == ServerConfig().padding_waste_for(object())
    grid = profile.static_grid(_texts_of([8, 40, 9, 38] * 8), [1, 4], max_seq=64)
    assert grid == {1: [(1, 16), (1, 48)], 4: [(2, 16), (2, 48)]}
    assert profile.grid_shapes(grid) == [(1, 16), (1, 48), (2, 16), (2, 48)]
    assert profile.grid_shapes(grid, {4}) == [(2, 16), (2, 48)]


def test_batch_sizes_follow_the_servers_largest_batch():
    assert profile.batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert profile.batch_sizes(12) == [1, 2, 4, 8, 12]
    assert profile.batch_sizes(1) == [1]
    assert profile.batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


# --------------------------------------------------------------------------- a checkpoint exported for both


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    from tests.unit.docker.test_docker_image import both_cpu_exports

    return both_cpu_exports(tmp_path_factory.mktemp("profile"))


@pytest.fixture(scope="module")
def tuned(both):
    """The checkpoint after a short `holoserve tune` (its profile and the path)."""
    from holoserve.tune import TuneOptions, tune

    prof, path = tune(both, TuneOptions(**QUICK), out=open(os.devnull, "w"))
    return prof, path


@pytest.fixture
def no_timing(monkeypatch):
    """Timing at start-up fails the test: a server following a profile must not time."""
    def refuse(*a, **k):
        raise AssertionError("the CPU backends were timed at start-up")

    monkeypatch.setattr(profile, "time_backends", refuse)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def _write(path, prof):
    path.write_text(json.dumps(prof), encoding="utf-8")


def test_tune_writes_the_profile_with_its_key_timings_and_texts(both, tuned):
    prof, path = tuned
    assert path == both / profile.PROFILE_FILE and json.loads(path.read_text()) == prof
    assert [p.name for p in both.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    assert prof["format"] == profile.FORMAT and prof["version"] == profile.VERSION and prof["created"]
    d = prof["decision"]
    assert d["backend"] in ("onnxruntime", "openvino", "routed") and d["reason"]
    assert d["openvino_kernels"] in ("on", "off") and isinstance(d["openvino_shapes"], list)
    key = prof["key"]
    assert set(key) == {"cpu_model", "cpu_flags", "cpus", "threads", "instances", "onnxruntime", "openvino",
                        "openvino_options", "kernels_build", "amx_withheld", "exports"}
    manifest = json.loads((both / "manifest.json").read_text())
    assert key["exports"] == {k: {"file": manifest["exports"][k]["file"],
                                  "sha256": manifest["files"][manifest["exports"][k]["file"]]["sha256"]}
                              for k in ("onnxruntime", "openvino")}
    assert key["threads"] == 1 and key["instances"] == 1  # one thread: one batch at a time
    # the kernels' build is keyed only where they serve: kernels on, and OpenVINO among the backends decided on
    # (a CPU with the kernels on whose timings keep ONNX Runtime records them "on" but serves none)
    serves_kernels = d["openvino_kernels"] == "on" and "openvino" in profile.needed(d)
    assert key["kernels_build"] == (profile.kernels_build() if serves_kernels else None)
    assert key["amx_withheld"] is None  # nothing caps or refuses AMX in the tests' own process
    t = prof["timings"]
    assert t["rounds"] >= 2 and t["batch_sizes"] == [1, 2, 4, 8, 16, 32] and t["margin"] == profile.MARGIN
    assert set(t["median_ms"]) == {"onnxruntime", "openvino", profile.STATIC}
    assert all(set(by) == {str(b) for b in t["batch_sizes"]} for by in t["median_ms"].values())
    assert t["static_grid"] and all(int(s.split("x")[1]) % 16 == 0 or int(s.split("x")[1]) == 32
                                    for s in t["static_grid"])
    assert prof["texts"]["rows"] == 872 and "SST-2 dev" in prof["texts"]["source"]
    assert prof["settings"]["max_batch_size"] == 32


def test_tune_times_each_workers_share_of_a_cpu_limit(both, tmp_path, monkeypatch):
    """`tune --workers N` with no --threads: the backends are timed with the threads each of N workers gets
    under this process's CPU limit, and the key says so, as `serve --workers N` will compute it."""
    import shutil

    from holoserve.core.machine import CpuBudget
    from holoserve.server import service
    from holoserve.tune import TuneOptions, tune

    seen = []

    def budget(workers):
        seen.append(workers)
        return CpuBudget(4 // workers, f"{4 // workers} threads: a CPU quota of 4 CPUs (cgroup), 8 physical cores")

    monkeypatch.delenv("HOLOSERVE_ORT_THREADS", raising=False)
    monkeypatch.setattr(service, "cpu_budget", budget)
    ckpt = shutil.copytree(both, tmp_path / "ckpt")
    prof, _ = tune(ckpt, TuneOptions(**{**QUICK, "threads": 0, "workers": 2}), out=open(os.devnull, "w"))
    assert seen and set(seen) == {2} and prof["key"]["threads"] == 2


def test_profile_is_not_part_of_the_manifest_and_survives_export_checks(both, tuned):
    art = load_artifact(both, verify=True)  # an unlisted file breaks no checksum check
    assert profile.PROFILE_FILE not in art.manifest.files


def test_write_is_atomic_and_a_failed_write_keeps_the_old_profile(both, tuned, monkeypatch):
    import holoserve.core.files as files

    prof, path = tuned
    before = path.read_bytes()

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(HoloServeError, match="cannot write .*serving-profile.json .*No space left on device"):
        profile.write_profile(load_artifact(both, verify=False), {**prof, "created": "later"})
    assert path.read_bytes() == before and [p.name for p in both.iterdir() if p.name.startswith(".")] == []


def test_serve_follows_a_matching_profile_without_timing(both, tuned, no_timing):
    from holoserve.server.config import ServerConfig
    from holoserve.server.service import open_backend

    prof, _ = tuned
    cfg = ServerConfig(artifact_dir=str(both), threads=1)
    art = load_artifact(both)
    first, d1 = open_backend(cfg, art)
    again, d2 = open_backend(cfg, art)
    assert d1 == d2 and first.name == again.name  # the same profile, the same decision every start
    assert d1["serving_profile"] == "used"
    assert "from the serving profile written by `holoserve tune` on " + prof["created"] in d1["reason"]
    assert d1["picked"] == {"routed": "+".join(profile.needed(prof["decision"]))}.get(
        prof["decision"]["backend"], prof["decision"]["backend"])


def test_a_profile_that_serves_onnxruntime_loads_no_openvino(both, tuned, tmp_path):
    """A server that follows a profile deciding ONNX Runtime neither imports OpenVINO (its runtime and plugin
    cost a server's memory) nor runs OpenVINO's INT8 probe; checked in a fresh process."""
    import shutil
    import subprocess
    import sys

    prof, _ = tuned
    ckpt = tmp_path / "ckpt"
    shutil.copytree(both, ckpt)
    ort = {**_with_decision(prof, backend="onnxruntime", openvino_shapes=[]),
           "key": {**prof["key"], "kernels_build": None}}  # as tune keys a decision without OpenVINO
    _write(profile.profile_path(ckpt), ort)
    code = ("import sys\nfrom holoserve.backends.auto import fastest_cpu\n"
            "from holoserve.core.artifact import load_artifact\n"
            f"b, why = fastest_cpu(load_artifact({str(ckpt)!r}), False, {{'threads': 1}}, {{}})\n"
            "print(b.name, 'openvino' in sys.modules)\nprint(why)")
    env = {k: v for k, v in os.environ.items() if k != "HOLOSERVE_INT8_PROBE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.splitlines()[0] == "onnxruntime False", out
    assert "from the serving profile" in out, out


def _with_decision(prof, **decision):
    kept = {k: v for k, v in prof["decision"].items() if k not in ("max_small_tokens", "max_small_rows")}
    return {**prof, "decision": {**kept, **decision}}


def test_profile_static_shapes_and_routing_are_served_and_reported(both, tuned, no_timing):
    """A profile choosing OpenVINO with static shapes, or a routed pair: /v1/models shows the shapes."""
    from holoserve.server.config import ServerConfig
    from holoserve.server.service import ClassifierService

    prof, path = tuned
    original = path.read_text()
    art = load_artifact(both)
    cfg = ServerConfig(artifact_dir=str(both), threads=1)
    try:
        _write(path, _with_decision(prof, backend="openvino", openvino_shapes=["1x32", "8x32"]))
        backend, decision = select_backend(art, threads=1, openvino_kernels="auto", max_batch=32)
        info = ClassifierService(cfg, art, backend, decision).model_info().backend
        assert info["backend"] == "openvino" and info["static_shapes"] == ["1x32", "8x32"]
        assert "openvino (static shapes 1x32, 8x32), from the serving profile" in info["selection"]
        _write(path, _with_decision(prof, backend="routed", small="onnxruntime", large="openvino",
                                    max_small_tokens=100, openvino_shapes=["32x32"]))
        backend, decision = select_backend(art, threads=1, openvino_kernels="auto", max_batch=32)
        assert isinstance(backend, RoutedCpuBackend) and backend.route() == {
            "small": "onnxruntime", "large": "openvino", "max_small_tokens": 100}
        info = ClassifierService(cfg, art, backend, decision).model_info().backend
        assert info["static_shapes"] == ["32x32"] and info["backends"]["openvino"]["runs"] == {"static": 0,
                                                                                               "dynamic": 0}
        # the light-load route: one-row batches on ONNX Runtime
        _write(path, _with_decision(prof, backend="routed", small="onnxruntime", large="openvino",
                                    max_small_rows=1, openvino_shapes=["32x32"]))
        backend, decision = select_backend(art, threads=1, openvino_kernels="auto", max_batch=32)
        assert backend.route() == {"small": "onnxruntime", "large": "openvino", "max_small_rows": 1}
        assert decision["reason"].startswith("onnxruntime for one-row batches (light load) and openvino (static "
                                             "shapes 32x32) above, from the serving profile")
        info = ClassifierService(cfg, art, backend, decision).model_info().backend
        assert info["routing"]["max_small_rows"] == 1
        # a --openvino-shapes given to the server wins over the profile's
        backend, _ = select_backend(art, threads=1, openvino_kernels="auto", openvino_shapes="4x16")
        assert backend.info()["static_shapes"] == ["4x16"]
    finally:
        path.write_text(original)


def test_a_profile_for_another_machine_is_ignored_with_the_reason_logged(both, tuned, monkeypatch, caplog):
    import holoserve.backends.auto as auto

    prof, path = tuned
    original = path.read_text()
    monkeypatch.setattr(auto, "STARTUP_PLAN", dict(min_rounds=1, max_rounds=1, seconds=0.0, per_round=4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    other = {**prof["key"], "cpu_model": "Another CPU", "exports": {}}
    try:
        _write(path, {**prof, "key": other})
        with caplog.at_level(logging.WARNING, logger="holoserve.backends"):
            _, decision = select_backend(load_artifact(both), threads=1, max_batch=4)
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert "does not match this machine" in logged and "cpu_model: 'Another CPU' in the profile" in logged
        assert "the export files differ" in logged and f"holoserve tune {both}" in logged
        assert decision["serving_profile"].startswith("written for another setup: ")
        assert ("timed at start-up on GLUE SST-2 dev set" in decision["reason"]
                and "holoserve tune" in decision["reason"])
        # another thread count is another setup too
        caplog.clear()
        _write(path, prof)
        with caplog.at_level(logging.WARNING, logger="holoserve.backends"):
            select_backend(load_artifact(both), threads=2, max_batch=4)
        assert "threads: 1 in the profile, 2 here" in caplog.text
        # so is a cap on oneDNN's instruction set where it keeps OpenVINO off the CPU's AMX
        caplog.clear()
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
        with caplog.at_level(logging.WARNING, logger="holoserve.backends"):
            select_backend(load_artifact(both), threads=1, max_batch=4)
        if "amx_int8" in cpu_flags():
            assert "amx_withheld: None in the profile, 'ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16' here" in caplog.text
    finally:
        path.write_text(original)


@pytest.mark.parametrize("content,expected", [
    ("{not json", "is not valid JSON"),
    ('["a list"]', "it is not a holoserve-serving-profile file"),
    (None, "its decision names no CPU backend ('tensorrt')"),
    ("", "is not valid JSON"),
    ("version 1", "written by an earlier HoloServe (version 1), which timed one-row batches back to back"),
    ("two limits", "one positive token or row limit"),
])
def test_a_damaged_profile_is_ignored_with_a_clear_warning(both, tuned, monkeypatch, caplog, content, expected):
    import holoserve.backends.auto as auto

    prof, path = tuned
    original = path.read_text()
    monkeypatch.setattr(auto, "STARTUP_PLAN", dict(min_rounds=1, max_rounds=1, seconds=0.0, per_round=4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    try:
        if content is None:
            _write(path, _with_decision(prof, backend="tensorrt"))
        elif content == "version 1":
            _write(path, {**prof, "version": 1})
        elif content == "two limits":
            _write(path, _with_decision(prof, backend="routed", small="onnxruntime", large="openvino",
                                        max_small_tokens=100, max_small_rows=1))
        else:
            path.write_text(content)
        with caplog.at_level(logging.WARNING, logger="holoserve.backends"):
            backend, decision = select_backend(load_artifact(both), threads=1, max_batch=4)
        warning = next(r.getMessage() for r in caplog.records if "serving profile" in r.getMessage())
        assert expected in warning and f"run `holoserve tune {both}`" in warning and not caplog.records[0].exc_info
        assert "timed at start-up" in decision["reason"] and backend is not None
    finally:
        path.write_text(original)


def test_workers_pin_the_profiles_decision_and_shapes(both, tuned, monkeypatch):
    """`--workers N`: the parent follows the profile once and pins backend, kernels and shapes for all."""
    from holoserve.server.backend_choice import decide_for_workers
    from holoserve.server.config import ServerConfig, env_name

    prof, path = tuned
    original = path.read_text()
    from holoserve.backends.auto import ROUTE_ENV
    from holoserve.server.backend_choice import DECISION_ENV

    # decide_for_workers pins its choice in os.environ: set-then-delete makes the teardown remove it again
    for key in (*(env_name(n) for n in ("backend", "openvino_kernels", "openvino_shapes")), DECISION_ENV, ROUTE_ENV):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    try:
        _write(path, _with_decision(prof, backend="openvino", openvino_shapes=["2x32"]))
        cfg = ServerConfig(artifact_dir=str(both), threads=1, workers=2)
        decision = decide_for_workers(cfg)
        assert cfg.backend == "openvino" and cfg.openvino_shapes == "2x32"
        assert os.environ[env_name("openvino_shapes")] == "2x32"
        assert decision["reason"].startswith("chosen once for all 2 workers before they started: openvino (static "
                                             "shapes 2x32), from the serving profile")
    finally:
        path.write_text(original)


# --------------------------------------------------------------------------- tune's inputs and CLI


def test_tune_without_dev_texts_asks_for_a_file(both, monkeypatch, tmp_path):
    from holoserve.tune import TuneOptions, texts_for

    art = load_artifact(both)
    monkeypatch.setattr(profile, "dev_texts", lambda artifact: None)
    with pytest.raises(HoloServeError, match="no dev texts known .*pass --texts FILE"):
        texts_for(art, TuneOptions())
    (tmp_path / "t.txt").write_text("a fine film\n\nthe worst\n")
    assert texts_for(art, TuneOptions(texts=tmp_path / "t.txt")).rows == ["a fine film", "the worst"]


def test_texts_files(tmp_path):
    from holoserve.tune import read_texts

    (tmp_path / "a.csv").write_text('id,sentence\n1,"good, fun"\n2,bad\n')
    assert read_texts(tmp_path / "a.csv", False).rows == ["good, fun", "bad"]
    (tmp_path / "a.tsv").write_text("sentence1\tsentence2\nA\tB\nC\tD\n")
    assert read_texts(tmp_path / "a.tsv", True).rows == [("A", "B"), ("C", "D")]
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n\n{"text": "y"}\n')
    assert read_texts(tmp_path / "a.jsonl", False).rows == ["x", "y"]
    with pytest.raises(HoloServeError, match="no text column among 'id', 'body'; name it with --text-column"):
        (tmp_path / "b.csv").write_text("id,body\n1,x\n")
        read_texts(tmp_path / "b.csv", False)
    assert read_texts(tmp_path / "b.csv", False, text_column="body").rows == ["x"]
    with pytest.raises(HoloServeError, match="reads text pairs; give a CSV, TSV or JSON Lines file"):
        (tmp_path / "c.txt").write_text("x\n")
        read_texts(tmp_path / "c.txt", True)
    with pytest.raises(HoloServeError, match="line 1: not a JSON object"):
        (tmp_path / "d.jsonl").write_text("[1]\n")
        read_texts(tmp_path / "d.jsonl", False)
    with pytest.raises(HoloServeError, match="no such file"):
        read_texts(tmp_path / "missing.txt", False)


def test_tune_help_says_what_it_does(capsys):
    from holoserve.cli import main

    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Time the CPU backends the checkpoint has exports for" in text
    assert "serving-profile.json" in text and "without timing at start-up" in text and "--texts FILE" in text


def test_tune_cli_reports_bad_arguments_without_a_traceback(capsys):
    from holoserve.cli import main

    assert main(["tune", "/nonexistent", "--max-batch-size", "0", "--duration", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--duration -1: give 0 or more seconds" in err and "--max-batch-size 0: give 1 or more" in err
    assert main(["tune", "/nonexistent"]) == 2
    assert "checkpoint folder /nonexistent does not exist" in capsys.readouterr().err


def test_a_re_export_keeps_the_file_but_invalidates_the_profile(both, tuned, tmp_path):
    """Writing an export rebuilds the checkpoint folder: the profile stays in it, and its key no longer matches."""
    import shutil

    prof, _ = tuned
    ckpt = tmp_path / "copy"
    shutil.copytree(both, ckpt)
    assert profile.key_differences(prof["key"], profile.machine_key(load_artifact(ckpt), {"threads": 1})) == []
    onnx = load_artifact(ckpt).export("onnxruntime").file
    new = tmp_path / "new.onnx"
    new.write_bytes((ckpt / onnx).read_bytes() + b" ")  # another file in its place
    add_files(ckpt, {onnx: new}, move=False)
    assert (ckpt / profile.PROFILE_FILE).read_text() == (both / profile.PROFILE_FILE).read_text()
    differs = profile.key_differences(prof["key"], profile.machine_key(load_artifact(ckpt), {"threads": 1}))
    assert differs == ["the export files differ from those timed (re-exported since, or another export added)"]


def test_dev_texts_come_from_the_sample_or_a_glue_folder(tmp_path, monkeypatch):
    """sst2: GLUE SST-2's dev set (the embedded sample's); another GLUE task: its dev split in the GLUE folder,
    read without the data extras; anything else: none (tune then asks for --texts, serve uses random ids)."""
    from types import SimpleNamespace

    def art(task, pair):
        return SimpleNamespace(task_name=task, is_pair=pair)

    monkeypatch.delenv("HOLOSERVE_DATA_DIR", raising=False)
    sst2 = profile.dev_texts(art("sst2", False))
    assert len(sst2.rows) == 872 and sst2.rows[0].startswith("it 's a charming") and "SST-2" in sst2.source
    assert profile.dev_texts(art("mrpc", True)) is None and profile.dev_texts(art("my-task", False)) is None
    (tmp_path / "MRPC").mkdir()
    (tmp_path / "MRPC" / "dev.tsv").write_text("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                                               '1\t1\t2\tHe said "yes" .\tHe agreed .\n', encoding="utf-8")
    (tmp_path / "CoLA").mkdir()
    (tmp_path / "CoLA" / "dev.tsv").write_text("src\t1\t\tThe book was read .\n", encoding="utf-8")
    monkeypatch.setenv("HOLOSERVE_DATA_DIR", str(tmp_path))
    assert profile.dev_texts(art("mrpc", True)).rows == [('He said "yes" .', "He agreed .")]
    assert profile.dev_texts(art("cola", False)).rows == ["The book was read ."]


def test_random_ids_at_sentence_like_lengths_without_dev_texts(both):
    items = profile.synthetic_items(load_artifact(both), n=64)
    lengths = [it.length for it in items]
    assert len(items) == 64 and min(lengths) >= 4 and max(lengths) <= 32 and len(set(lengths)) > 5
    assert [it.length for it in profile.synthetic_items(load_artifact(both), n=64)] == lengths  # fixed seed


def test_tune_and_serve_with_the_kernels_on_any_cpu(both, tmp_path, monkeypatch, kernel_reference_build):
    """The path of a CPU with AVX-512 VNNI + VBMI and no AMX, run on any CPU, with the kernels' reference build
    standing in for the AVX-512 one (the same numbers, many times slower): tune times the kernels against
    OpenVINO's own GEMMs first, finds them slower and keeps OpenVINO's, saying so; a server following that
    profile serves OpenVINO's GEMMs and says why. A profile that keeps the kernels (as tune writes one where
    they win) is keyed on their build, and its server serves on the kernels and predicts as ONNX Runtime does."""
    import shutil

    import numpy as np

    from holoserve import kernels
    from holoserve.backends import load_backend
    from holoserve.backends import openvino as ovb
    from holoserve.core.tokenizer import TextEncoder, pad_batch
    from holoserve.tune import TuneOptions, tune

    _, library = kernel_reference_build
    monkeypatch.setattr(kernels, "locate", lambda flavour=kernels.AVX512: library)
    monkeypatch.setattr(ovb, "cpu_has_amx", lambda: False)
    monkeypatch.setenv(ovb.PROBE_ENV, "exact")  # OpenVINO's own INT8 GEMMs taken as exact, as on such a CPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(both, ckpt)
    (ckpt / profile.PROFILE_FILE).unlink(missing_ok=True)
    with open(os.devnull, "w") as quiet:
        prof, path = tune(ckpt, TuneOptions(**QUICK), out=quiet)
    phase = prof["timings"]["kernels"]
    assert phase["kept"] is False and phase["ratio"] > 1 and set(phase["median_ms"]) == {"on", "off"}, phase
    assert prof["decision"]["openvino_kernels"] == "off", prof["decision"]
    assert "the 2:4 kernels took" in prof["decision"]["reason"] and "OpenVINO keeps its own GEMMs" in \
        prof["decision"]["reason"], prof["decision"]
    assert prof["settings"]["openvino_kernels_status"].startswith("off: the 2:4 kernels took"), prof["settings"]
    assert "openvino" in prof["timings"]["median_ms"] and prof["key"]["kernels_build"] is None
    assert prof["key"]["openvino_options"]["kernels"] == "auto"  # what the server is given, not what tune chose
    # a server with the default `auto` follows it: OpenVINO's own GEMMs, and why
    _write(path, _with_decision(prof, backend="openvino", openvino_shapes=[]))
    art = load_artifact(ckpt)
    backend, decision = select_backend(art, threads=1, openvino_kernels="auto", max_batch=32)
    assert decision["serving_profile"] == "used" and backend.name == "openvino", decision
    status = backend.info()["kernels"]["status"]
    assert status.startswith("off: the serving profile's `holoserve tune` kept OpenVINO's own GEMMs (the 2:4 "
                             "kernels took"), status
    # where tune did not time them (on AMX, `auto` leaves them off by itself), the server says the loader's reason
    monkeypatch.setattr(ovb, "cpu_has_amx", lambda: True)
    untimed = _with_decision(prof, backend="openvino", openvino_shapes=[])
    untimed["timings"] = {k: v for k, v in prof["timings"].items() if k != "kernels"}
    _write(path, untimed)
    backend, decision = select_backend(art, threads=1, openvino_kernels="auto", max_batch=32)
    assert decision["serving_profile"] == "used" and backend.name == "openvino", decision
    status = backend.info()["kernels"]["status"]
    assert status.startswith("off: this CPU has AMX") and "serving profile" not in status, status
    monkeypatch.setattr(ovb, "cpu_has_amx", lambda: False)
    # a profile that keeps the kernels, keyed on their build as tune keys a decision that serves them
    _write(path, {**_with_decision(prof, backend="openvino", openvino_shapes=[], openvino_kernels="on"),
                  "key": {**prof["key"], "kernels_build": kernels.build_key(None)}})
    backend, decision = select_backend(art, threads=1, openvino_kernels="auto", max_batch=32)
    assert decision["serving_profile"] == "used" and backend.name == "openvino", decision
    status = backend.info()["kernels"]
    assert status["status"].startswith("on (HoloServe's 2:4 INT8 kernels") and status["Sparse24Ffn"] == 2, status
    enc = TextEncoder(ckpt / "tokenizer.json", art.max_seq_length)
    batch = pad_batch(enc.encode(["a good film", "the plot is thin and the acting is worse", "fun"]), enc.pad_id)
    ours, ort = backend.infer(*batch), load_backend("onnxruntime", art, threads=1).infer(*batch)
    assert np.argmax(ours, -1).tolist() == np.argmax(ort, -1).tolist()
    assert np.abs(ours - ort).max() < 0.05 * max(1.0, float(np.abs(ort).max())), (ours, ort)


def test_wherever_openvino_serves_one_batch_runs_at_a_time_under_auto_instances(both, tuned, no_timing):
    """With --instances auto on two cores, ONNX Runtime serving alone runs two batches at once, but wherever
    OpenVINO serves, alone or routed with ONNX Runtime, one batch runs at a time on both threads (its sides each
    loaded so), whether a profile, the start-up timing or --backend picked it; a count given is kept."""
    from holoserve.server.config import ServerConfig
    from holoserve.server.service import backend_options, open_backend

    prof, path = tuned
    original = path.read_text()
    art = load_artifact(both)

    def served(**settings):
        config = ServerConfig(artifact_dir=str(both), threads=2, **settings).validate()
        backend, _ = open_backend(config, art)
        if hasattr(backend, "small"):  # a routed pair: each side as loaded, not only the pair's count
            assert backend.small.instances == backend.large.instances == backend.instances, backend.info()
            assert backend.small.threads == 2, backend.small.info()  # ONNX Runtime's one-row batches: all threads
        return backend.name, getattr(backend, "instances", 1)

    try:
        key = profile.machine_key(art, backend_options(ServerConfig(artifact_dir=str(both), threads=2).validate(),
                                                       art))
        assert key["instances"] == 2  # what tune times with: each backend as one of two instances runs it
        for decision, expected in (
                ({"backend": "openvino"}, ("openvino", 1)),
                ({"backend": "onnxruntime"}, ("onnxruntime", 2)),
                ({"backend": "routed", "small": "onnxruntime", "large": "openvino", "max_small_rows": 1},
                 ("onnxruntime+openvino", 1))):
            _write(path, {**_with_decision(prof, openvino_shapes=[], **decision), "key": key})
            assert served() == expected, decision
        assert served(backend="openvino") == ("openvino", 1)
        assert served(backend="onnxruntime") == ("onnxruntime", 2)
        assert served(backend="openvino", instances="2") == ("openvino", 2)  # given: kept
    finally:
        path.write_text(original)


@pytest.mark.parametrize("picked", [
    {"backend": "openvino", "reason": "openvino is faster"},
    {"backend": "routed", "small": "onnxruntime", "large": "openvino", "max_small_rows": 1,
     "reason": "onnxruntime for one-row batches"}], ids=["openvino", "routed"])
def test_openvino_picked_at_start_up_is_loaded_again_for_one_batch_at_a_time(both, tuned, monkeypatch, picked):
    """No profile: the start-up timing times both backends as two instances run them; where OpenVINO wins, alone
    or as a side of a routed pair, what serves is loaded again for one batch at a time, as with a profile."""
    import holoserve.backends.auto as auto
    from holoserve.server.config import ServerConfig
    from holoserve.server.service import open_backend

    _, path = tuned
    original = path.read_text()
    monkeypatch.setattr(auto, "STARTUP_PLAN", dict(min_rounds=1, max_rounds=1, seconds=0.0, per_round=4))
    monkeypatch.setattr(profile, "decide", lambda *a, **k: dict(picked))
    monkeypatch.setattr(profile, "confirm_routing", lambda backends, decision, *a, **k: decision)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    timed: list[dict] = []
    real = profile.time_backends
    monkeypatch.setattr(profile, "time_backends", lambda backends, *a, **k: (
        timed.append({n: getattr(b, "instances", 1) for n, b in backends.items()}), real(backends, *a, **k))[1])
    try:
        path.unlink()
        backend, decision = open_backend(ServerConfig(artifact_dir=str(both), threads=2).validate(),
                                         load_artifact(both))
        assert timed == [{"onnxruntime": 2, "openvino": 2}], timed
        assert "timed at start-up" in decision["reason"], decision
        if picked["backend"] == "routed":
            assert backend.name == "onnxruntime+openvino" and backend.instances == 1, decision
            assert backend.small.instances == backend.large.instances == 1 and backend.small.threads == 2
        else:
            assert backend.name == "openvino" and backend.instances == 1, decision
    finally:
        path.write_text(original)
