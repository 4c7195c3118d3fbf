"""bench.cpu_latency.ort_exact_path and bench.cpu_latency.switching run end to end on a tiny exported checkpoint
and print each line they promise (the timings themselves are the benchmark's, not the test's)."""
import re

import pytest

pytest.importorskip("openvino")

from tests.unit.backends.test_openvino import with_openvino  # noqa: F401  (an exported tiny checkpoint)
from tests.unit.export.test_export import exported  # noqa: F401


def test_ort_exact_path_times_both_paths_and_compares_their_logits(with_openvino, capsys):
    from bench.cpu_latency import ort_exact_path

    ckpt, _ = with_openvino
    ort_exact_path.main([str(ckpt), "--shapes", "1x8,4x16", "--runs", "2"])
    out = capsys.readouterr().out
    assert re.search(r"the default saturates here: (True|False)", out)
    rows = [x for x in out.splitlines() if re.match(r"\d+ x \d+: ", x)]
    assert [r.split(":")[0] for r in rows] == ["1 x 8", "4 x 16"]
    for r in rows:
        assert re.fullmatch(r"\d+ x \d+: [\d.]+ / [\d.]+ ms, [\d.]+x, \S+", r), r


def test_switching_times_every_way_ort_threads_wait(with_openvino, capsys):
    from bench.cpu_latency import switching

    ckpt, _ = with_openvino
    switching.main([str(ckpt), "--small", "1x8", "--large", "4x12", "--runs", "2"])
    out = capsys.readouterr().out
    assert "(static shape 4x16)" in out
    for label in switching.LABELS.values():
        line = next(x for x in out.splitlines() if x.startswith(f"ONNX Runtime threads {label}: "))
        assert "right after OpenVINO" in line and "right after ONNX Runtime" in line and "16x32 " in line


def test_light_load_times_one_row_batches_after_each_pause(with_openvino, tmp_path, capsys):
    import json

    from bench.cpu_latency import light_load

    ckpt, _ = with_openvino
    texts = tmp_path / "texts.txt"
    texts.write_text("a short one\na somewhat longer sentence than that\nthird\n", encoding="utf-8")
    light_load.main([str(ckpt), "--texts", str(texts), "--pauses", "0,1", "--rounds", "1", "--per-round", "2",
                     "--out", str(tmp_path / "out")])
    record = json.loads((tmp_path / "out" / "light-load.json").read_text())
    timed = set(record["median_ms"]["0"])
    assert {"onnxruntime", "openvino"} <= timed and set(record["median_ms"]) == {"0", "1"}
    # what was not timed says why, and everything else was
    assert timed | set(record["left_out"]) == {"onnxruntime", "openvino", "openvino static", "openvino 2:4 kernels"}
    assert all(record["vs_onnxruntime"][p]["onnxruntime"] == 1.0 for p in ("0", "1"))
    assert (tmp_path / "out" / "light-load.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "| pause ms | onnxruntime | openvino" in out and "| light-load route |" in out
    assert set(record["moderate_load_ms"]) == {"onnxruntime", "openvino", "light-load route"}
    assert all(set(by) == {"1 row", "4 rows"} and min(by.values()) > 0 for by in record["moderate_load_ms"].values())
