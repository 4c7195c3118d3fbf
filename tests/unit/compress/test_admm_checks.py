"""bench/accuracy/admm_checks.py end to end on a tiny BERT and synthetic rows: every check runs and reports."""
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


def test_the_admm_checks_run_on_a_tiny_teacher(tmp_path, capsys):
    from bench.accuracy.admm_checks import main
    from tests.helpers.checkpoints import write_glue
    from tests.helpers.tiny import make_tiny_bert

    teacher = make_tiny_bert(tmp_path / "tiny", hidden=32, intermediate=64)
    glue = write_glue(tmp_path / "glue", train_rows=600)  # 19 batches of 32: the three splits of 16 wrap around
    out = tmp_path / "out"
    assert main(["--task", "sst2", "--data-dir", str(glue), "--teacher", str(teacher), "--damps", "0.01,1.0",
                 "--noise", "0.1", "--draws", "1", "--results", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    assert len(r["m1"]) == 12 and all(0 <= x["reproduced"] <= 1 and 0 < x["moved_a"] < 1 for x in r["m1"].values())
    assert set(r["m2_layers"]) == {"0.01", "1.0"}
    for d in r["m2_layers"].values():  # ADMM on the metric's mask leaves no more error than OBS on it where fitted
        assert all(x["fit"]["admm_fixed_mask"] <= x["fit"]["obs"] for x in d.values())
    assert list(r["models"]) == ["default (obs)", "admm", "admm_fixed_mask"]
    fixed = r["models"]["admm_fixed_mask"]["projection"]
    assert fixed["calib_batches"] == 64 and fixed["damp"] == 0.1
    assert all(set(m["m6"]) == {"16 batches, percentile", "16 batches, max", "64 batches, percentile",
                                "64 batches, max"} and "0.1" in m["m2_noise"]["noise"] for m in r["models"].values())
    md = (out / "results.md").read_text()
    assert "## M1" in md and "## M2 (a)" in md and "## M2 (b)" in md and "## M6" in md


def test_the_r2_check_sweeps_tau_and_chooses_by_reproducibility(tmp_path):
    """r2: the stable free mask at each tau moves no more of the mask as tau grows, and the choice is the
    smallest tau whose moves reproduce enough (choose_tau's rule, checked on a record of known numbers)."""
    from bench.accuracy.admm_checks import choose_tau, main
    from tests.helpers.checkpoints import write_glue
    from tests.helpers.tiny import make_tiny_bert

    teacher = make_tiny_bert(tmp_path / "tiny", hidden=32, intermediate=64)
    glue = write_glue(tmp_path / "glue", train_rows=600)
    out = tmp_path / "out"
    assert main(["--task", "sst2", "--data-dir", str(glue), "--teacher", str(teacher), "--checks", "r2",
                 "--taus", "0,0.5,1000", "--results", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    moved = {tau: sum(x["moved_a"] for x in rows.values()) for tau, rows in r["r2"].items()}
    assert moved["0"] >= moved["0.5"] >= moved["1000"] == 0 and moved["0"] > 0
    assert "## R2" in (out / "results.md").read_text() and "r2_choice" in r
    rows = lambda moved, rep: {"L": {"moved_a": moved, "reproduced": rep}}  # noqa: E731
    record = {"0": rows(0.2, 0.7), "0.1": rows(0.1, 0.92), "0.2": rows(0.05, 0.95), "5": rows(0.0, 0.0)}
    assert choose_tau(record, 0.9)[0] == 0.1
    assert choose_tau(record, 0.99) == (0.2, "none reaches 99 % of A's moves reproduced: the one whose moves "
                                              "reproduce most (95.0 %)")
    assert choose_tau({"5": rows(0.0, 0.0)}, 0.9)[0] is None


def test_the_admm_checks_help_and_bad_checks(capsys):
    import pytest

    from bench.accuracy.admm_checks import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "m1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--task", "sst2", "--data-dir", "x", "--teacher", "x", "--results", "x", "--checks", "m9"])
    assert "unknown check(s) m9" in capsys.readouterr().err
