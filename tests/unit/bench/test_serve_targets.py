"""bench.serve_load.targets' table: which runs it makes, and each ratio held to its target (the runs themselves
are run for real by tests/unit/docker/test_serve_targets.py)."""
from types import SimpleNamespace

import pytest

from bench.serve_load import targets


def record(throughput: float, p50: float) -> dict:
    return {"summary": {"throughput_ratio_32": throughput, "p50_ratio_1": p50},
            "variants": {"default": {"backend": "openvino", "kernels": "on (HoloServe's 2:4 INT8 kernels"}}}


def test_each_ratio_is_held_to_its_target_and_a_missing_run_is_said():
    got = targets.rows({("long", "onnxruntime"): record(1.3, 1.0), ("short", "onnxruntime"): record(0.99, 1.01),
                        ("pairs", "onnxruntime"): record(0.5, 2.0)}, targets.TARGETS)
    verdicts = [(r["texts"], r["versus"], r["what"], r["verdict"]) for r in got]
    assert verdicts == [
        ("long", "onnxruntime", "req/s at 32 clients", "met"),
        ("long", "onnxruntime", "p50 latency at 1 client", "met"),
        ("short", "onnxruntime", "req/s at 32 clients", "not met"),
        ("short", "onnxruntime", "p50 latency at 1 client", "not met"),
        ("pairs", "onnxruntime", "req/s at 32 clients", "measured"),
        ("pairs", "onnxruntime", "p50 latency at 1 client", "measured"),
        ("short", "baseline", "req/s at 32 clients", "not measured")]
    assert got[0]["default_backend"] == "openvino" and got[-1]["ratio"] is None
    ort = record(0.98, 1.02)
    ort["variants"]["default"] = {"backend": "onnxruntime", "kernels": None}
    same = targets.rows({("short", "onnxruntime"): ort}, targets.AMX_TARGETS)
    assert {r["verdict"] for r in same if r["texts"] == "short" and r["versus"] == "onnxruntime"} == {targets.SAME}
    amx = targets.rows({("pairs", "onnxruntime"): record(0.99, 1.0)}, targets.AMX_TARGETS)
    assert [r["verdict"] for r in amx if r["texts"] == "pairs"] == ["not met", "met"]
    # a routed pair whose light-load route gives one-row batches to ONNX Runtime: at one client both sides run
    # ONNX Runtime, so the p50 row says so; its throughput at 32 clients is held to the target as ever
    routed = record(1.1, 1.03)
    routed["variants"]["default"] = {"backend": "onnxruntime+openvino", "kernels": None,
                                     "routing": {"small": "onnxruntime", "large": "openvino", "max_small_rows": 1}}
    by_tokens = record(1.1, 1.03)
    by_tokens["variants"]["default"] = {"backend": "onnxruntime+openvino", "kernels": None, "routing": {
        "small": "onnxruntime", "large": "openvino", "max_small_tokens": 256}}
    got = {k: [r["verdict"] for r in targets.rows({("pairs", "onnxruntime"): rec}, targets.AMX_TARGETS)
               if r["texts"] == "pairs"] for k, rec in (("rows", routed), ("tokens", by_tokens))}
    assert got == {"rows": ["met", targets.SAME_ONE_ROW], "tokens": ["met", "not met"]}, got
    # ... but where the pair runs one batch at a time and the other side two, its one-row batches run on all the
    # threads: the p50 row measures that, held to the target
    for default, other, verdict in ((1, 2, "not met"), (2, 2, targets.SAME_ONE_ROW)):
        routed["variants"]["default"]["instances"] = default
        routed["variants"]["onnxruntime"] = {"backend": "onnxruntime", "instances": other}
        got = [r["verdict"] for r in targets.rows({("pairs", "onnxruntime"): routed}, targets.AMX_TARGETS)
               if r["texts"] == "pairs"]
        assert got == ["met", verdict], (default, other, got)
    assert [(r["versus"], r["target"]) for r in amx if r["versus"] != "onnxruntime"] == [("baseline", "—")]
    assert all(r["target"] in (">= 1.0", "<= 1.0") for r in amx if r["versus"] == "onnxruntime")


