"""Datacenter TensorRT builds the TensorRT-placement export on an NVIDIA GPU."""
import importlib.util
import shutil

import pytest

from holoserve.export.engine import ShapeProfile
from tests.unit.export.test_engine import trt_export  # noqa: F401  (the fixture)

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None
pytestmark = pytest.mark.gpu


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAVE_TRT or shutil.which("nvidia-smi") is None,
                    reason="datacenter TensorRT (libnvinfer) and an NVIDIA GPU are not available on this machine")
def test_datacenter_tensorrt_builds_on_gpu(trt_export, tmp_path):
    from holoserve.export.engine import build_engine

    res = build_engine(trt_export / "model.trt.onnx", tmp_path / "gpu.plan", flavour="tensorrt",
                       profile=ShapeProfile((1, 1), (4, 16), (8, 32)))
    assert res.sidecar["target"]["gpu"] and res.sidecar["parser"]["accepted"]
