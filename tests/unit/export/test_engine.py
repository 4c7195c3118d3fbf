"""`holoserve build-engine`: flag selection per TensorRT flavour, profiles, log parsing, sidecar checks, the GPU
probe, and real TensorRT-RTX parses + ahead-of-time builds (pinned SM80, and the portable default) of the exported
TensorRT-placement ONNX on CPU."""
from __future__ import annotations

import importlib.util
import json

import pytest

from holoserve.export import engine_settings as settings_mod
from holoserve.export.engine_report import parse_layer_info, parse_sparsity_log, summarize_layers
from holoserve.export.engine_settings import (
    EngineBuildError,
    EngineOptions,
    Flavour,
    ShapeProfile,
    build_target,
    builder_settings,
    cc_label,
    load_trt,
    parse_shape,
    parse_size,
    rtx_targets,
)
from holoserve.core import sidecar as sidecar_mod
from holoserve.core.sidecar import (
    EngineMismatchError,
    check_compatible,
    engine_cache_dir,
    normalize_cc,
    pick_visible_gpu,
    read_sidecar,
)

HAVE_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
HAVE_TRT = importlib.util.find_spec("tensorrt") is not None
needs_rtx = pytest.mark.skipif(not HAVE_RTX, reason="TensorRT-RTX (pip install 'holoserve[tensorrt]') is not installed")


# ------------------------------------------------------------------------------------------ plain functions


def test_flags_per_flavour():
    trt10 = Flavour("tensorrt", "10.13.0.35")
    assert not trt10.strongly_typed
    assert builder_settings(trt10) == {"network": [], "builder": ["INT8", "FP16", "SPARSE_WEIGHTS"]}
    assert builder_settings(trt10, fp16=False, sparse=False) == {"network": [], "builder": ["INT8"]}
    trt11 = Flavour("tensorrt", "11.0.0")
    assert trt11.strongly_typed and not trt11.aot
    assert builder_settings(trt11) == {"network": ["STRONGLY_TYPED"], "builder": ["SPARSE_WEIGHTS"]}
    rtx = Flavour("tensorrt_rtx", "1.7.1.116")
    assert rtx.strongly_typed and rtx.aot and rtx.name == "tensorrt-rtx"
    assert builder_settings(rtx, sparse=False) == {"network": ["STRONGLY_TYPED"], "builder": []}
    # INT8/FP16 flags: deprecated from 10.12 (still set there), gone in 11
    assert trt10.precision_flags_deprecated and not Flavour("tensorrt", "10.5.0.18").precision_flags_deprecated
    assert Flavour("tensorrt", "10.16.0.72").precision_flags_deprecated and not trt11.precision_flags_deprecated


def test_shapes_and_sizes():
    assert parse_shape("8x128") == (8, 128) and parse_shape(" 1 X 1 ") == (1, 1)
    with pytest.raises(EngineBuildError, match="BATCHxSEQUENCE"):
        parse_shape("8by128")
    assert parse_size("2G") == 2 << 30 and parse_size("512M") == 512 << 20 and parse_size("1024") == 1024
    assert parse_size(None) is None
    with pytest.raises(EngineBuildError):
        parse_size("lots")
    p = ShapeProfile((1, 1), (8, 64), (32, 128)).validate(128)
    assert p.shapes(["input_ids"]) == {"input_ids": {"min": [1, 1], "opt": [8, 64], "max": [32, 128]}}
    with pytest.raises(EngineBuildError, match="min <= opt <= max"):
        ShapeProfile((1, 1), (64, 64), (32, 128)).validate()
    with pytest.raises(EngineBuildError, match="exceeds the model"):
        ShapeProfile((1, 1), (8, 64), (32, 512)).validate(128)
    with pytest.raises(EngineBuildError, match="at least 1"):
        ShapeProfile((0, 1), (8, 64), (32, 128)).validate()


def test_compute_capability_labels():
    assert cc_label("8.0") == "SM80" and cc_label("sm_86") == "SM86" and cc_label("SM120") == "SM120"
    assert normalize_cc("9.0") == "SM90" and normalize_cc(None) is None
    with pytest.raises(EngineBuildError, match="not like 8.0 or SM80"):
        cc_label("ampere")


