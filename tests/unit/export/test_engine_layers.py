"""Engine layer information: every form TensorRT writes it in, and the per-GEMM sparse/INT8 report built on it.

The TensorRT-RTX text is a real capture (a CPU ahead-of-time build); the datacenter TensorRT JSON
fixtures are hand-written from the documented IEngineInspector format (tests/fixtures/tensorrt/README.md).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from holoserve.export.engine_settings import EngineBuildError, Flavour
from holoserve.export.engine_report import (
    gemm_report,
    is_gemm,
    normalize_dtype,
    parse_layer_info,
    parse_sparsity_log,
    precision_summary,
    runs_in,
    summarize_layers,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tensorrt"
L0 = "/bert/encoder/layer.0"
WEIGHT_GEMMS_L0 = [f"{L0}/{p}/MatMul" for p in ("attention/self/query", "attention/self/key", "attention/self/value",
                                               "attention/output/dense", "intermediate/dense", "output/dense")]


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("text,want", [
    ("Int8", "Int8"),
    ("Thirty-two wide channel vectorized row major Int8 format.", "Int8"),
    ("Thirty-two wide channel vectorized row major Int8 format", "Int8"),
    ("Row major linear FP32 format (kLINEAR)", "Float"),
    ("Two wide channel vectorized row major FP16 format", "Half"),
    ("Channel major FP16 format where channel % 8 == 0", "Half"),
    ("Row major linear BF16 format", "BFloat16"),
    ("Row major linear INT64 format (kLINEAR)", "Int64"),
    ("Float", "Float"),
    ("Half", "Half"),
    ("N/A due to dynamic shapes", None),
    ("Format not available due to dynamic shapes", None),
    (None, None),
])
def test_normalize_dtype(text, want):
    assert normalize_dtype(text) == want


def test_real_tensorrt_rtx_layer_information():
    """What TensorRT-RTX 1.7 printed for the 2-layer test model (captured on a CPU build)."""
    layers = parse_layer_info(fixture("rtx-1.7.1.116-layers.txt"))
    assert len(layers) == 29
    gemms = [x for x in layers if x["type"] == "gemm"]
    assert len(gemms) == 8  # per encoder layer: fused QKV, attention output, intermediate, output
    for g in gemms:  # INT8 activations and INT8 weights in every weight GEMM
        assert g["input_types"] == ["Int8"] and g["constant_types"][0] == "Int8"
        assert g["tactic"] == "__myelin_CASK_STUB"
    qkv = gemms[0]
    assert [m for m in qkv["onnx_layers"] if m.endswith("MatMul")] == [
        "/m/bert/encoder/layer.0/attention/self/value/MatMul", "/m/bert/encoder/layer.0/attention/self/key/MatMul",
        "/m/bert/encoder/layer.0/attention/self/query/MatMul"]
    # the I/O Tensors section after the last layer is not taken for a layer's outputs
    assert layers[-1]["name"] == "__myl_FcAdd_myl1_27" and layers[-1]["output_types"] == ["Float"]
    # dynamic-shape tensors whose format is not known parse as None, not as a wrong type
    assert layers[0]["output_types"] == ["Int64"]
    s = summarize_layers(layers)
    assert s["gemm_layers"] == 10 and s["gemm_int8_inputs"] == 10  # 8 weight GEMMs + 2 fused attention kernels
    assert s["sparse_tactic_layers"] == [] and s["float_outputs_outside_gemms"] == {"Float": 10}
    names = [f"/m/bert/encoder/layer.{i}/{p}/MatMul" for i in (0, 1) for p in (
        "attention/self/query", "attention/self/key", "attention/self/value", "attention/output/dense",
        "intermediate/dense", "output/dense")]
    report = gemm_report(layers, names, jit=True)
    assert [r["gemm"] for r in report] == names
    assert all(r["int8"] is True and r["sparse"] is None and "run time" in r["why"] for r in report)
    assert report[0]["engine_layer"] == report[1]["engine_layer"] == report[2]["engine_layer"] == qkv["name"]


def test_datacenter_tensorrt10_json_with_descriptive_formats():
    layers = parse_layer_info(fixture("trt10-inspector-cask.json"))
    by_name = {x["name"]: x for x in layers}
    q = by_name[f"{L0}/attention/self/query/MatMul"]
    assert q["type"] == "CaskGemmMatrixMultiply" and q["input_types"] == ["Int8", "Int8"]
    assert q["output_types"] == ["Half"]
    conv = by_name[f"{L0}/attention/output/dense/MatMul"]
    assert conv["type"] == "CaskConvolution" and conv["constant_types"] == ["Int8"] and is_gemm(conv)
    assert not is_gemm(by_name[f"{L0}/attention/self/Softmax"])
    s = summarize_layers(layers)
    # 6 weight GEMMs, the attention scores GEMM and the FP32 classifier; the old exact-membership test found 0 INT8
    assert s["gemm_layers"] == 8 and s["gemm_int8_inputs"] == 7
    assert s["sparse_tactic_layers"] == [f"{L0}/attention/output/dense/MatMul", f"{L0}/intermediate/dense/MatMul"]
    assert s["float_outputs_outside_gemms"] == {"Half": 3}

    log = parse_sparsity_log(fixture("trt10-build-sparsity.log").splitlines())
    assert log["reported"] and len(log["eligible"]) == 3 and len(log["picked_sparse"]) == 2
    report = {r["gemm"]: r for r in gemm_report(layers, WEIGHT_GEMMS_L0, picked=log["picked_sparse"],
                                                 eligible=log["eligible"], log_reported=True)}
    assert [report[n]["sparse"] for n in WEIGHT_GEMMS_L0] == [False, False, False, True, True, False]
    assert "picked sparse implementation" in report[f"{L0}/attention/output/dense/MatMul"]["why"]
    assert "eligible for sparse math" in report[f"{L0}/output/dense/MatMul"]["why"]
    assert report[f"{L0}/attention/self/query/MatMul"]["why"].startswith("dense kernel sm80_xmma_gemm_i8i8")
    assert all(r["int8"] for r in report.values())
    # without the builder log, the kernel names alone still tell the sparse ones
    by_tactic = {r["gemm"]: r["sparse"] for r in gemm_report(layers, WEIGHT_GEMMS_L0)}
    assert by_tactic[f"{L0}/attention/output/dense/MatMul"] and by_tactic[f"{L0}/intermediate/dense/MatMul"]
    assert by_tactic[f"{L0}/output/dense/MatMul"] is False


def test_myelin_region_hides_the_gemms():
    """The known risk: the encoder compiled into one fused region says nothing about its GEMM kernels."""
    layers = parse_layer_info(fixture("trt10-inspector-myelin.json"))
    report = gemm_report(layers, WEIGHT_GEMMS_L0)
    assert all(r["sparse"] is None and "fused (Myelin) region" in r["why"] for r in report)
    assert summarize_layers(layers)["gemm_layers"] == 0


def test_split_datatype_and_format_keys():
    layers = parse_layer_info(fixture("trt11-inspector-split.json"))
    qkv = layers[1]
    assert qkv["input_types"] == ["Int8"] and qkv["constant_types"] == ["Int8", "Float"]
    assert qkv["output_types"] == ["Half"]
    report = {r["gemm"]: r for r in gemm_report(layers, WEIGHT_GEMMS_L0)}
    assert [report[n]["sparse"] for n in WEIGHT_GEMMS_L0] == [True, True, True, False, None, True]
    assert "not shown" in report[f"{L0}/intermediate/dense/MatMul"]["why"]
    assert all(r["int8"] for r in report.values())
    s = summarize_layers(layers)
    assert s["float_outputs_outside_gemms"] == {"Float": 1, "Half": 1}
    assert runs_in(s["float_outputs_outside_gemms"]) in ("mixed FP32/FP16", "mixed FP16/FP32")


def test_oneline_and_old_verbose_forms():
    text = (
        "Layers:\n"
        "Name: emb, LayerType: kgen, Inputs: [ { Name: input_ids, Dimensions: [-1,-1], Datatype: Int64, "
        "Format: x }], Constants: [ { Name: w, Dimensions: [10,4], Datatype: Int8, Format: x }], "
        "Outputs: [ { Name: e, Dimensions: [-1,4], Datatype: Float, Format: x }], TacticName: __myl_Gather_0x1, "
        "StreamId: 0, Metadata: [ONNX Layer: word_embeddings/Gather]\n"
        "Name: a/MatMul+b/MatMul, LayerType: gemm, Inputs: [ { Name: q, Dimensions: [-1,4], Datatype: Int8, "
        "Format: (Arbitrary) Format with stride order = [1,2,0] }], Constants: [ { Name: wq, Dimensions: [4,4], "
        "Datatype: Int8, Format: x }], Outputs: [ { Name: o, Dimensions: [-1,4], Datatype: Int8, Format: x }], "
        "TacticName: sm80_xmma_sparse_gemm_i8i8, StreamId: 0, Metadata: [ONNX Layer: a/MatMul][ONNX Layer: b/MatMul]\n"
        "Name: c/MatMul, LayerType: CaskGemmMatrixMultiply, Inputs: [ { Name: o, Location: Device, "
        "Dimensions: [-1,4], Format/Datatype: Thirty-two wide channel vectorized row major Int8 format }], "
        "Outputs: [ { Name: y, Location: Device, Dimensions: [-1,4], "
        "Format/Datatype: Row major linear FP32 format }], ParameterType: MatrixMultiply, TacticValue: 0x1f, "
        "StreamId: 0, Metadata: [ONNX Layer: c/MatMul]\n"
    )
    layers = parse_layer_info(text)
    assert [x["name"] for x in layers] == ["emb", "a/MatMul+b/MatMul", "c/MatMul"]
    assert layers[1]["input_types"] == ["Int8"] and layers[1]["constant_types"] == ["Int8"]
    assert layers[2]["input_types"] == ["Int8"] and layers[2]["output_types"] == ["Float"]
    assert layers[2]["tactic"] == "0x1f"
    s = summarize_layers(layers)
    assert s["gemm_layers"] == 2 and s["gemm_int8_inputs"] == 2 and s["gemm_int8_in_int8_out"] == 1
    assert s["sparse_tactic_layers"] == ["a/MatMul+b/MatMul"]
    report = gemm_report(layers, ["a/MatMul", "b/MatMul", "c/MatMul", "d/MatMul"])
    assert [r["sparse"] for r in report] == [True, True, None, None]
    assert report[3]["why"] == "no engine layer names this GEMM"

    old = """[12/04/2021-06:34:17] [V] [TRT] Engine Layer Information:
