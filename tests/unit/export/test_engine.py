"""`holoserve build-engine`: flag selection per TensorRT flavour, profiles, log parsing, sidecar checks,
and a real TensorRT-RTX parse + ahead-of-time SM80 build of the exported TensorRT-placement ONNX on CPU."""
from __future__ import annotations

import importlib.util
import json

import pytest

from holoserve.export.engine import (
    EngineBuildError,
    Flavour,
    ShapeProfile,
    builder_settings,
    cc_label,
    load_trt,
    parse_layer_info,
    parse_shape,
    parse_size,
    parse_sparsity_log,
    summarize_layers,
)
from holoserve.core.sidecar import EngineMismatchError, check_compatible, normalize_cc, read_sidecar

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


def test_parse_sparsity_log():
    lines = [
        "[I] [TRT] (Sparsity) Layers eligible for sparse math: fc1, fc2, qkv",
        "[V] something else",
        "[I] [TRT] (Sparsity) TRT inference plan picked sparse implementation for layers: fc2",
    ]
    assert parse_sparsity_log(lines) == {"reported": True, "eligible": ["fc1", "fc2", "qkv"], "picked_sparse": ["fc2"]}
    assert parse_sparsity_log(["nothing"]) == {"reported": False, "eligible": [], "picked_sparse": []}


LAYER_TEXT = """Layers:
Name: emb, LayerType: kgen, Inputs: [ { Name: input_ids, Dimensions: [-1,-1], Datatype: Int64, Format: x }], Constants: [ { Name: w, Dimensions: [10,4], Datatype: Int8, Format: x }], Outputs: [ { Name: e, Dimensions: [-1,4], Datatype: Float, Format: x }], TacticName: __myl_Gather_0x1, StreamId: 0, Metadata: [ONNX Layer: word_embeddings/Gather]
Name: a/MatMul+b/MatMul, LayerType: gemm, Inputs: [ { Name: q, Dimensions: [-1,4], Datatype: Int8, Format: x }], Constants: [ { Name: wq, Dimensions: [4,4], Datatype: Int8, Format: x }], Outputs: [ { Name: o, Dimensions: [-1,4], Datatype: Int8, Format: x }], TacticName: sm80_xmma_sparse_gemm_i8i8, StreamId: 0, Metadata: [ONNX Layer: a/MatMul][ONNX Layer: b/MatMul]
Name: c/MatMul, LayerType: gemm, Inputs: [ { Name: o, Dimensions: [-1,4], Datatype: Int8, Format: x }], Constants: [], Outputs: [ { Name: y, Dimensions: [-1,4], Datatype: Float, Format: x }], TacticName: __myelin_CASK_STUB, StreamId: 0, Metadata: [ONNX Layer: c/MatMul]
"""


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
    res = build_engine(onnx_path, tmp_path / "tiny.plan", profile=ShapeProfile((1, 1), (4, 16), (8, 32)),
                       compute_capability="SM80", flavour="tensorrt_rtx", timing_cache=tmp_path / "cache.bin")
    side = res.sidecar
    assert res.plan.stat().st_size > 0 and side["plan_bytes"] == res.plan.stat().st_size
    # what the parser accepted: every Q/DQ node of the ONNX graph became a TensorRT layer
    g = onnx.load(str(onnx_path)).graph
    n_q = sum(n.op_type == "QuantizeLinear" for n in g.node)
    n_dq = sum(n.op_type == "DequantizeLinear" for n in g.node)
    assert side["parser"]["accepted"] and not side["parser"]["errors"]
    assert side["parser"]["layer_types"]["QUANTIZE"] == n_q
    assert side["parser"]["layer_types"]["DEQUANTIZE"] == n_dq
    assert side["tensorrt"] == {"flavour": "tensorrt-rtx", "module": "tensorrt_rtx", "version": tensorrt_rtx.__version__}
    assert side["target"]["compute_capability"] == "SM80"
    assert side["builder_flags"] == ["SPARSE_WEIGHTS"] and side["network_flags"] == ["STRONGLY_TYPED"]
    assert side["profiles"][0]["input_ids"] == {"min": [1, 1], "opt": [4, 16], "max": [8, 32]}
    assert [i["name"] for i in side["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [o["name"] for o in side["outputs"]] == ["logits"]
    lay = side["engine_layers"]
    assert lay and lay["gemm_layers"] > 0 and lay["gemm_int8_inputs"] == lay["gemm_layers"]
    # the server's check accepts it for an SM80 GPU with the same TensorRT-RTX, refuses it elsewhere
    saved = read_sidecar(res.plan)
    check_compatible(saved, flavour="tensorrt-rtx", version=tensorrt_rtx.__version__, compute_capability="8.0")
    with pytest.raises(EngineMismatchError):
        check_compatible(saved, flavour="tensorrt-rtx", version=tensorrt_rtx.__version__, compute_capability="8.6")


@needs_rtx
def test_build_engine_cli_records_plan_in_checkpoint(trt_export, capsys):
    from holoserve.core.artifact import load_artifact
    from holoserve.cli import main

    rc = main(["build-engine", str(trt_export), "--max", "8x32", "--opt", "4x16", "--flavour", "tensorrt_rtx"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "parser accepted" in out and "SM80" in out
    art = load_artifact(trt_export)
    e = art.export("tensorrt")
    assert e.file == "model.plan" and e.sidecar == "model.plan.json"
    assert "model.plan" in art.manifest.files and "model.plan.json" in art.manifest.files


@needs_rtx
def test_rtx_refuses_hopper():
    from holoserve.export.engine import build_engine

    with pytest.raises(EngineBuildError, match="cannot build for SM90"):
        build_engine(__file__, "/nonexistent/x.plan", compute_capability="9.0", flavour="tensorrt_rtx")


def test_build_engine_cli_needs_a_tensorrt_export(tmp_path, capsys):
    pytest.importorskip("torch")
    from holoserve.cli import main
    from tests.unit.export.test_export import make_calibrated_checkpoint

    ckpt = make_calibrated_checkpoint(tmp_path, layers=1)
    assert main(["build-engine", str(ckpt)]) == 2
    assert "--target tensorrt" in capsys.readouterr().err