def test_build_targets():
    rtx = Flavour("tensorrt_rtx", "1.7.1.116")
    assert rtx_targets(None) == [] and rtx_targets("portable") == []
    assert rtx_targets("8.6") == ["SM86"] and rtx_targets("SM86, sm_89,SM86") == ["SM86", "SM89"]
    with pytest.raises(EngineBuildError, match="cannot build for SM90.*portable engine"):
        rtx_targets("9.0")
    portable = build_target(rtx, None)
    assert portable["portable"] and portable["compute_capabilities"] == ["SM80", "SM86", "SM89", "SM120"]
    assert build_target(rtx, "SM86")["compute_capability"] == "SM86"
    assert build_target(rtx, "SM86,SM89")["compute_capabilities"] == ["SM86", "SM89"]
    # datacenter TensorRT: the GPU it runs on; a different --compute-capability is refused, not ignored
    dc = Flavour("tensorrt", "10.5.0.18")
    a10 = {"name": "NVIDIA A10", "compute_capability": "8.6", "device": 1, "source": "cuda"}
    t = build_target(dc, None, gpu=a10)
    assert t["compute_capability"] == "SM86" and t["gpu"] == "NVIDIA A10" and t["device"] == 1
    assert build_target(dc, "8.6", gpu=a10)["compute_capability"] == "SM86"
    with pytest.raises(EngineBuildError, match="builds for the GPU it runs on.*SM80 cannot be honoured"):
        build_target(dc, "SM80", gpu=a10)


def test_datacenter_target_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(settings_mod, "current_gpu", lambda: None)
    with pytest.raises(EngineBuildError, match="no GPU was found"):
        build_target(Flavour("tensorrt", "10.5.0.18"))


# ------------------------------------------------------------------------------------------ the GPU probe


class _Prop:
    def __init__(self, name, major, minor):
        self.name, self.major, self.minor = name, major, minor


class _FakeCudart:
    """cuda-python's runtime API as far as the probe uses it: the current device is 1 (CUDA_VISIBLE_DEVICES=2,3)."""

    def cudaGetDevice(self):
        return 0, 1

    def cudaGetDeviceProperties(self, dev):
        props = {0: _Prop(b"NVIDIA A100-SXM4-80GB\x00\x00", 8, 0), 1: _Prop(b"NVIDIA L4\x00", 8, 9)}
        return 0, props[dev]


def test_current_gpu_asks_cuda_for_the_current_device(monkeypatch):
    monkeypatch.setattr(sidecar_mod, "_cudart", lambda: _FakeCudart())
    gpu = sidecar_mod.current_gpu()
    assert gpu == {"name": "NVIDIA L4", "compute_capability": "8.9", "device": 1, "source": "cuda"}
    assert settings_mod.gpu_info()["name"] == "NVIDIA L4"


def test_nvidia_smi_fallback_follows_cuda_visible_devices():
    rows = [["0", "GPU-aaaa-1111", "NVIDIA A100-SXM4-80GB", "8.0"], ["1", "GPU-bbbb-2222", "NVIDIA L4", "8.9"]]
    assert pick_visible_gpu(rows, None)[2] == "NVIDIA A100-SXM4-80GB"
    assert pick_visible_gpu(rows, "1")[2] == "NVIDIA L4"
    assert pick_visible_gpu(rows, "1,0")[2] == "NVIDIA L4"
    assert pick_visible_gpu(rows, "GPU-bbbb")[2] == "NVIDIA L4"
    assert pick_visible_gpu(rows, "") is None and pick_visible_gpu(rows, "-1") is None
    assert pick_visible_gpu(rows, "7") is None


def test_engine_cache_folders():
    side_dc = {"compute_capability": "SM86", "gpu": "NVIDIA A10"}
    d = engine_cache_dir("/cache", "ab" * 32, "tensorrt", "10.5.0.18", side_dc)
    assert d.as_posix() == "/cache/abababababababab/tensorrt-10.5.0.18-sm86-nvidia-a10"
    d = engine_cache_dir("/cache", "ab" * 32, "tensorrt-rtx", "1.7.1.116", {"portable": True})
    assert d.name == "tensorrt-rtx-1.7.1.116-portable"
    two = {"portable": True, "compute_capabilities": ["SM86", "SM89"]}
    assert (engine_cache_dir("/c", "ab" * 32, "tensorrt-rtx", "1.7.1.116", two).name
            == "tensorrt-rtx-1.7.1.116-sm86+sm89")


