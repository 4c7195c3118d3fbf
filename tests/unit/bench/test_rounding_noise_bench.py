"""bench/accuracy/rounding_noise.py on the tiny export: each draw perturbs the position table (so larger eps
moves the logits more), every draw and summary is recorded, and a runtime that cannot run says why."""
import json

import numpy as np
import pytest

from tests.helpers.bench import bench_module
from tests.unit.export.test_export import _tiny_sst2_dir, exported  # noqa: F401  (the fixture)


def test_rounding_noise_records_each_draw_and_why_a_runtime_did_not_run(exported, tmp_path):
    mod = bench_module("accuracy", "rounding_noise")
    ckpt, _ = exported
    out = tmp_path / "res"
    assert mod.main([str(ckpt), "--data-dir", str(_tiny_sst2_dir(tmp_path)), "--eps", "1e-6,1e-1", "--repeats", "2",
                     "--results", str(out)]) == 0
    r = json.loads((out / "rounding_noise.json").read_text())
    assert r["meta"]["rows"] == 8 and r["meta"]["table"].endswith("position_embeddings.weight")
    small, large = r["perturbed"]
    assert [d["seed"] for d in small["draws"]] == [0, 1] and small["summary"]["draws"] == 2
    assert large["summary"]["mean_abs_logit_diff"] > small["summary"]["mean_abs_logit_diff"] > 0
    for row in r["perturbed"]:
        s = row["summary"]
        diffs = np.asarray([d["metric_diff_points"] for d in row["draws"]])
        assert (s["metric_diff_mean"] == pytest.approx(diffs.mean())
                and s["past_threshold"] == int((abs(diffs) > 0.2).sum()))
        assert all(0 <= d["flipped_predictions"] <= 8 for d in row["draws"])
    # the fixture has no openvino export: both OpenVINO rows say so instead of vanishing
    assert all("--target openvino" in r["runtimes"][k]["skipped"] for k in ("OpenVINO f32", "OpenVINO auto"))
    md = (out / "rounding_noise.md").read_text()
    assert "| eps 1e-06 |" in md and "| eps 0.1 |" in md and "Not run: OpenVINO f32: no openvino export" in md
    assert (out / "rounding_noise.png").stat().st_size > 0
    assert small["summary"]["export_check_passes"] == 2  # 1e-6 changes nothing the export check would refuse
    assert (r["meta"]["command"].startswith('python -m bench.accuracy.rounding_noise ')
            and '--data-dir "$GLUE_DIR"' in r["meta"]["command"]
            and str(tmp_path) not in r["meta"]["command"].replace(str(out), ""))


def test_rounding_noise_refuses_bad_options(exported, tmp_path):
    mod = bench_module("accuracy", "rounding_noise")
    with pytest.raises(SystemExit, match="comma-separated numbers"):
        mod.main([str(exported[0]), "--data-dir", str(tmp_path), "--eps", "small"])
    with pytest.raises(SystemExit, match="at least 2"):
        mod.main([str(exported[0]), "--data-dir", str(tmp_path), "--repeats", "1"])


def test_layer_divergence_compares_every_quantizer_and_layernorm(exported, tmp_path):
    """bench/accuracy/layer_divergence.py: one row per activation quantizer and LayerNorm, in graph order,
    for OpenVINO and for a perturbed ONNX Runtime run; the unperturbed graph against itself changes nothing."""
    import shutil

    pytest.importorskip("openvino", reason="OpenVINO is an optional extra (the dev install has it)")
    from holoserve.export.onnx_export import export_checkpoint

    mod = bench_module("accuracy", "layer_divergence")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported[0], ckpt)
    export_checkpoint(ckpt, ["openvino"], progress=False, polygraphy=False, verify_exports=False)
    glue = _tiny_sst2_dir(tmp_path)
    for extra, name in (([], "ov"), (["--perturb", "0"], "zero"), (["--perturb", "0.05"], "noisy")):
        assert mod.main([str(ckpt), "--data-dir", str(glue), "--results", str(tmp_path / name), *extra]) == 0
    ov, zero, noisy = (json.loads((tmp_path / n / "layer_divergence.json").read_text())
                       for n in ("ov", "zero", "noisy"))
    kinds = [t["kind"] for t in ov["tensors"]]
    layers = 2  # make_calibrated_checkpoint's default: 4 activation quantizers and 2 LayerNorms per layer
    assert kinds.count("codes") == 4 * layers and kinds.count("layernorm") == 1 + 2 * layers
    assert ov["meta"]["against"].startswith("OpenVINO") and ov["meta"]["rows"] == 8
    assert all(t["changed_share"] == 0 for t in zero["tensors"] if t["kind"] == "codes")
    assert zero["meta"]["logits_max_abs_diff"] == 0.0
    assert any(t["changed_share"] > 0 for t in noisy["tensors"] if t["kind"] == "codes")
    assert ('--data-dir "$GLUE_DIR"' in noisy["meta"]["command"]
            and (tmp_path / "noisy" / "layer_divergence.png").is_file())
