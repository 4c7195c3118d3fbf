"""bench/accuracy/run.py end to end on a tiny BERT: two seeds, one teacher per seed shared by every
method and by the NNCF row, mean ± std over seeds, and a re-run that reuses the finished runs."""
import json
import sys

import pytest

from tests.helpers.bench import bench_module
from tests.helpers.checkpoints import write_glue
from tests.helpers.tiny import make_tiny_bert


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("accbench")
    model = make_tiny_bert(root / "tiny", hidden=32, intermediate=64)
    glue = write_glue(root / "glue")
    mod = bench_module("accuracy", "run")
    argv = ["run.py", "--data-dir", str(glue), "--tasks", "sst2", "--seeds", "0,1", "--model", str(model),
            "--max-steps", "3", "--threads", "1", "--only", "admm_int8,oneshot_act_int8,nncf_ptq",
            "--calibration-rows", "8", "--runs-dir", str(root / "runs"), "--results", str(root / "results"),
            "--set", "batch_size=8", "--set", "calib_batches=2"]
    return mod, argv, root


def _main(mod, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", argv)
    assert mod.main() == 0


def test_seeds_share_one_teacher_per_seed_and_aggregate(bench, monkeypatch):
    pytest.importorskip("nncf", reason="the NNCF row needs holoserve[bench]")
    mod, argv, root = bench
    _main(mod, argv, monkeypatch)
    runs = root / "runs"
    for seed in (0, 1):
        first = json.loads((runs / f"sst2-s{seed}-admm_int8" / "manifest.json").read_text())["training"]
        other = json.loads((runs / f"sst2-s{seed}-oneshot_act_int8" / "manifest.json").read_text())["training"]
        assert first["teacher"] is None and other["teacher"] == "teacher"  # trained once, then reused
        assert first["preset_config"]["mask_metric"] == "magnitude"  # each row names its mask metric
        assert other["preset_config"]["mask_metric"] == "activation" and other["method"] == "oneshot"
        assert first["seed"] == other["seed"] == seed
        for run in ("admm_int8", "oneshot_act_int8"):  # --model reaches the runs that reuse the teacher too
            assert json.loads((runs / f"sst2-s{seed}-{run}" / "manifest.json").read_text())["base_model"] == "tiny"
        peer = json.loads((runs / f"sst2-s{seed}-nncf_ptq.json").read_text())
        assert peer["calibration_rows"] == 8 and 0 <= peer["metrics"]["accuracy"] <= 1
    out = json.loads((root / "results" / "accuracy.json").read_text())
    (row,) = out["rows"]
    cols = row["columns"]
    assert set(cols) == {"dense", "nncf_ptq", "oneshot_act_int8", "admm_int8"} and row["seeds"] == [0, 1]
    for key, st in cols.items():
        vals = [row["per_seed"][str(s)][key]["value"] if key != "dense" else None for s in (0, 1)]
        if key != "dense":
            assert st["values"] == vals and st["n"] == 2
            assert st["mean"] == pytest.approx(sum(vals) / 2)
    assert out["meta"]["seeds"] == [0, 1] and "overall" in out["meta"]
    means = out["meta"]["overall"]["means"]
    assert out["meta"]["overall"]["admm_margin_over_best_baseline"] == pytest.approx(
        means["admm_int8"] - means["oneshot_act_int8"])
    md = (root / "results" / "accuracy.md").read_text()
    assert "mean ± std over seeds" in md and "NNCF INT8 PTQ" in md
    assert (root / "results" / "accuracy.png").stat().st_size > 1000
    # a re-run reuses every finished run: nothing is retrained
    stamp = {p: p.stat().st_mtime_ns for p in runs.glob("*/manifest.json")}
    _main(mod, argv + ["--report-only"], monkeypatch)
    assert {p: p.stat().st_mtime_ns for p in runs.glob("*/manifest.json")} == stamp
    assert json.loads((root / "results" / "accuracy.json").read_text())["rows"][0]["columns"].keys() == cols.keys()
    # a report over a seed that has no finished run yet counts only the seeds that have
    _main(mod, [*argv[:argv.index("--seeds") + 1], "0,1,2", *argv[argv.index("--seeds") + 2:], "--report-only"],
          monkeypatch)
    assert json.loads((root / "results" / "accuracy.json").read_text())["rows"][0]["seeds"] == [0, 1]
    md = (root / "results" / "accuracy.md").read_text()
    assert "seeds 0, 1 (" in md and "0, 1, 2" not in md
    # --only with --report-only reports just those rows (e.g. the rows that ran over more seeds than others)
    only = argv.index("--only") + 1
    _main(mod, [*argv[:only], "oneshot_act_int8,nncf_ptq", *argv[only + 1:], "--report-only"], monkeypatch)
    cols = json.loads((root / "results" / "accuracy.json").read_text())["rows"][0]["columns"]
    assert set(cols) == {"dense", "nncf_ptq", "oneshot_act_int8"}
    assert "ADMM" not in (root / "results" / "accuracy.md").read_text().split("Steps per phase")[0]


def test_unknown_row_is_refused(bench, monkeypatch, capsys):
    mod, argv, _ = bench
    monkeypatch.setattr(sys, "argv", ["run.py", "--data-dir", "x", "--only", "admm,nope"])
    with pytest.raises(SystemExit):
        mod.main()
    assert "unknown row" in capsys.readouterr().err


def _rec(value, dense):
    return {"value": value, "dense": dense, "metric": "pearson", "dev_rows": 10, "steps": {}, "wall_seconds": 1.0}


def test_a_column_missing_a_seed_is_paired_with_its_own_teachers(bench, tmp_path, monkeypatch, capsys):
    mod = bench[0]
    # seed 2's teacher is much better and only the magnitude row has run on it yet
    per_seed = {0: {"magnitude_ptq": _rec(0.80, 0.80), "oneshot_act05_obs": _rec(0.84, 0.80)},
                1: {"magnitude_ptq": _rec(0.82, 0.82), "oneshot_act05_obs": _rec(0.86, 0.82)},
                2: {"magnitude_ptq": _rec(0.88, 0.90)}}
    row = mod.summarize("stsb", per_seed)
    cols = row["columns"]
    assert row["common_seeds"] == [0, 1]
    assert cols["oneshot_act05_obs"]["kept"] == pytest.approx(0.85 / 0.81)  # not over the 3-seed dense mean
    assert cols["magnitude_ptq"]["mean"] == pytest.approx(0.8333333)
    assert cols["magnitude_ptq"]["common_mean"] == pytest.approx(0.81)
    ov = mod.overall([row])
    assert ov["means"]["magnitude_ptq"] == pytest.approx(0.81) and ov["best_2to4_int8"] == "oneshot_act05_obs"
    meta = {"model": "m", "preset": "full", "date": "d", "machine": "x", "notes": "", "overall": ov}
    md = mod.markdown([row], meta)
    assert "[2 of 3 seeds]" in md.split("\n")[6] and "Compared on the seeds every column ran (stsb: 0, 1)" in md
    # each row minus the default recipe on the same seed: seed 2 has no default run, so it is left out
    pair = mod.paired([row])["rows"]["magnitude_ptq"]
    assert pair["tasks"]["stsb"]["seeds"] == [0, 1] and pair["tasks"]["stsb"]["mean"] == pytest.approx(-0.04)
    assert "| magnitude 2:4 + fine-tune + PTQ | -4.00 ± 0.00 [0,1] |" in md
    # per seed: the teacher, the default, and each row with its difference from the default on that seed
    assert "| stsb | 1 | 82.00 | 86.00 | 82.00 (-4.00) |" in md and "| stsb | 2 | 90.00 | — | 88.00 |" in md
    # a row the equal-time rule held: its score after the projection and the QAT steps it gave up
    held = {**_rec(0.83, 0.80), "extra": {"after_projection": {"pearson": 0.75}},
            "equal_time": {"steps_given_up": 20, "qat_steps": 80}}
    assert mod.seed_rows([mod.summarize("stsb", {0: {"oneshot_act05_obs": _rec(0.84, 0.80), "magnitude_ptq": held}})],
                         ["oneshot_act05_obs", "magnitude_ptq"])[0][-1] \
        == "83.00 (-1.00; after proj 75.00; 20 of 100 QAT steps given up)"
    # the same tables rebuilt from the accuracy.json, as for runs made on another machine
    src = tmp_path / "accuracy.json"
    src.write_text(json.dumps({"meta": meta, "rows": [row]}))
    monkeypatch.setattr(sys, "argv", ["run.py", "--from-json", str(src), "--results", str(tmp_path / "out")])
    assert mod.main() == 0
    again = json.loads((tmp_path / "out" / "accuracy.json").read_text())
    assert again["rows"][0]["columns"]["oneshot_act05_obs"]["kept"] == pytest.approx(cols["oneshot_act05_obs"]["kept"])
    assert (tmp_path / "out" / "accuracy.md").read_text() == md
    assert (tmp_path / "out" / "paired.png").stat().st_size > 0  # the paired differences, plotted
    # a later call's file (seeds 2 and 3, every column, its own seed-2 teacher) joins it: its seed 2
    # replaces the first file's seed 2 whole, so no row is paired with another call's teacher
    later = mod.summarize("stsb", {2: {"magnitude_ptq": _rec(0.87, 0.89), "oneshot_act05_obs": _rec(0.90, 0.89)},
                                   3: {"magnitude_ptq": _rec(0.83, 0.84), "oneshot_act05_obs": _rec(0.85, 0.84)}})
    (tmp_path / "later").mkdir()
    src2 = tmp_path / "later" / "accuracy.json"
    src2.write_text(json.dumps({"meta": {**meta, "date": "e"}, "rows": [later]}))
    monkeypatch.setattr(sys, "argv", ["run.py", "--from-json", str(src), "--from-json", str(src2),
                                      "--results", str(tmp_path / "joined")])
    assert mod.main() == 0
    joined = json.loads((tmp_path / "joined" / "accuracy.json").read_text())
    row = joined["rows"][0]
    assert row["seeds"] == [0, 1, 2, 3] and row["common_seeds"] == [0, 1, 2, 3]
    assert row["per_seed"]["2"]["magnitude_ptq"]["value"] == pytest.approx(0.87)
    assert row["columns"]["dense"]["mean"] == pytest.approx((0.80 + 0.82 + 0.89 + 0.84) / 4)
    assert [j["seeds_taken"] for j in joined["meta"]["joined_from"]] == [[0, 1], [2, 3]]
    assert "Joined from seeds 0, 1 of" in (tmp_path / "joined" / "accuracy.md").read_text()
    src2.write_text(json.dumps({"meta": {**meta, "preset": "quick"}, "rows": [later]}))
    with pytest.raises(SystemExit, match="different presets"):
        mod.main()
    src.write_text("{}")
    monkeypatch.setattr(sys, "argv", ["run.py", "--from-json", str(src), "--results", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="not an accuracy.json"):
        mod.main()
