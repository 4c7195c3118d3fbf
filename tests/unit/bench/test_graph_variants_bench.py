"""bench/cpu_latency/graph_variants.py: the rewrites it times compute what the export computes."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from tests.helpers.bench import bench_module
from tests.unit.export.test_export import _feeds, exported  # noqa: F401  (the fixture)


@pytest.fixture(scope="module")
def ov_export(exported):
    from holoserve.export.onnx_export import export_checkpoint

    ckpt, _ = exported
    export_checkpoint(ckpt, ["openvino"], progress=False, polygraphy=False, verify_exports=False)
    return ckpt


def _run(path, feed):
    from holoserve.core.ort import session

    return session(path, threads=1, quiet=True).run(None, feed)[0]


@pytest.mark.parametrize("variant", ["qkv_fused", "kv_folded", "int8_attention"])
def test_each_rewrite_changes_the_graph_and_keeps_the_logits(ov_export, tmp_path, variant):
    gv = bench_module("cpu_latency", "graph_variants")
    src = ov_export / "model.ov.onnx"
    cfg = json.loads((ov_export / "config.json").read_text())
    feeds = [_feeds(cfg["vocab_size"], 3, 16, seed=s) for s in range(2)]
    padded = _feeds(cfg["vocab_size"], 2, 16, seed=9)
    padded["attention_mask"][1, 5:] = 0
    got = gv.build(src, variant, tmp_path / "v.onnx", cfg["num_attention_heads"], feeds)
    before, after = onnx.load(str(src)).graph.node, onnx.load(str(tmp_path / "v.onnx")).graph.node
    ops = lambda nodes, op: sum(n.op_type == op for n in nodes)  # noqa: E731
    layers = cfg["num_hidden_layers"]
    if variant == "qkv_fused":  # Q, K, V as one MatMul per layer (K and V in the [CLS]-row layer)
        assert got == {"rewritten": layers} and ops(after, "Split") == layers
        assert ops(after, "MatMul") == ops(before, "MatMul") - 2 * layers + 1
    elif variant == "kv_folded":  # the last layer's two per-token projections go, four small MatMuls come
        assert got == {"rewritten": 1} and ops(after, "MatMul") == ops(before, "MatMul") - 2 - 2 + 4
    else:
        assert got == {"rewritten": layers}
        assert ops(after, "QuantizeLinear") == ops(before, "QuantizeLinear") + 4 * layers
    # the Kᵀ head splits are back as the export writes them for OpenVINO (the folded layer has no K)
    perms = [list(a.ints) for n in after if n.op_type == "Transpose" for a in n.attribute if a.name == "perm"]
    assert [0, 2, 3, 1] not in perms and perms.count([0, 1, 3, 2]) == layers - (variant == "kv_folded")
    for feed in feeds + [padded]:
        a, b = _run(src, feed), _run(tmp_path / "v.onnx", feed)
        if variant == "int8_attention":  # not exact: quantized attention, the predictions mostly kept
            assert np.abs(a - b).max() < 0.5 * np.abs(a).max() and not np.array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


def test_the_script_times_every_rewrite_on_openvino(ov_export, tmp_path):
    pytest.importorskip("openvino")
    gv = bench_module("cpu_latency", "graph_variants")
    assert gv.main([str(ov_export), "--batches", "1", "--seq", "16", "--runs", "3", "--warmup", "1",
                    "--out", str(tmp_path), "--name", "gv"]) == 0
    r = json.loads((tmp_path / "gv.json").read_text())
    assert [x["variant"] for x in r["rows"]] == ["qkv_fused", "kv_folded", "int8_attention"]
    assert all(x["unchanged_ms"] > 0 and x["variant_ms"] > 0 for x in r["rows"])
    assert "| kv_folded | 1 |" in (tmp_path / "gv.md").read_text()
    with pytest.raises(SystemExit, match="unknown"):
        gv.main([str(ov_export), "--variants", "nope", "--out", str(tmp_path)])


def test_int8_gemm_rate_runs_each_shape_as_an_int8_gemm(tmp_path, monkeypatch):
    pytest.importorskip("openvino")
    rate = bench_module("cpu_latency", "int8_gemm_rate")
    monkeypatch.setattr(rate, "SHAPES", (("small", 16, 64, 32), ("larger", 64, 128, 64)))
    assert rate.main(["--seconds", "0.05", "--out", str(tmp_path), "--name", "g"]) == 0
    r = json.loads((tmp_path / "g.json").read_text())
    assert [x["shape"] for x in r["rows"]] == ["small", "larger"]
    for x in r["rows"]:  # OpenVINO really ran the Q/DQ + MatMul as an 8-bit GEMM
        assert set(x["gemm_precision"]) <= {"i8", "u8"} and x["gmacs_per_s"] > 0 and x["runs"] >= 5
    assert max(x["share_of_best"] for x in r["rows"]) == 1.0
    assert "| larger | 64 x 128 x 64 |" in (tmp_path / "g.md").read_text()