def test_parse_sparsity_log():
    lines = [
        "[I] [TRT] (Sparsity) Layers eligible for sparse math: fc1, fc2, qkv",
        "[V] something else",
        "[I] [TRT] (Sparsity) TRT inference plan picked sparse implementation for layers: fc2",
    ]
    assert parse_sparsity_log(lines) == {"reported": True, "eligible": ["fc1", "fc2", "qkv"], "picked_sparse": ["fc2"]}
    assert parse_sparsity_log(["nothing"]) == {"reported": False, "eligible": [], "picked_sparse": []}


LAYER_TEXT = (
    "Layers:\n"
    "Name: emb, LayerType: kgen, Inputs: [ { Name: input_ids, Dimensions: [-1,-1], Datatype: Int64, Format: x }], "
    "Constants: [ { Name: w, Dimensions: [10,4], Datatype: Int8, Format: x }], Outputs: [ { Name: e, "
    "Dimensions: [-1,4], Datatype: Float, Format: x }], TacticName: __myl_Gather_0x1, StreamId: 0, "
    "Metadata: [ONNX Layer: word_embeddings/Gather]\n"
    "Name: a/MatMul+b/MatMul, LayerType: gemm, Inputs: [ { Name: q, Dimensions: [-1,4], Datatype: Int8, "
    "Format: x }], Constants: [ { Name: wq, Dimensions: [4,4], Datatype: Int8, Format: x }], Outputs: [ { Name: o, "
    "Dimensions: [-1,4], Datatype: Int8, Format: x }], TacticName: sm80_xmma_sparse_gemm_i8i8, StreamId: 0, "
    "Metadata: [ONNX Layer: a/MatMul][ONNX Layer: b/MatMul]\n"
    "Name: c/MatMul, LayerType: gemm, Inputs: [ { Name: o, Dimensions: [-1,4], Datatype: Int8, Format: x }], "
    "Constants: [], Outputs: [ { Name: y, Dimensions: [-1,4], Datatype: Float, Format: x }], "
    "TacticName: __myelin_CASK_STUB, StreamId: 0, Metadata: [ONNX Layer: c/MatMul]\n"
)


def test_parse_layer_information():
    layers = parse_layer_info(LAYER_TEXT)
    assert [x["name"] for x in layers] == ["emb", "a/MatMul+b/MatMul", "c/MatMul"]
    assert layers[1]["input_types"] == ["Int8"] and layers[1]["constant_types"] == ["Int8"]
    assert layers[1]["output_types"] == ["Int8"] and layers[1]["onnx_layers"] == ["a/MatMul", "b/MatMul"]
    s = summarize_layers(layers)
    assert s["gemm_layers"] == 2 and s["gemm_int8_inputs"] == 2 and s["gemm_int8_in_int8_out"] == 1
    assert s["sparse_tactic_layers"] == ["a/MatMul+b/MatMul"] and s["onnx_matmuls_in_gemms"] == 3


def _sidecar(flavour="tensorrt-rtx", version="1.7.1.116", cc="SM80", gpu=None):
    return {"format": "holoserve-tensorrt-engine", "version": 1,
            "tensorrt": {"flavour": flavour, "version": version}, "target": {"compute_capability": cc, "gpu": gpu}}


def test_sidecar_compatibility():
    check_compatible(_sidecar(), flavour="tensorrt-rtx", version="1.7.1.116", compute_capability="8.0")
    check_compatible(_sidecar(), flavour="tensorrt-rtx", version="1.7.1.116", compute_capability=None)
    with pytest.raises(EngineMismatchError, match="built for NVIDIA A100.*SM80.*SM90"):
        check_compatible(_sidecar(flavour="tensorrt", version="10.13", gpu="NVIDIA A100"), flavour="tensorrt",
                         version="10.13", compute_capability="9.0", gpu="NVIDIA H100")
    with pytest.raises(EngineMismatchError, match="not portable across versions"):
        check_compatible(_sidecar(), flavour="tensorrt-rtx", version="1.8.0", compute_capability="8.0")
    with pytest.raises(EngineMismatchError, match="built with tensorrt-rtx"):
        check_compatible(_sidecar(), flavour="tensorrt", version="10.13", compute_capability="8.0")