def test_the_runs_follow_the_data_and_the_baseline_given():
    full = SimpleNamespace(data_dir="glue", baseline_image="holoserve:old")
    assert targets.runs(full, targets.TARGETS) == [("long", "onnxruntime"), ("short", "onnxruntime"),
                                                    ("pairs", "onnxruntime"), ("short", "baseline")]
    bare = SimpleNamespace(data_dir=None, baseline_image=None)
    assert targets.runs(bare, targets.TARGETS) == [("long", "onnxruntime"), ("short", "onnxruntime")]


def test_the_one_instance_variant_is_the_same_image_running_one_batch_at_a_time(tmp_path, monkeypatch):
    """--versus one-instance: the same image with --instances 1, pinned to what the checkpoint's serving profile
    decides (its key names two instances, so a one-instance server would time the backends at start-up)."""
    import json

    from bench.serve_load.modes import versus_variant
    from holoserve.backends.auto import ROUTE_ENV, _route_from_env
    from holoserve.backends.profile import PROFILE_FILE
    from holoserve.server.config import ServerConfig, env_name

    name, image, env = versus_variant("one-instance", "holoserve:cpu", tmp_path)  # no profile: nothing pinned
    assert (name, image) == ("one_instance", "holoserve:cpu")
    assert env == {env_name("instances"): "1"}
    assert ServerConfig(instances=env[env_name("instances")]).validate().instances == "1"
    routed = {"backend": "routed", "small": "onnxruntime", "large": "openvino", "max_small_rows": 1,
              "openvino_shapes": ["2x48", "4x64"], "openvino_kernels": "on", "reason": "..."}
    for decision, pins in (
            ({"backend": "onnxruntime", "reason": "..."}, {env_name("backend"): "onnxruntime"}),
            ({"backend": "openvino", "openvino_shapes": ["1x64", "8x64"], "openvino_kernels": "off"},
             {env_name("backend"): "openvino", env_name("openvino_shapes"): "1x64,8x64",
              env_name("openvino_kernels"): "off"}),
            (routed, {ROUTE_ENV: json.dumps({"small": "onnxruntime", "large": "openvino", "max_small_rows": 1}),
                      env_name("openvino_shapes"): "2x48,4x64", env_name("openvino_kernels"): "on"})):
        (tmp_path / PROFILE_FILE).write_text(json.dumps({"decision": decision}))
        assert versus_variant("one-instance", "holoserve:cpu", tmp_path)[2] == {env_name("instances"): "1", **pins}
        if decision is routed:  # the route pin is one a server loads: one-row batches to ONNX Runtime
            monkeypatch.setenv(ROUTE_ENV, pins[ROUTE_ENV])
            sides = {n: SimpleNamespace(name=n, instances=1) for n in ("onnxruntime", "openvino")}
            pair, _ = _route_from_env(sides)
            assert pair.route() == {"small": "onnxruntime", "large": "openvino", "max_small_rows": 1}
    (tmp_path / PROFILE_FILE).write_text("not json")
    assert versus_variant("one-instance", "holoserve:cpu", tmp_path)[2] == {env_name("instances"): "1"}
    # env: the same image with the settings named, e.g. one instance on the backend a profile would pick
    assert versus_variant("env:HOLOSERVE_INSTANCES=1,HOLOSERVE_OPENVINO_SHAPES=1x64,8x64,HOLOSERVE_BACKEND=openvino",
                          "holoserve:cpu") == ("env", "holoserve:cpu", {
                              "HOLOSERVE_INSTANCES": "1", "HOLOSERVE_OPENVINO_SHAPES": "1x64,8x64",
                              "HOLOSERVE_BACKEND": "openvino"})
    for bad in ("env:", "env:INSTANCES=1", "env:HOLOSERVE_INSTANCES", "env:HOLOSERVE_INSTANCES="):
        with pytest.raises(SystemExit, match="env:HOLOSERVE_X=V"):
            versus_variant(bad, "holoserve:cpu")


