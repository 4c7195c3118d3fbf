"""bench/serve_load/versus.py: ours against the dense model on the same server. The argument checks and the
two servers' flags on their own, and the whole run on the CPU (ONNX Runtime for ours, the torch backend in
FP32 for the dense model, tiny checkpoint, short levels); on a GPU it runs torch-cuda against FP16."""
from __future__ import annotations

import json

import pytest

from bench.serve_load import versus


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    return tmp_path / "ckpt"


def test_defaults_are_the_gpu_comparison(ckpt):
    args = versus.parse_args(["--checkpoint", str(ckpt)])
    assert ((args.backend, args.route, args.dense_precision, args.dense_compile)
            == ("torch-cuda", "sparse", "fp16", False))
    assert args.levels == [1, 32, 128] and args.batch_size == 32


@pytest.mark.parametrize("argv,message", [
    (["--clients", "1,x"], "--clients takes whole numbers separated by commas"),
    (["--clients", "0,32"], "each >= 1"),
    (["--duration", "0"], "--duration must be > 0 seconds"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--max-requests", "1", "--rounds", "2"], "must be >= --rounds"),
    (["--backend", "onnxruntime", "--route", "auto"], "with --backend onnxruntime leave it out"),
    (["--dense-checkpoint", "/nonexistent/teacher"], "--dense-checkpoint /nonexistent/teacher: no checkpoint there"),
    (["--dense-precision", "bf16"], "invalid choice: 'bf16'"),
])
def test_bad_arguments_are_usage_errors_naming_the_fix(ckpt, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        versus.parse_args(["--checkpoint", str(ckpt), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_two_servers_batch_alike_and_differ_in_backend(ckpt, tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text("{}")
    plans = versus.server_plans(versus.parse_args(["--checkpoint", str(ckpt), "--batch-size", "64", "--route",
                                                   "sparse", "--dense-compile", "--dense-checkpoint", str(teacher)]))
    ours, dense = plans["ours"], plans["dense"]
    assert (ours["backend"], dense["backend"]) == ("torch-cuda", "torch")
    assert ours["checkpoint"] == ckpt and dense["checkpoint"] == teacher
    common = ["--max-batch-size", "64", "--max-queue-delay-ms", "0.0", "--max-queue-size", "512", "--no-access-log"]
    assert ours["args"] == common + ["--torch-cuda-route", "sparse"]
    assert dense["args"] == common + ["--torch-precision", "fp16", "--torch-compile"]
    plain = versus.server_plans(versus.parse_args(["--checkpoint", str(ckpt), "--backend", "onnxruntime",
                                                   "--dense-precision", "fp32"]))
    assert plain["dense"]["checkpoint"] == ckpt and "--torch-cuda-route" not in plain["ours"]["args"]
    assert "--torch-compile" not in plain["dense"]["args"] and "served dense" in plain["dense"]["weights"]


def _level(c, ours, dense, statuses=None):
    lv = lambda rps: {"throughput_rps": rps, "status_counts": statuses or {"200": 10},  # noqa: E731
                      "transport_errors": 0}
    return {"clients": c, "ours": lv(ours), "dense": lv(dense), "throughput_ratio": round(ours / dense, 3)}


def test_summary_reads_the_ratio_at_32_clients_against_the_target():
    s = versus.summary({"levels": [_level(1, 100, 100), _level(32, 300, 150)]})
    assert s["throughput_ratio_32"] == 2.0 and s["target_met"] and s["non_200_or_transport_errors"] == 0
    s = versus.summary({"levels": [_level(32, 140, 100, {"200": 5, "503": 2})]})
    assert (s["throughput_ratio_32"] == 1.4 and not s["target_met"]
            and s["non_200_or_transport_errors"] == 4)  # 2 per server
    assert "throughput_ratio_32" not in versus.summary({"levels": [_level(1, 100, 100)]})
    info = {"routes": {"16x64": "int_mm", "1x16": "int_mm", "2x16": "cslt"}}
    assert versus.dense_buckets(info) == ["1x16", "16x64"] and versus.dense_buckets({}) == []


def test_fp16_dense_model_without_a_gpu_says_to_use_fp32(ckpt):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("checks the message given where torch sees no GPU")
    with pytest.raises(SystemExit, match="pass --dense-precision fp32"):
        versus.main(["--checkpoint", str(ckpt)])


def test_whole_run_on_the_cpu(sst2, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    out = tmp_path / "out"
    assert versus.main(["--checkpoint", str(sst2), "--backend", "onnxruntime", "--dense-precision", "fp32",
                        "--clients", "1,2", "--duration", "0.6", "--rounds", "1", "--out", str(out),
                        "--ready-s", "120"]) == 0
    res = json.loads((out / "serve_versus.json").read_text())
    assert [lv["clients"] for lv in res["levels"]] == [1, 2]
    for lv in res["levels"]:
        assert lv["ours"]["ok"] > 0 and lv["dense"]["ok"] > 0 and lv["throughput_ratio"] > 0
    assert res["servers"]["ours"]["backend_info"]["backend"] == "onnxruntime"
    dense = res["servers"]["dense"]["backend_info"]
    assert dense["backend"] == "torch" and dense["precision"].startswith("fp32") and dense["compiled"] is False
    assert res["summary"]["non_200_or_transport_errors"] == 0
    md = (out / "serve_versus.md").read_text()
    assert "| 2 |" in md and "dense fp32" in md
    assert sorted(p.name for p in out.iterdir()) == ["serve_versus.json", "serve_versus.md"]


def test_token_budget_run_on_the_cpu(sst2, tmp_path):
    """serve_load.run's --token-budgets mode takes its alternating rounds from the same helper as versus."""
    pytest.importorskip("onnxruntime")
    from bench.serve_load import run as serve_load

    out = tmp_path / "out"
    assert serve_load.main(["--checkpoint", str(sst2), "--clients", "2", "--duration", "0.6", "--rounds", "1",
                            "--token-budgets", "256", "--out", str(out)]) == 0
    res = json.loads((out / "serve_load_tokens.json").read_text())
    for mode in ("count", "tokens_256"):
        (level,) = res["modes"][mode]["levels"]
        assert level["clients"] == 2 and level["ok"] > 0 and level["mean_batch"] > 0


def test_versions_run_on_the_cpu(sst2, tmp_path):
    """serve_load.versions: this checkout's server against a baseline checkout's (this one again here), through
    the same alternating rounds, with each server's CPU time per request and the ratios."""
    pytest.importorskip("onnxruntime")
    from bench.serve_load import versions
    from bench.serve_load.run import REPO

    out = tmp_path / "out"
    assert versions.main(["--checkpoint", str(sst2), "--baseline-root", str(REPO), "--clients", "2",
                          "--duration", "0.6", "--rounds", "1", "--out", str(out)]) == 0
    res = json.loads((out / "versions_short.json").read_text())
    (level,) = res["levels"]
    assert len(level["servers"]) == 2
    for r in level["servers"].values():
        assert r["clients"] == 2 and r["ok"] > 0 and r["server_cpu_ms_per_request"] > 0
    assert set(res["ratios"]["2"]) == {"throughput", "p50", "cpu_per_request"}
    assert "server CPU ms / request" in (out / "versions_short.md").read_text()