@pytest.mark.parametrize("cc,ok", [("8.0", True), ("8.6", True), ("8.9", True), ("12.0", True), ("12.1", True),
                                   ("7.5", False), ("9.0", False), ("10.0", False)])
def test_portable_rtx_engine_compatibility(cc, ok):
    side = _sidecar(cc=None)
    side["target"].update(portable=True, compute_capabilities=["SM80", "SM86", "SM89", "SM120"])
    if ok:
        check_compatible(side, flavour="tensorrt-rtx", version="1.7.1.116", compute_capability=cc)
    else:
        with pytest.raises(EngineMismatchError, match="portable TensorRT-RTX engine.*--compute-capability SM"):
            check_compatible(side, flavour="tensorrt-rtx", version="1.7.1.116", compute_capability=cc)


def test_read_sidecar_errors(tmp_path):
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"x")
    with pytest.raises(EngineMismatchError, match="missing"):
        read_sidecar(plan)
    (tmp_path / "model.plan.json").write_text("{not json")
    with pytest.raises(EngineMismatchError, match="not valid JSON"):
        read_sidecar(plan)
    (tmp_path / "model.plan.json").write_text(json.dumps(_sidecar()))
    assert read_sidecar(plan)["tensorrt"]["version"] == "1.7.1.116"


def test_tensorrt_api_used_by_the_builder_exists():
    """The names build_engine calls exist in the TensorRT Python API (checked on TensorRT-RTX, same API)."""
    trt = pytest.importorskip("tensorrt_rtx", reason="no TensorRT Python package installed")
    for cls, names in [
        (trt.IBuilderConfig, ["create_timing_cache", "set_timing_cache", "get_timing_cache", "set_flag",
                              "num_compute_capabilities", "set_compute_capability", "profiling_verbosity",
                              "set_memory_pool_limit", "add_optimization_profile"]),
        (trt.ITimingCache, ["serialize"]),
        (trt.ICudaEngine, ["create_engine_inspector", "create_execution_context", "num_io_tensors"]),
        (trt.EngineInspector, ["get_engine_information", "execution_context"]),
        (trt.ILayer, ["metadata", "type", "name", "get_input", "get_output", "num_inputs", "num_outputs"]),
    ]:
        assert [n for n in names if not hasattr(cls, n)] == []
    from holoserve.export.engine_settings import RTX_COMPUTE_CAPABILITIES

    assert all(hasattr(trt.ComputeCapability, cc) for cc in RTX_COMPUTE_CAPABILITIES)
    assert trt.LayerInformationFormat.JSON is not None and trt.ProfilingVerbosity.DETAILED is not None


def test_unknown_flavour_is_a_clear_error():
    with pytest.raises(EngineBuildError, match="unknown TensorRT flavour"):
        load_trt("tensorrt_lite")


# ------------------------------------------------------------------------------------------ real builds


@pytest.fixture(scope="module")
def trt_export(tmp_path_factory):
    pytest.importorskip("torch")
    from holoserve.export.onnx_export import export_checkpoint
    from tests.unit.export.test_export import make_calibrated_checkpoint

    root = tmp_path_factory.mktemp("engine")
    ckpt = make_calibrated_checkpoint(root, layers=2)
    export_checkpoint(ckpt, ["tensorrt"], progress=False, polygraphy=False)
    return ckpt