Layer(Reformat): Reformatting CopyNode for Input Tensor 0 to fc1, Tactic: 0, input_0[Float(128,384)] -> r[Int8(128,384)]
Layer(CaskGemmConvolution): fc1, Tactic: 0x1025026069226666, r[Int8(128,384)] -> 191[Int8(128,1536)]
"""
    layers = parse_layer_info(old)
    assert [x["type"] for x in layers] == ["Reformat", "CaskGemmConvolution"]
    assert layers[1]["input_types"] == ["Int8"] and layers[1]["output_types"] == ["Int8"]
    assert summarize_layers(layers)["gemm_int8_in_int8_out"] == 1


def test_bad_json_is_a_clear_error():
    with pytest.raises(EngineBuildError, match="not valid JSON"):
        parse_layer_info("{not json")


def test_precision_summary_states_what_runs_outside_qdq():
    rtx = Flavour("tensorrt_rtx", "1.7.1.116")
    assert "outside Q/DQ the engine runs FP32" in precision_summary(rtx, True, {"Float": 149})
    trt11 = Flavour("tensorrt", "11.4.0.106")
    assert "runs mixed FP16/FP32" in precision_summary(trt11, True, {"Half": 10, "Float": 2})
    trt105 = Flavour("tensorrt", "10.5.0.18")
    assert "builder chooses per layer" in precision_summary(trt105, True)
    assert "runs FP16" in precision_summary(trt105, True, None, {"Half": 4})
    assert "runs FP32" in precision_summary(trt105, False)
    assert "deprecated since TensorRT 10.12" in precision_summary(Flavour("tensorrt", "10.16.0.72"), True)
    assert "deprecated" not in precision_summary(trt105, True)


def test_layer_information_is_found_in_the_builder_log():
    from holoserve.export.engine import _layer_information

    rtx = Flavour("tensorrt_rtx", "1.7.1.116")
    one_message = ["[INFO] Engine generation completed", "[VERBOSE] " + fixture("rtx-1.7.1.116-layers.txt")]
    layers, source = _layer_information(None, rtx, one_message, b"", None, None)
    assert source == "builder log" and len(layers) == 29
    per_layer = ["[VERBOSE] Engine Layer Information:",
                 "[VERBOSE] Layer(CaskGemmConvolution): fc1, Tactic: 0x10, x[Int8(8,128)] -> y[Int8(8,64)]",
                 "[VERBOSE] Layer(Reformat): out, Tactic: 0x0, y[Int8(8,64)] -> z[Float(8,64)]",
                 "[INFO] [MemUsageChange] done"]
    layers, _ = _layer_information(None, rtx, per_layer, b"", None, None)
    assert [x["name"] for x in layers] == ["fc1", "out"]
    assert _layer_information(None, rtx, ["[INFO] nothing"], b"", None, None) == (None, None)
    report = gemm_report([], ["fc1/MatMul"])
    assert report[0]["sparse"] is None and "no engine layer information" in report[0]["why"]
