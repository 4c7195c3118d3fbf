"""Datacenter TensorRT on an NVIDIA GPU: build, report, cache and serve the TensorRT-placement export.

These are the steps a CPU cannot execute: the builder on a GPU, its inspector JSON and "(Sparsity)" log,
the timing cache, the backend's device buffers, and the start-up build into the engine cache.
"""
import importlib.util
import shutil

import numpy as np
import pytest

from holoserve.export.engine_settings import EngineBuildError, EngineOptions, ShapeProfile
from tests.unit.backends.test_backends import trt_ckpt  # noqa: F401  (checkpoint with both ONNX exports)
from tests.unit.export.test_engine import trt_export  # noqa: F401  (the fixture)

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.tensorrt,
    pytest.mark.skipif(not HAVE_TRT or shutil.which("nvidia-smi") is None,
                       reason="datacenter TensorRT (libnvinfer) and an NVIDIA GPU are not available on this machine"),
]
SMALL = ShapeProfile((1, 1), (4, 16), (8, 32))


def test_datacenter_tensorrt_builds_and_reports_per_gemm(trt_export, tmp_path):
    from holoserve.core.sidecar import current_gpu
    from holoserve.export.engine import build_engine

    res = build_engine(trt_export / "model.trt.onnx", tmp_path / "gpu.plan",
                       EngineOptions(flavour="tensorrt", profile=SMALL, log_path=tmp_path / "build.log"))
    side = res.sidecar
    gpu = current_gpu()
    assert side["target"]["gpu"] == gpu["name"] and side["parser"]["accepted"]
    lay = side["engine_layers"]
    assert lay is not None and lay["source"] == "engine inspector (JSON)"
    print("engine layers:", {k: v for k, v in lay.items() if k != "gemm_tactics"})
    if lay["gemm_layers"]:  # GEMMs visible (not all inside one fused region): INT8 is read from their formats
        assert lay["gemm_int8_inputs"] > 0
    gemms = side["sparsity"]["gemms"]
    assert len(gemms) == side["parser"]["weight_gemms"] == 12
    assert all(g["sparse"] in (True, False, None) and g["why"] for g in gemms)
    print("sparsity:", side["sparsity"]["verdict"])
    for g in gemms:
        print(f"  {g['sparse']!s:5} {g['gemm']} <- {g['engine_layer']}: {g['why']}")
    print("precision:", side["precision"], side["precision_outside_qdq"])
    # --require-sparse agrees with the report
    if side["sparsity"]["sparse_gemms"]:
        build_engine(trt_export / "model.trt.onnx", tmp_path / "req.plan",
                     EngineOptions(flavour="tensorrt", profile=SMALL, require_sparse=True))
    else:
        with pytest.raises(EngineBuildError, match="--require-sparse"):
            build_engine(trt_export / "model.trt.onnx", tmp_path / "req.plan",
                         EngineOptions(flavour="tensorrt", profile=SMALL, require_sparse=True))
        assert not (tmp_path / "req.plan").exists()


def test_timing_cache_is_reused_and_a_foreign_one_replaced(trt_export, tmp_path):
    from holoserve.export.engine import build_engine

    cache = tmp_path / "timing.cache"
    onnx = trt_export / "model.trt.onnx"
    first = build_engine(onnx, tmp_path / "a.plan",
                         EngineOptions(flavour="tensorrt", profile=SMALL, timing_cache=cache))
    assert first.sidecar["timing_cache"] == "timing.cache: created" and cache.stat().st_size > 0
    second = build_engine(onnx, tmp_path / "b.plan",
                          EngineOptions(flavour="tensorrt", profile=SMALL, timing_cache=cache))
    assert second.sidecar["timing_cache"] == "timing.cache: reused"
    foreign = tmp_path / "foreign.cache"
    foreign.write_bytes(b"not a cache from this GPU" * 40)
    third = build_engine(onnx, tmp_path / "c.plan",
                         EngineOptions(flavour="tensorrt", profile=SMALL, timing_cache=foreign))
    assert third.sidecar_path.is_file() and "fresh cache" in third.sidecar["timing_cache"]


def test_engine_serves_like_onnxruntime(trt_ckpt, tmp_path):
    from holoserve.backends import load_backend
    from holoserve.cli import main
    from holoserve.core.artifact import load_artifact
    from holoserve.core.tokenizer import TextEncoder, pad_batch

    ckpt = tmp_path / "ckpt"
    shutil.copytree(trt_ckpt, ckpt)
    assert main(["build-engine", str(ckpt), "--max", "8x32", "--opt", "4x16", "--flavour", "tensorrt"]) == 0
    art = load_artifact(ckpt)
    enc = TextEncoder(ckpt / "tokenizer.json", art.max_seq_length)
    batch = pad_batch(enc.encode(["good", "the movie was awful and boring", "i loved it"] * 4))
    ort = load_backend("onnxruntime", art, threads=1).infer(*batch)
    with load_backend("tensorrt", art) as be:
        assert be.info()["engine_source"] == "the checkpoint"
        out = be.infer(*batch)  # 12 rows > the profile's 8: split into two runs
        assert out.shape == ort.shape == (12, art.num_labels) and out.dtype == np.float32
        np.testing.assert_allclose(out, ort, atol=0.15)
    assert be.mem.closed


def test_engine_built_at_start_up_and_reused(trt_ckpt, tmp_path):
    from holoserve.backends import load_backend
    from holoserve.core.artifact import load_artifact

    art = load_artifact(trt_ckpt)
    cache = tmp_path / "engines"
    be = load_backend("tensorrt", art, engine_cache=str(cache), build_engine="if-missing", max_batch=8)
    assert be.info()["engine_source"].startswith("the engine cache")
    plan = be.plan_path
    mtime = plan.stat().st_mtime_ns
    be.close()
    be = load_backend("tensorrt", art, engine_cache=str(cache), build_engine="if-missing", max_batch=8)
    assert be.plan_path == plan and plan.stat().st_mtime_ns == mtime
    be.close()