def test_a_level_pools_the_turns_of_both_legs():
    """level_summary over two legs' take_turns results: latencies and answers pooled, the mean batch and the CPU
    time per answer from the sums, not an average of the legs' ratios."""
    from bench.serve_load.load import level_summary

    def turn(lat, seqs, execs, cpu):
        timing = {"tokenize": 0.1, "queue": 0.2, "inference": 0.3, "total": 0.6}
        part = {"lat": lat, "statuses": {200: len(lat)}, "server": [timing] * len(lat), "errors": [], "wall": 1.0}
        return {"parts": [part], "seqs": [seqs, execs], "cpu": cpu}

    lv = level_summary(32, [turn([1.0, 2.0, 3.0], 30, 10, 0.3), turn([4.0], 10, 1, 0.1)], with_cpu=True)
    assert lv["rounds"] == 2 and lv["ok"] == 4 and lv["throughput_rps"] == 2.0
    assert lv["p50_ms"] == 2.5 and lv["mean_batch"] == round(40 / 11, 2)
    assert lv["server_cpu_ms_per_request"] == 100.0
    assert "server_cpu_ms_per_request" not in level_summary(32, [turn([1.0], 1, 1, 0.0)])


def test_the_plot_draws_each_measured_row_against_its_target(tmp_path):
    """targets.png: every row with a ratio (a missing run and a row with no target included), written whole."""
    got = targets.rows({("long", "onnxruntime"): record(1.3, 0.9), ("short", "onnxruntime"): record(0.99, 1.01)},
                       targets.TARGETS)
    assert [r["target_value"] for r in got] == [t[4] for t in targets.TARGETS]  # the tick is the target itself
    assert any(r["ratio"] is None for r in got) and any(r["target"] == "—" for r in targets.rows(
        {("short", "baseline"): record(1.5, 1.0)}, targets.AMX_TARGETS))
    res = {"rows": got + [r for r in targets.rows({("short", "baseline"): record(1.5, 1.0)}, targets.AMX_TARGETS)
                          if r["versus"] == "baseline"],
           "machine": {"cores": 2}, "image": "holoserve:cpu", "baseline_image": "holoserve:old", "date": "today",
           "deny_amx": True}
    path = tmp_path / "targets.png"
    targets.plot(res, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.tmp*"))
    assert "![each ratio against its target](targets.png)" in targets.markdown({
        **res, "cpu_class": "a CPU", "checkpoint": "a", "pairs_checkpoint": "b", "rounds": 4, "duration_s": 20,
        "command": "python -m bench.serve_load.targets", "runs": []})


def test_env_settings_read_values_with_commas_and_refuse_other_names():
    from bench.serve_load.modes import env_settings, versus_variant

    assert env_settings("HOLOSERVE_BACKEND=openvino,HOLOSERVE_OPENVINO_SHAPES=1x64,8x64") == {
        "HOLOSERVE_BACKEND": "openvino", "HOLOSERVE_OPENVINO_SHAPES": "1x64,8x64"}
    assert env_settings("PATH=/bin") is None and env_settings("HOLOSERVE_BACKEND=") is None
    assert versus_variant("env:HOLOSERVE_INSTANCES=1", "img") == ("env", "img", {"HOLOSERVE_INSTANCES": "1"})
    with pytest.raises(SystemExit, match="env:HOLOSERVE_X=V"):
        versus_variant("env:OTHER=1", "img")


def test_each_comparison_runs_for_its_duration_not_to_the_answer_cap(tmp_path, monkeypatch):
    """measure() hands run a cap on answers no level reaches at the duration asked (run's own default, 20,000
    answers over 4 rounds, ended 40 s levels early from 500 req/s)."""
    import json

    seen = []

    def fake_main(argv):
        seen.append(argv)
        (tmp_path / f"{argv[argv.index('--name') + 1]}_docker.json").write_text(json.dumps({"ok": 1}))

    monkeypatch.setattr(targets.serve_load, "main", fake_main)
    args = SimpleNamespace(image="holoserve:new", baseline_image=None, checkpoint="ck", pairs_checkpoint="pk",
                           duration=40.0, rounds=4, data_dir=None, cpus=None, deny_amx=False)
    assert targets.measure(args, tmp_path, "long", "onnxruntime") == {"ok": 1}
    argv = seen[0]
    cap = int(argv[argv.index("--max-requests") + 1])
    assert cap >= 2000 * args.duration  # 2,000 req/s, several times what two cores serve here