@needs_rtx
def test_tensorrt_rtx_parses_and_builds_sm80_engine(trt_export, tmp_path):
    import onnx

    import tensorrt_rtx

    from holoserve.export.engine import build_engine

    onnx_path = trt_export / "model.trt.onnx"
    res = build_engine(onnx_path, tmp_path / "tiny.plan", EngineOptions(
        profile=ShapeProfile((1, 1), (4, 16), (8, 32)), compute_capability="SM80", flavour="tensorrt_rtx"))
    side = res.sidecar
    assert res.plan.stat().st_size > 0 and side["plan_bytes"] == res.plan.stat().st_size
    # what the parser accepted: every Q/DQ node of the ONNX graph became a TensorRT layer
    g = onnx.load(str(onnx_path)).graph
    n_q = sum(n.op_type == "QuantizeLinear" for n in g.node)
    n_dq = sum(n.op_type == "DequantizeLinear" for n in g.node)
    assert side["parser"]["accepted"] and not side["parser"]["errors"]
    assert side["parser"]["layer_types"]["QUANTIZE"] == n_q
    assert side["parser"]["layer_types"]["DEQUANTIZE"] == n_dq
    assert side["tensorrt"] == {"flavour": "tensorrt-rtx", "module": "tensorrt_rtx",
                                "version": tensorrt_rtx.__version__}
    assert side["target"]["compute_capability"] == "SM80"
    assert side["builder_flags"] == ["SPARSE_WEIGHTS"] and side["network_flags"] == ["STRONGLY_TYPED"]
    assert side["profiles"][0]["input_ids"] == {"min": [1, 1], "opt": [4, 16], "max": [8, 32]}
    assert [i["name"] for i in side["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [o["name"] for o in side["outputs"]] == ["logits"]
    lay = side["engine_layers"]
    assert lay and lay["gemm_layers"] > 0 and lay["gemm_int8_inputs"] == lay["gemm_layers"]
    assert lay["source"] == "builder log"
    # per weight GEMM (2 layers x q, k, v, attention output, intermediate, output): INT8, sparse unknown ahead of time
    gemms = side["sparsity"]["gemms"]
    assert side["parser"]["weight_gemms"] == len(gemms) == 12
    assert all(g["int8"] is True and g["sparse"] is None for g in gemms)
    assert side["sparsity"]["verdict"] == "0 of 12 weight GEMMs run sparse kernels, 12 unknown"
    # precision outside Q/DQ: the graph's own FP32
    assert side["precision_outside_qdq"]["runs"] == "FP32" and "runs FP32" in side["precision"]
    # the server's check accepts it for an SM80 GPU with the same TensorRT-RTX, refuses it elsewhere
    saved = read_sidecar(res.plan)
    check_compatible(saved, flavour="tensorrt-rtx", version=tensorrt_rtx.__version__, compute_capability="8.0")
    with pytest.raises(EngineMismatchError):
        check_compatible(saved, flavour="tensorrt-rtx", version=tensorrt_rtx.__version__, compute_capability="8.6")


@pytest.fixture(scope="module")
def trt_fp16_export(trt_export, tmp_path_factory):
    """The same checkpoint's TensorRT target in float16 (--tensorrt-precision fp16)."""
    from holoserve.export.onnx_export import export_checkpoint

    out = tmp_path_factory.mktemp("engine-fp16")
    export_checkpoint(trt_export, ["tensorrt"], progress=False, polygraphy=False, out_dir=out,
                      tensorrt_precision="fp16")
    return out / "model.trt.onnx"


@needs_rtx
@pytest.mark.parametrize("cc", ["SM80", None])
def test_fp16_tensorrt_graph_keeps_its_int8_gemms(trt_export, trt_fp16_export, tmp_path, cc):
    """The float16 graph parses and builds (pinned SM80 and portable) with the same INT8 GEMMs as the float32
    one: float16 Q/DQ scales leave every Q/DQ pair for TensorRT to fuse; the rest of the engine runs FP16."""
    import onnx

    from holoserve.export.engine import build_engine

    fp16_path = trt_fp16_export
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in onnx.load(str(fp16_path)).graph.initializer)
    prof = ShapeProfile((1, 1), (4, 16), (8, 32))
    rtx = EngineOptions(profile=prof, compute_capability=cc, flavour="tensorrt_rtx")
    s16 = build_engine(fp16_path, tmp_path / "fp16.plan", rtx).sidecar
    s32 = build_engine(trt_export / "model.trt.onnx", tmp_path / "fp32.plan", rtx).sidecar
    assert s16["parser"]["accepted"] and not s16["parser"]["errors"]
    l16, l32 = s16["engine_layers"], s32["engine_layers"]
    assert l16["gemm_layers"] > 0 and l16["gemm_int8_inputs"] == l16["gemm_layers"]
    for k in ("gemm_layers", "gemm_int8_inputs", "gemm_int8_in_int8_out", "onnx_matmuls_in_gemms"):
        assert l16[k] == l32[k], k
    gemms = s16["sparsity"]["gemms"]
    assert s16["parser"]["weight_gemms"] == len(gemms) == 12 and all(g["int8"] is True for g in gemms)
    # outside Q/DQ: float16, except the float32 LayerNorm/Softmax islands; the float32 export is all FP32
    assert s16["precision_outside_qdq"]["graph"]["Half"] > s16["precision_outside_qdq"]["graph"].get("Float", 0)
    assert l16["float_outputs_outside_gemms"].get("Half", 0) > 0
    assert s32["precision_outside_qdq"]["runs"] == "FP32" and "Half" not in l32["float_outputs_outside_gemms"]
    assert [o["name"] for o in s16["outputs"]] == ["logits"]


@needs_rtx
def test_tensorrt_rtx_default_build_is_portable(trt_export, tmp_path):
    """No --compute-capability: a portable engine that the sidecar check accepts on RTX 30/40/50 and A100 GPUs."""
    import tensorrt_rtx

    from holoserve.export.engine import build_engine

    res = build_engine(trt_export / "model.trt.onnx", tmp_path / "portable.plan", EngineOptions(
        flavour="tensorrt_rtx", profile=ShapeProfile((1, 1), (4, 16), (8, 32))))
    target = read_sidecar(res.plan)["target"]
    assert target["portable"] and target["compute_capability"] is None
    assert target["compute_capabilities"] == ["SM80", "SM86", "SM89", "SM120"]
    v = tensorrt_rtx.__version__
    for cc in ("8.0", "8.6", "8.9", "12.0"):  # A100, RTX 30, RTX 40, RTX 50
        check_compatible(res.sidecar, flavour="tensorrt-rtx", version=v, compute_capability=cc)
    for cc in ("7.5", "9.0"):
        with pytest.raises(EngineMismatchError):
            check_compatible(res.sidecar, flavour="tensorrt-rtx", version=v, compute_capability=cc)
    # pinned to several architectures: recorded as such
    res2 = build_engine(trt_export / "model.trt.onnx", tmp_path / "two.plan", EngineOptions(
        flavour="tensorrt_rtx", compute_capability="SM86,SM89", profile=ShapeProfile((1, 1), (4, 16), (8, 32))))
    assert res2.sidecar["target"]["compute_capabilities"] == ["SM86", "SM89"]
    check_compatible(res2.sidecar, flavour="tensorrt-rtx", version=v, compute_capability="8.9")
    with pytest.raises(EngineMismatchError):
        check_compatible(res2.sidecar, flavour="tensorrt-rtx", version=v, compute_capability="8.0")


@needs_rtx
def test_build_engine_cli_records_plan_in_checkpoint(trt_export, capsys):
    from holoserve.core.artifact import load_artifact
    from holoserve.cli import main

    rc = main(["build-engine", str(trt_export), "--max", "8x32", "--opt", "4x16", "--flavour", "tensorrt_rtx"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "parser accepted" in out and "portable: SM80/SM86/SM89/SM120" in out
    assert "unknown (12): TensorRT-RTX picks this kernel on the GPU at run time" in out
    art = load_artifact(trt_export)
    e = art.export("tensorrt")
    assert e.file == "model.plan" and e.sidecar == "model.plan.json"
    assert "model.plan" in art.manifest.files and "model.plan.json" in art.manifest.files


@needs_rtx
def test_rtx_refuses_hopper():
    from holoserve.export.engine import build_engine

    with pytest.raises(EngineBuildError, match="cannot build for SM90"):
        build_engine(__file__, "nonexistent/x.plan", EngineOptions(compute_capability="9.0", flavour="tensorrt_rtx"))


def test_build_engine_cli_needs_a_tensorrt_export(tmp_path, capsys):
    pytest.importorskip("torch")
    from holoserve.cli import main
    from tests.unit.export.test_export import make_calibrated_checkpoint

    ckpt = make_calibrated_checkpoint(tmp_path, layers=1)
    assert main(["build-engine", str(ckpt)]) == 2
    assert "--target tensorrt" in capsys.readouterr().err
