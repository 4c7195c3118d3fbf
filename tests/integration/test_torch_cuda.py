"""The torch-cuda backend's exact INT8 reference on the real MiniLM weights and SST-2 rows."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from holoserve.backends import torch_cuda as tc  # noqa: E402
from holoserve.compress.checkpoint import CheckpointContents, save_checkpoint  # noqa: E402
from holoserve.compress.quant import calibrate_amax, input_quantizers  # noqa: E402
from holoserve.data.tasks import get_task  # noqa: E402
from tests.helpers.minilm import minilm_projected  # noqa: E402

pytestmark = pytest.mark.integration


def test_reference_kernel_matches_fake_quant_on_minilm_and_sst2(tmp_path):
    """Real MiniLM weights projected to 2:4 INT8, calibrated on real SST-2 rows: the exact INT8
    reference (codes, integer accumulation, dequant) reproduces the fake-quant logits."""
    data_dir = os.environ.get("HOLOSERVE_DATA_DIR")
    if not data_dir:
        pytest.skip("set HOLOSERVE_DATA_DIR to the GLUE folder to run integration tests")
    from tokenizers import Tokenizer

    from holoserve.data.glue import read_split

    src, model, layers, scales = minilm_projected()
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.enable_truncation(max_length=64)

    def batch(rows):
        enc = tok.encode_batch([r.text for r in rows])
        n = max(len(e.ids) for e in enc)
        ids = torch.zeros(len(enc), n, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, e in enumerate(enc):
            ids[j, : len(e.ids)] = torch.tensor(e.ids)
            mask[j, : len(e.ids)] = 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}

    train = read_split("sst2", "train", data_dir, limit=32)
    amax = calibrate_amax(model, layers, [batch(train)])
    art = save_checkpoint(model, src, tmp_path / "ckpt", CheckpointContents(task=get_task("sst2"),
        base_model="all-MiniLM-L6-v2", max_seq_length=64, sparse_layers=layers, weight_scales=scales,
        act_amax=amax))
    enc = tc.encoder_from_artifact(art, linear=tc.LinearOptions(kernel="reference", dtype=torch.float32))
    dev = batch(read_split("sst2", "dev", data_dir, limit=32))
    with torch.no_grad():
        got = enc(**dev)
        with input_quantizers(model, amax, layers):
            want = model(**dev).logits
    assert torch.allclose(got, want, atol=2e-2), (got - want).abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
