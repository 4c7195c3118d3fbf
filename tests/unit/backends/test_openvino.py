"""The OpenVINO backend runs the checkpoint's own QDQ model (the openvino export) and `auto` picks the
faster CPU backend by measuring both here, saying so."""
import numpy as np
import pytest

pytest.importorskip("openvino")

from holoserve.backends import load_backend  # noqa: E402
from holoserve.backends.auto import select_backend  # noqa: E402
from holoserve.core.artifact import load_artifact  # noqa: E402
from holoserve.core.tokenizer import TextEncoder, pad_batch  # noqa: E402
from tests.unit.export.test_export import exported  # noqa: E402,F401  (the fixture: a calibrated tiny checkpoint)


@pytest.fixture(scope="module")
def with_openvino(exported):
    from holoserve.export.onnx_export import export_checkpoint

    ckpt, _ = exported
    res = export_checkpoint(ckpt, ["openvino"], progress=False, polygraphy=False)
    return ckpt, res


def test_openvino_export_runs_int8_gemms_and_matches_onnxruntime(with_openvino):
    ckpt, res = with_openvino
    entry = res.entries["openvino"]
    assert entry["file"] == "model.ov.onnx" and entry["placement"] == "onnxruntime"
    assert not [op for op in entry["ops"] if op in ("MatMulIntegerToFloat", "MultiHeadAttention")]
    v = entry["verification"]
    assert v["openvino_gemm_precisions"].get("u8", 0) >= entry["quantized_linears"] // 2  # INT8 GEMMs in OpenVINO
    assert "AMX" in v["openvino_sparse_weights"]
    art = load_artifact(ckpt)
    ov, ort = load_backend("openvino", art, threads=1), load_backend("onnxruntime", art, threads=1)
    enc = TextEncoder(ckpt / "tokenizer.json", art.max_seq_length)
    batch = pad_batch(enc.encode(["a good film", "the plot is thin and the acting is worse", "fun"]), enc.pad_id)
    a, b = ov.infer(*batch), ort.infer(*batch)
    assert a.shape == b.shape == (3, art.num_labels) and a.dtype == np.float32
    assert np.abs(a - b).max() < 0.25 * max(1.0, float(np.abs(b).max()))  # both integer GEMMs; rounding differs
    info = ov.info()
    assert info["backend"] == "openvino" and "sparse_weights_decompression" in info


def test_auto_times_both_cpu_backends_and_says_which_won(with_openvino, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    ckpt, _ = with_openvino
    backend, decision = select_backend(load_artifact(ckpt), threads=1)
    assert decision["picked"] in ("openvino", "onnxruntime") and backend.name == decision["picked"]
    reason = decision["reason"]
    assert "fastest CPU backend on a warm-up batch" in reason and "openvino" in reason and "onnxruntime" in reason
    assert reason.count(" ms") == 2
