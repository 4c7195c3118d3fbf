"""The ADMM decision rule (bench/accuracy/decision.py) on made-up paired tables, and the paired benchmark's
equal-time rule end to end on a tiny BERT."""
import json
import sys

import pytest

from tests.helpers.bench import bench_module
from tests.helpers.checkpoints import write_glue
from tests.helpers.tiny import make_tiny_bert

R1, R2, BASE = "oneshot_act05_admm_fixed", "oneshot_act05_admm_stable", "oneshot_act05_obs"


def _rec(value):
    return {"value": value, "dense": 0.9, "metric": "m", "dev_rows": 10, "steps": {}, "wall_seconds": 1.0}


def _pair(run, diffs: dict[str, list[float]], key=R1):
    """run.paired over tasks whose seeds give `key` these differences (points) from the default recipe."""
    rows = [run.summarize(task, {s: {BASE: _rec(0.8), key: _rec(0.8 + d / 100)} for s, d in enumerate(ds)})
            for task, ds in diffs.items()]
    return run.paired(rows)


def _full(d: float, mrpc=None, cola=None):
    """Every task's required seeds at difference `d` (points), with MRPC or CoLA's per-seed values replaced."""
    out = {"mrpc": [d] * 5, "stsb": [d] * 5, "cola": [d] * 10, "sst2": [d] * 5}
    return {**out, **({"mrpc": mrpc} if mrpc else {}), **({"cola": cola} if cola else {})}


def test_the_rule_goes_holds_parity_or_stays():
    run, decision = bench_module("accuracy", "run"), bench_module("accuracy", "decision")
    (d,) = decision.decide(_pair(run, _full(0.5)))
    assert d["final"] and d["mean"] == pytest.approx(0.5) and d["interval"] == pytest.approx([0.5, 0.5])
    assert d["verdict"] == "go, pending the full-preset check"
    assert decision.decide(_pair(run, _full(0.5)), {R1: 0.1})[0]["verdict"] == "go"
    assert decision.decide(_pair(run, _full(0.5)), {R1: -0.3})[0]["verdict"].startswith("no-go: the full-preset")
    # CoLA may trail by up to 0.5, the others by 0.2
    assert decision.decide(_pair(run, _full(0.5, cola=[-0.4] * 10)))[0]["verdict"].startswith("go")
    low = decision.decide(_pair(run, _full(0.5, mrpc=[-0.3] * 5)))[0]
    assert low["low_tasks"] == ["mrpc"] and low["verdict"] == "no-go"
    # a positive mean whose interval reaches below -0.1: not a go; R1 within ±0.2 is parity, R2 is not
    noisy = _full(0.1, mrpc=[3.0, -3.0, 3.0, -3.0, -0.5])
    r1 = decision.decide(_pair(run, noisy))[0]
    assert r1["mean"] > 0 and r1["interval"][0] < -0.1 and r1["verdict"] == "parity"
    assert decision.decide(_pair(run, noisy, key=R2))[0]["verdict"] == "no-go"
    assert decision.decide(_pair(run, _full(-0.5)))[0]["verdict"] == "no-go"
    # too few seeds: the verdict is provisional, and says which seeds are missing
    short = decision.decide(_pair(run, {"mrpc": [0.5, 0.4], "stsb": [0.5, 0.4], "cola": [0.5, 0.6],
                                        "sst2": [0.5, 0.5]}))[0]
    assert not short["final"] and short["missing_seeds"] == {"mrpc": 3, "stsb": 3, "cola": 8, "sst2": 3}
    assert short["verdict"].startswith("go")
    md = "\n".join(decision.markdown([short], run.LABELS))
    assert "provisional, seeds missing: mrpc 3, stsb 3, cola 8, sst2 3" in md
    assert decision.decide(_pair(run, {"mrpc": [0.5]}))[0]["verdict"] == "incomplete"


def test_bootstrap_interval_is_reproducible_and_brackets_the_mean():
    decision = bench_module("accuracy", "decision")
    diffs = {"a": [0.1, 0.9, -0.4, 0.3], "b": [1.0, 0.2, 0.5]}
    lo, hi = decision.bootstrap_interval(diffs)
    assert (lo, hi) == decision.bootstrap_interval(diffs)
    mean = (sum(diffs["a"]) / 4 + sum(diffs["b"]) / 3) / 2
    assert lo < mean < hi and decision.bootstrap_interval(diffs, level=0.5)[0] > lo


def test_admm_rows_give_up_their_extra_projection_time(tmp_path, monkeypatch, capsys):
    """With the default recipe's run on a seed, an ADMM projection row is run with that run's QAT seconds per step
    (equal_time_step_seconds) and trains that many fewer steps; without it the bench stops and says why."""
    run = bench_module("accuracy", "run")
    model = make_tiny_bert(tmp_path / "tiny", hidden=32, intermediate=64)
    argv = ["run.py", "--data-dir", str(write_glue(tmp_path / "glue")), "--tasks", "sst2", "--seeds", "0",
            "--model", str(model), "--max-steps", "3", "--threads", "1", "--runs-dir", str(tmp_path / "runs"),
            "--results", str(tmp_path / "results"), "--set", "batch_size=8", "--set", "calib_batches=2",
            "--set", "projection_batches=2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--only", R1])
    with pytest.raises(SystemExit, match="needs the default recipe's run on this seed first"):
        run.main()
    monkeypatch.setattr(sys, "argv", [*argv, "--only", f"{BASE},{R1}"])
    assert run.main() == 0
    base = json.loads((tmp_path / "runs" / f"sst2-s0-{BASE}" / "manifest.json").read_text())["training"]["phases"]
    admm = json.loads((tmp_path / "runs" / f"sst2-s0-{R1}" / "manifest.json").read_text())["training"]["phases"]
    e = admm["projection"]["equal_time"]
    assert e["step_seconds"] == pytest.approx(base["qat"]["seconds"] / base["qat"]["steps"], abs=1e-4)
    assert admm["qat"]["steps"] == base["qat"]["steps"] - e["steps_given_up"]
    out = json.loads((tmp_path / "results" / "accuracy.json").read_text())
    assert out["rows"][0]["per_seed"]["0"][R1]["equal_time"]["steps_given_up"] == e["steps_given_up"]
    assert out["meta"]["decision"][0]["verdict"] == "incomplete"
    assert "not enough paired seeds yet" in (tmp_path / "results" / "accuracy.md").read_text()
