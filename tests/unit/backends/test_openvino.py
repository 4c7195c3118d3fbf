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


def test_openvino_precision_f32_is_set_reported_and_served(with_openvino):
    """--openvino-precision f32 keeps OpenVINO's float ops in float32 (its CPU default is bf16 where the CPU has
    bf16 units); the backend, the server's backend choice and the export's check all report what ran."""
    from holoserve.server.config import ServerConfig
    from holoserve.server.service import open_backend

    ckpt, _ = with_openvino
    art = load_artifact(ckpt)
    ov = load_backend("openvino", art, threads=1, openvino_precision="f32")
    info = ov.info()
    assert info["inference_precision"] == "f32"
    assert set(info["gemm_precisions"]) <= {"u8", "i8", "f32"}, info["gemm_precisions"]  # nothing in bf16/f16
    served, decision = open_backend(ServerConfig(artifact_dir=str(ckpt), backend="openvino", threads=1,
                                                 openvino_precision="f32"), art)
    assert served.info()["inference_precision"] == "f32" and decision["picked"] == "openvino"
    enc = TextEncoder(ckpt / "tokenizer.json", art.max_seq_length)
    batch = pad_batch(enc.encode(["a good film", "the plot is thin"]), enc.pad_id)
    np.testing.assert_array_equal(served.infer(*batch), ov.infer(*batch))


def test_openvino_export_check_runs_at_the_requested_precision(exported, tmp_path):
    from holoserve.export.onnx_export import export_checkpoint

    ckpt, _ = exported
    res = export_checkpoint(ckpt, ["openvino"], progress=False, polygraphy=False, out_dir=tmp_path / "ov",
                            openvino_precision="f32")
    assert res.entries["openvino"]["verification"]["openvino_inference_precision"] == "f32"


def test_bad_openvino_precision_names_the_choices():
    from holoserve import HoloServeError
    from holoserve.backends.openvino import compile_model
    from holoserve.export.onnx_export import ExportOptions
    from holoserve.server.config import ServerConfig

    with pytest.raises(HoloServeError, match="unknown OpenVINO precision 'fp64'.*f32"):
        compile_model("unused.onnx", precision="fp64")
    with pytest.raises(HoloServeError, match="unknown OpenVINO precision 'f64'"):
        ExportOptions(openvino_precision="f64").validate()
    with pytest.raises(HoloServeError, match="openvino precision 'fp16' is not one of auto, f32, bf16, f16"):
        ServerConfig(openvino_precision="fp16").validate()
