"""`holoserve export`: QDQ placements, int8 weights with exact 2:4 zeros, verification, manifest records."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from holoserve.core.artifact import load_artifact
from holoserve.core.numerics import nm_violations

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def make_calibrated_checkpoint(root: Path, *, layers: int = 2, task_name: str = "sst2", name: str = "ckpt",
                               tensorrt_qat: bool = False, biases: bool = False, hidden_act: str = "",
                               classifier_gain: float = 1.0) -> Path:
    """Tiny random BERT: encoder Linears projected to 2:4 + INT8 grid, input ranges calibrated, saved."""
    from transformers import AutoModelForSequenceClassification

    from holoserve.compress.checkpoint import CheckpointContents, save_checkpoint
    from holoserve.compress.layers import encoder_linear_names
    from holoserve.compress.sparsify import project_layers
    from holoserve.compress.quant import calibrate_amax
    from holoserve.data.tasks import get_task
    from tests.helpers.tiny import make_tiny_bert

    task = get_task(task_name)
    src = make_tiny_bert(root / f"src-{name}", num_labels=task.num_labels, layers=layers,
                         hidden_act=hidden_act or "gelu")
    model = AutoModelForSequenceClassification.from_pretrained(str(src), local_files_only=True).eval()
    names = encoder_linear_names(model)
    # non-zero biases, as in a trained model (zero ones are folded away and leave no bias Add)
    if tensorrt_qat or biases:
        g0 = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n in names:
                b = model.get_submodule(n).bias
                b.copy_(torch.randn(b.shape, generator=g0) * 0.1)
    scales = project_layers(model, names)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batches = [{"input_ids": torch.randint(5, vocab, (4, 12), generator=g),
                "attention_mask": torch.ones(4, 12, dtype=torch.long),
                "token_type_ids": torch.zeros(4, 12, dtype=torch.long)} for _ in range(3)]
    amax = calibrate_amax(model, names, batches)
    if tensorrt_qat:  # what TensorRT QAT stores (scaled, so the test can tell them from export calibration)
        from holoserve.compress.quant import calibrate_tensorrt_amax

        extra, _sqnr = calibrate_tensorrt_amax(model, names, batches)
        amax.update({k: v * 0.75 for k, v in extra.items()})
    if classifier_gain != 1.0:  # a random tiny model's logits are ~0.01: scale them so numerics show
        with torch.no_grad():
            model.classifier.weight.mul_(classifier_gain)
    save_checkpoint(model, src, root / name, CheckpointContents(task=task, base_model="tiny-random-bert",
        max_seq_length=32, sparse_layers=names, weight_scales=scales, act_amax=amax))
    return root / name


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from holoserve.export.onnx_export import export_checkpoint

    root = tmp_path_factory.mktemp("export")
    ckpt = make_calibrated_checkpoint(root, biases=True)
    res = export_checkpoint(ckpt, ["onnxruntime", "tensorrt"], progress=False, keep_float=True)
    return ckpt, res


def _inits(model):
    from onnx import numpy_helper

    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def test_export_records_both_targets_in_manifest(exported):
    ckpt, res = exported
    art = load_artifact(ckpt)  # sha256 of the new files is checked here
    assert set(art.manifest.exports.recorded()) >= {"onnxruntime", "tensorrt-onnx"}
    assert art.export("onnxruntime").file == "model.onnx"
    assert art.export("tensorrt-onnx").file == "model.trt.onnx"
    for f in ("model.onnx", "model.trt.onnx", "model.float.onnx"):
        assert f in art.manifest.files and (ckpt / f).is_file()
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_io_contract_dynamic_axes(exported):
    ckpt, _ = exported
    for f in ("model.onnx", "model.trt.onnx"):
        g = onnx.load(str(ckpt / f)).graph
        ins = {i.name: i.type.tensor_type for i in g.input}
        assert set(ins) == {"input_ids", "attention_mask", "token_type_ids"}
        for t in ins.values():
            assert t.elem_type == onnx.TensorProto.INT64
            assert [d.dim_param for d in t.shape.dim] == ["batch", "sequence"]
        assert [o.name for o in g.output] == ["logits"]
        assert g.output[0].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_weights_are_int8_with_exact_2of4_zeros(exported):
    ckpt, _ = exported
    art = load_artifact(ckpt)
    for f in ("model.onnx", "model.trt.onnx"):
        inits = _inits(onnx.load(str(ckpt / f)))
        for layer in art.sparse_layers:
            q = inits[f"{layer}.weight_int8"]
            assert q.dtype == np.int8
            assert nm_violations(q.T, 2, 4) == 0  # stored [in, out]: groups of 4 along the input dim
            s = inits[f"{layer}.weight_scale"]
            np.testing.assert_array_equal(s, art.weight_scales(layer))
            # zero point 0: explicit for DequantizeLinear; MatMulIntegerToFloat leaves it out (= 0)
            assert not np.any(inits.get(f"{layer}.weight_zero_point", 0))
            assert f == "model.onnx" or f"{layer}.weight_zero_point" in inits
        # no fp32 copy of an encoder weight is left behind
        assert not [k for k in inits if k.endswith(".weight_t")]


def test_placements(exported):
    ckpt, res = exported
    art = load_artifact(ckpt)
    n = len(art.sparse_layers)
    m_ort = onnx.load(str(ckpt / "model.onnx"))
    q_ort = [x for x in m_ort.graph.node if x.op_type == "QuantizeLinear"]
    # MatMul inputs only; Q, K and V read the same tensor with the same range and share one pair
    assert len(q_ort) == 4 * (n // 6)
    # each Linear is one MatMulIntegerToFloat: the quantized activation, the int8 weights, their
    # scales, the activation zero point, and the Linear's bias folded in (no float MatMul or Add left)
    prod = {o: x for x in m_ort.graph.node for o in x.output}
    zps = _inits(m_ort)
    mm = [x for x in m_ort.graph.node if x.op_type == "MatMulIntegerToFloat"]
    assert len(mm) == n and all(x.domain == "com.microsoft" for x in mm)
    # (the last query projection reads its one [CLS] row through a Slice: see the classifier-row test)
    def quantized(t):
        return prod[t].op_type == "QuantizeLinear" or (
            prod[t].op_type == "Slice" and prod[prod[t].input[0]].op_type == "QuantizeLinear")

    assert all(quantized(x.input[0]) and zps[x.input[1]].dtype == np.int8 for x in mm)
    assert all(len(x.input) == 7 and zps[x.input[6]].shape == zps[x.input[3]].shape for x in mm)
    ops = [x.op_type for x in m_ort.graph.node]
    assert "MatMul" not in ops and "DequantizeLinear" not in ops
    assert not [x for x in m_ort.graph.node if x.op_type == "Add" and any(zps.get(i, np.zeros(())).ndim == 1
                                                                         for i in x.input)]  # no bias Add left
    assert res.entries["onnxruntime"]["fused_ops"]["integer_matmuls"] == {"matmuls": n, "bias_folded": n}
    assert all(zps[x.input[2]].dtype == np.uint8 and zps[x.input[2]] == 128 for x in q_ort)
    m_trt = onnx.load(str(ckpt / "model.trt.onnx"))
    q_trt = [x for x in m_trt.graph.node if x.op_type == "QuantizeLinear"]
    zt = _inits(m_trt)
    assert all(zt[x.input[2]].dtype == np.int8 for x in q_trt)
    # QDQBERT: + 4 attention MatMul inputs per layer + residual Add inputs (2 per Add, 2 Adds per layer,
    # one tensor shared between an Add and the next Linear is quantized once per consumer group)
    assert len(q_trt) > n
    extra = res.entries["tensorrt-onnx"]["extra_ranges"]["amax"]
    assert extra and all(v > 0 for v in extra.values())
    # every non-weight MatMul (attention) has both inputs produced by DequantizeLinear
    prod = {o: x for x in m_trt.graph.node for o in x.output}
    mm = [x for x in m_trt.graph.node if x.op_type == "MatMul"]
    assert all(prod[i].op_type == "DequantizeLinear" for x in mm for i in x.input)


def test_verification_results(exported):
    ckpt, res = exported
    v = res.entries["onnxruntime"]["verification"]
    assert v["onnx_checker_full"] == "passed"
    n = res.report["linears"]
    assert v["ort_fusion"]["fused_integer_matmuls"] == n
    assert v["ort_fusion"]["dequantize_left"] == 0
    ps = v["polygraphy_sparsity"]
    assert ps["encoder_weights"] == n and ps["encoder_weights_2of4"] == n and ps["all_encoder_weights_2of4"]
    par = v["parity_vs_pytorch_fakequant"]
    assert par["rows"] > 0 and par["max_abs_diff"] < 0.05
    assert res.entries["onnxruntime"]["size_ratio_vs_fp32"] > 1.0


def test_ort_matches_pytorch_fake_quant_closely(exported):
    """Layer-by-layer the exported graph computes the checkpoint's fake-quant numerics."""
    from holoserve.export.reference import encode_batches, load_torch_model, make_tokenizer, reference_logits
    from holoserve.export.checks import ort_logits, ort_session

    ckpt, _ = exported
    art = load_artifact(ckpt)
    model = load_torch_model(art)
    tok = make_tokenizer(art)
    batches = [b for _, b in encode_batches(tok, ["the movie was good", "a bad , dull film", "fun"], batch_size=2)]
    ref = reference_logits(model, art, batches)
    got = ort_logits(ort_session(ckpt / "model.onnx"), batches)
    with torch.no_grad():
        fp = np.concatenate([model(**{k: torch.from_numpy(v) for k, v in b.items()}).logits.numpy() for b in batches])
    # closer to the fake-quant model than the fp32 model is (the quantization itself is reproduced)
    assert np.abs(got - ref).max() <= max(np.abs(fp - ref).max(), 1e-4)


def test_uint8_zero_point_128_equals_int8_fake_quant():
    """The ORT placement's uint8/zp128 Q/DQ computes exactly compress.quant.fake_quant_act (ties, saturation)."""
    from onnx import TensorProto, helper, numpy_helper

    from holoserve.compress.quant import act_scale, fake_quant_act

    amax = 2.0
    scale = float(act_scale(amax))
    x = np.array([0.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -127.5, -128.5, -200, 300, 3.3, -7.7],
                 np.float32) * np.float32(scale)
    for unsigned in (True, False):
        zp = np.asarray(128, np.uint8) if unsigned else np.asarray(0, np.int8)
        g = helper.make_graph(
            [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
            "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [len(x)])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [len(x)])],
            [numpy_helper.from_array(np.asarray(np.float32(amax) / np.float32(127), np.float32), "s"),
             numpy_helper.from_array(zp, "z")],
        )
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        y = sess.run(["y"], {"x": x})[0]
        ref = fake_quant_act(torch.from_numpy(x), act_scale(amax)).numpy()
        np.testing.assert_array_equal(y, ref)


def test_out_dir_leaves_checkpoint_untouched(tmp_path):
    from holoserve.export.onnx_export import export_checkpoint

    ckpt = make_calibrated_checkpoint(tmp_path, layers=1)
    before = (ckpt / "manifest.json").read_text()
    res = export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path / "out", progress=False, polygraphy=False)
    assert (ckpt / "manifest.json").read_text() == before
    assert (tmp_path / "out" / "model.onnx").is_file()
    rep = json.loads((tmp_path / "out" / "export_report.json").read_text())
    assert rep["exports"]["onnxruntime"]["verification"]["onnx_checker_full"] == "passed"
    assert res.files["model.onnx"] == tmp_path / "out" / "model.onnx"


def test_an_export_writes_the_same_bytes_every_time(tmp_path):
    """Every target, the fp32 graph, the report (less its time) and the manifest: exported twice from one
    checkpoint, byte for byte the same. An export is a function of the checkpoint and the options, so a
    rebuilt image or a re-run export ships the files (and sha256 sums) it shipped before."""
    import hashlib
    import shutil

    from holoserve.export.onnx_export import export_checkpoint

    ckpt = make_calibrated_checkpoint(tmp_path, layers=1, biases=True)
    kw = dict(progress=False, verify_exports=False, keep_float=True)

    def written(folder: Path) -> dict[str, str]:
        out = {}
        for f in sorted(folder.iterdir()):
            data = f.read_bytes()
            if f.name == "export_report.json":  # its "seconds" is the one field that may differ
                data = json.dumps({k: v for k, v in json.loads(data).items() if k != "seconds"}).encode()
            out[f.name] = hashlib.sha256(data).hexdigest()
        return out

    runs = []
    for n in range(2):
        export_checkpoint(ckpt, ["onnxruntime", "tensorrt", "openvino"], out_dir=tmp_path / f"out{n}", **kw)
        in_place = shutil.copytree(ckpt, tmp_path / f"ckpt{n}")
        export_checkpoint(in_place, ["onnxruntime", "tensorrt"], **kw)
        runs.append((written(tmp_path / f"out{n}"), written(in_place)))
    assert set(runs[0][0]) == {"model.onnx", "model.trt.onnx", "model.ov.onnx", "model.float.onnx",
                               "export_report.json"}
    assert {"manifest.json", "model.onnx", "model.trt.onnx"} <= set(runs[0][1])
    assert runs[0] == runs[1]


def test_not_2of4_checkpoint_is_refused_with_clear_message(tmp_path, capsys):
    """A weight edited after compression (manifest sha updated, so only the 2:4 proof can catch it)."""
    from safetensors.numpy import load_file, save_file

    from holoserve.core.files import atomic_write_json, file_entry
    from holoserve.cli import main

    ckpt = make_calibrated_checkpoint(tmp_path, layers=1)
    w = load_file(str(ckpt / "model.safetensors"))
    art = load_artifact(ckpt)
    layer = art.sparse_layers[0]
    key = f"{layer}.weight"
    scales = art.weight_scales(layer)
    w[key] = np.ascontiguousarray(w[key].copy())
    w[key][0, :4] = scales[0] * np.array([1, 2, 3, 4], np.float32)  # 4 non-zeros in one group, still on grid
    save_file(w, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"]["model.safetensors"] = file_entry(ckpt / "model.safetensors")
    atomic_write_json(ckpt / "manifest.json", m)
    rc = main(["export", str(ckpt), "--no-verify"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "2:4" in err and layer in err and "Traceback" not in err
    assert not (ckpt / "model.onnx").exists()


def test_checkpoint_without_activation_ranges_is_refused(tmp_path):
    from holoserve.export.onnx_export import export_checkpoint
    from holoserve import HoloServeError
    from holoserve.core.files import atomic_write_json

    ckpt = make_calibrated_checkpoint(tmp_path, layers=1)
    m = json.loads((ckpt / "manifest.json").read_text())
    m["quantization"]["activations"] = None
    atomic_write_json(ckpt / "manifest.json", m)
    with pytest.raises(HoloServeError, match="activation ranges"):
        export_checkpoint(ckpt, ["onnxruntime"], progress=False)


def test_parse_polygraphy_output():
    from holoserve.export.checks import parse_polygraphy_sparsity, summarize_sparsity

    text = """[I] Found: 4 weight tensor(s) eligible for pruning.
[I] Checking the sparsity pattern of 4 tensors.
[I] Found sparse tensor: a.weight_t
[I] Found non-sparse tensor: b.weight_t
[I] Found sparse tensor: c.weight_t
[I] Found non-sparse tensor: classifier.weight
"""
    parsed = parse_polygraphy_sparsity(text)
    assert parsed == {"eligible": 4, "sparse": ["a.weight_t", "c.weight_t"],
                      "non_sparse": ["b.weight_t", "classifier.weight"]}
    s = summarize_sparsity(parsed, ["a.weight_t", "b.weight_t", "c.weight_t", "d.weight_t"])
    assert s["encoder_weights_2of4"] == 2 and not s["all_encoder_weights_2of4"]
    assert s["encoder_weights_not_2of4"] == ["b.weight_t"] and s["encoder_weights_not_reported"] == ["d.weight_t"]
    assert s["other_non_sparse"] == ["classifier.weight"]


def test_polygraphy_flags_a_dense_weight(tmp_path):
    """Run the real tool on a tiny graph: it exits 0 for a dense weight, our parser still catches it."""
    from onnx import TensorProto, helper, numpy_helper

    from holoserve.export.checks import polygraphy_sparsity

    rng = np.random.default_rng(0)
    dense = rng.normal(size=(8, 4)).astype(np.float32)
    sparse = dense.copy()
    sparse.reshape(2, 4, 4)[:, 2:, :] = 0  # [K=8, N=4]: along K, each group of 4 keeps 2
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "ws"], ["h"]), helper.make_node("MatMul", ["h2", "wd"], ["y"]),
         helper.make_node("Concat", ["h", "h"], ["h2"], axis=1)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(sparse, "ws"), numpy_helper.from_array(dense, "wd")],
    )
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    res = polygraphy_sparsity(path, ["ws", "wd"])
    assert res["encoder_weights_not_2of4"] == ["wd"]
    assert res["encoder_weights_2of4"] == 1


def test_find_linears_reports_missing_weights(tmp_path):
    from holoserve.export.qdq import find_linears

    ckpt = make_calibrated_checkpoint(tmp_path, layers=1)
    from holoserve.export.onnx_export import torch_export_fp32
    from holoserve.export.reference import load_torch_model

    art = load_artifact(ckpt)
    model = load_torch_model(art)
    torch_export_fp32(model, tmp_path / "f.onnx")
    m = onnx.load(str(tmp_path / "f.onnx"))
    with pytest.raises(ValueError, match="not found"):
        find_linears(m, {"bert.encoder.layer.0.nope": np.ones((4, 8), np.float32)})


# ------------------------------------------------------------------------------------------ integration


def test_word_embeddings_int8_only_when_lossless_by_default(tmp_path):
    """auto keeps a float table fp32 (exact numerics); a table already on a per-row int8 grid is stored
    as int8 losslessly; --embeddings int8 forces it and the parity reference then uses the same table."""
    from safetensors.numpy import load_file, save_file

    from holoserve.export.onnx_export import export_checkpoint
    from holoserve.export.qdq import dequantized_embedding, embedding_is_int8_exact
    from holoserve.core.files import atomic_write_json, file_entry

    ckpt = make_calibrated_checkpoint(tmp_path, layers=1)
    res = export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path / "auto", progress=False, polygraphy=False)
    assert res.report["word_embeddings"] == {"requested": "auto", "int8": False, "int8_lossless": False}
    assert "word_embeddings.int8" not in _inits(onnx.load(str(tmp_path / "auto" / "model.onnx")))

    forced = export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path / "int8", progress=False, polygraphy=False,
                               embeddings="int8")
    e = forced.entries["onnxruntime"]
    assert e["word_embeddings"]["lossless"] is False and e["bytes"] < res.entries["onnxruntime"]["bytes"]
    assert _inits(onnx.load(str(tmp_path / "int8" / "model.onnx")))["word_embeddings.int8"].dtype == np.int8
    assert e["verification"]["parity_vs_pytorch_fakequant"]["max_abs_diff"] < 0.05

    # put the table on its per-row grid in the checkpoint itself: auto now stores it as int8, exactly
    w = load_file(str(ckpt / "model.safetensors"))
    key = next(k for k in w if k.endswith("word_embeddings.weight"))
    w[key] = dequantized_embedding(w[key])
    assert embedding_is_int8_exact(w[key])
    save_file(w, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"]["model.safetensors"] = file_entry(ckpt / "model.safetensors")
    atomic_write_json(ckpt / "manifest.json", m)
    exact = export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path / "exact", progress=False, polygraphy=False)
    assert exact.report["word_embeddings"]["int8"] and exact.report["word_embeddings"]["int8_lossless"]
    assert exact.entries["onnxruntime"]["word_embeddings"]["lossless"] is True


def _tiny_sst2_dir(root: Path) -> Path:
    rows = ["the movie was good", "a bad , dull film", "fun", "an utterly charming and often affecting journey",
            "it 's slow -- very , very slow .", "a sometimes tedious film .", "great", "not worth it"]
    d = root / "glue"
    (d / "SST-2").mkdir(parents=True, exist_ok=True)
    (d / "SST-2" / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"{r}\t{i % 2}\n" for i, r in enumerate(rows)))
    return d


def test_eval_onnx_scores_the_export_on_eval_batches(exported, tmp_path):
    """`holoserve eval --onnx` runs the server's ORT backend on the batches `holoserve eval` uses,
    and with integer-exact GEMMs in the PyTorch reference both give the same predictions."""
    from holoserve.compress.checkpoint import load_model
    from holoserve.compress.data import encode, eval_batches
    from holoserve.core.tokenizer import load_tokenizer
    from holoserve.compress.evaluate import predict
    from holoserve.compress.evaluate import EvalOptions, evaluate_checkpoint
    from holoserve.compress.quant import input_quantizers
    from holoserve.backends.onnxruntime import OrtBackend
    from holoserve.data.glue import read_split
    from holoserve import HoloServeError

    ckpt, _ = exported
    data_dir = _tiny_sst2_dir(tmp_path)
    got = evaluate_checkpoint(ckpt, EvalOptions(data_dir=data_dir, onnx=True, batch_size=3,
        predictions=tmp_path / "p" / "onnx.jsonl"))
    ref = evaluate_checkpoint(ckpt, EvalOptions(data_dir=data_dir, batch_size=3,
        predictions=tmp_path / "torch.jsonl"))
    assert got["numerics"].startswith("ONNX Runtime") and got["rows"] == ref["rows"] == 8
    assert set(got["metrics"]) == set(ref["metrics"])
    rows = read_split("sst2", "dev", data_dir)
    for name, result in (("p/onnx.jsonl", got), ("torch.jsonl", ref)):  # --predictions: one line per row, in order
        lines = [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]
        assert [x["text"] for x in lines] == [r.text for r in rows] and [x["row"] for x in lines] == list(range(8))
        assert all(x["label"] == ["negative", "positive"][r.label] for x, r in zip(lines, rows))
        assert all(abs(sum(x["probabilities"].values()) - 1) < 1e-4 and x["prediction"] ==
                   max(x["probabilities"], key=x["probabilities"].get) for x in lines)
        right = sum(x["prediction"] == x["label"] for x in lines) / 8
        assert right == pytest.approx(result["metrics"]["accuracy"])
    with pytest.raises(HoloServeError, match="is a folder"):
        evaluate_checkpoint(ckpt, EvalOptions(data_dir=data_dir, predictions=tmp_path))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(HoloServeError, match="cannot make its folder"):  # before any scoring
        evaluate_checkpoint(ckpt, EvalOptions(data_dir=data_dir, predictions=tmp_path / "a-file" / "p.jsonl"))

    model, art = load_model(ckpt)
    data = encode(load_tokenizer(art.path, art.max_seq_length), read_split("sst2", "dev", data_dir))
    be = OrtBackend(art, device="cpu", threads=1)
    ort_logits = np.zeros((len(data), 2), np.float32)
    for idx, b in eval_batches(data, 3):
        ort_logits[idx] = be.infer(b["input_ids"].numpy(), b["attention_mask"].numpy(), b["token_type_ids"].numpy())
    amax = art.activation_amax()
    layers = [k[: -len(".input")] for k in amax]
    with input_quantizers(model, amax, layers, exact=True):
        exact = predict(model, data, 3)
    with input_quantizers(model, amax, layers):
        fp32 = predict(model, data, 3)
    assert np.abs(ort_logits - exact).max() <= np.abs(ort_logits - fp32).max() + 1e-6
    assert np.abs(ort_logits - exact).max() < 1e-3


def test_eval_compare_through_onnxruntime(exported, tmp_path):
    """`--compare`: the export's predictions against the checkpoint's numerics, on the same rows; ONNX
    Runtime reproduces them, so nothing differs."""
    from holoserve.compress.evaluate import EvalOptions, evaluate_checkpoint

    ckpt, _ = exported
    got = evaluate_checkpoint(ckpt, EvalOptions(data_dir=_tiny_sst2_dir(tmp_path), backend="onnxruntime",
        compare=True, batch_size=3))
    cmp = got["compare"]
    assert got["numerics"].startswith("ONNX Runtime") and cmp["reference_metrics"] == got["metrics"]
    assert cmp["identical_predictions"] == 1.0 and cmp["different_predictions"] == 0
    assert cmp["right_here_only"] == cmp["right_in_reference_only"] == 0
    assert cmp["primary_difference"] == 0 and cmp["mcnemar_exact_p"] == 1.0
    assert cmp["within_rounding"] is True and "beyond_rounding" not in cmp


def test_eval_compare_says_when_a_backend_differs_beyond_rounding(exported, tmp_path, monkeypatch):
    """`--compare` applies the export's rule: a backend that changes every prediction is beyond rounding."""
    from holoserve.backends.onnxruntime import OrtBackend
    from holoserve.compress.evaluate import EvalOptions, evaluate_checkpoint

    real = OrtBackend.infer
    monkeypatch.setattr(OrtBackend, "infer", lambda self, *a: -real(self, *a))
    cmp = evaluate_checkpoint(exported[0], EvalOptions(data_dir=_tiny_sst2_dir(tmp_path), backend="onnxruntime",
        compare=True, batch_size=3))["compare"]
    assert cmp["within_rounding"] is False and cmp["beyond_rounding"].startswith("8 of 8 predictions changed")


@pytest.mark.parametrize("options, message", [
    (dict(compare=True), "add --backend onnxruntime or --backend openvino"),
    (dict(backend="onnxruntime", openvino_precision="f32"), "only applies to --backend openvino"),
    (dict(onnx=True, backend="openvino"), "--onnx means --backend onnxruntime"),
    (dict(backend="openvino", fp32=True), "drop --fp32"),
    (dict(backend="openvino", onnx_export="tensorrt-onnx"), "only applies to --backend onnxruntime"),
])
def test_eval_options_that_do_not_go_together(tmp_path, options, message):
    from holoserve import HoloServeError
    from holoserve.compress.evaluate import EvalOptions, evaluate_checkpoint

    with pytest.raises(HoloServeError, match=message):  # before anything is loaded: the path need not exist
        evaluate_checkpoint(tmp_path / "no-checkpoint", EvalOptions(data_dir=tmp_path, **options))


def test_compare_predictions_counts_and_mcnemar():
    from holoserve.data.metrics import compare_predictions, mcnemar_exact_p
    from holoserve.data.tasks import get_task

    labels = np.array([0, 1, 1, 0, 1, 0])
    ref = np.eye(2)[[0, 1, 0, 0, 0, 1]]  # right on rows 0, 1, 3
    here = np.eye(2)[[0, 1, 1, 1, 1, 1]]  # right on rows 0, 1, 2, 4
    cmp = compare_predictions(get_task("sst2"), here, ref, labels)
    assert cmp == {"identical_predictions": pytest.approx(3 / 6, abs=1e-6), "different_predictions": 3,
                   "right_here_only": 2, "right_in_reference_only": 1, "mcnemar_exact_p": 1.0}
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(2, 5) == pytest.approx(0.453125)  # scipy.stats.binomtest(2, 7).pvalue
    assert mcnemar_exact_p(0, 10) == pytest.approx(2 / 1024)
    assert mcnemar_exact_p(300, 200) < 1e-5 and mcnemar_exact_p(200, 300) == mcnemar_exact_p(300, 200)
    reg = compare_predictions(get_task("stsb"), np.array([[1.0], [2.0], [3.5]]), np.array([[1.0], [2.5], [3.0]]),
                              np.array([1.0, 2.0, 3.0]))
    assert reg["max_abs_difference"] == 0.5 and reg["mean_abs_difference"] == pytest.approx(1 / 3, abs=1e-6)
    assert 0.8 < reg["pearson_with_reference"] < 1


def test_eval_predictions_of_a_pair_regression(tmp_path):
    from holoserve.compress.evaluate import write_predictions
    from holoserve.data.tabular import Example

    rows = [Example("a man plays", "a man is playing", 4.2), Example("cats", "the market fell", 0.0)]
    write_predictions(tmp_path / "p.jsonl", rows, np.array([[3.9], [0.5]], np.float32), True, None)
    assert [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()] == [
        {"row": 0, "text": "a man plays", "text_pair": "a man is playing", "label": pytest.approx(4.2), "score": 3.9},
        {"row": 1, "text": "cats", "text_pair": "the market fell", "label": 0.0, "score": 0.5}]


def test_eval_onnx_without_export_says_how_to_make_one(tmp_path):
    from holoserve.compress.evaluate import EvalOptions, evaluate_checkpoint
    from holoserve import HoloServeError

    ckpt = make_calibrated_checkpoint(tmp_path, layers=1)
    with pytest.raises(HoloServeError, match="holoserve export"):
        evaluate_checkpoint(ckpt, EvalOptions(data_dir=_tiny_sst2_dir(tmp_path), onnx=True))


def test_tensorrt_placement_uses_the_ranges_trained_in_qat(tmp_path):
    """Q/K/V, softmax and residual-Add inputs get the checkpoint's QAT ranges; nothing is calibrated here.
    (The test's ranges are shrunk so it can tell them from calibrated ones.)"""
    from onnx import numpy_helper

    from holoserve.export.onnx_export import export_checkpoint

    ckpt = make_calibrated_checkpoint(tmp_path, layers=2, tensorrt_qat=True)
    res = export_checkpoint(ckpt, ["tensorrt"], progress=False, tensorrt_residuals="int8")
    # per layer: residual Adds 2 x 2 inputs, attention MatMuls Q, K, V + softmax, all trained
    assert res.report["tensorrt_extra_ranges"] == {"from_checkpoint_qat": 16, "calibrated_here": 0}
    amax = load_artifact(ckpt).activation_amax()
    m = onnx.load(str(ckpt / "model.trt.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    q_scales = sorted({float(inits[n.input[1]]) for n in m.graph.node if n.op_type == "QuantizeLinear"})
    trained = [k for k in amax if k.endswith((".residual", ".output", ".softmax"))]
    assert len(trained) == 16
    for k in trained:  # every trained range is the scale of some Q/DQ pair in the graph
        assert np.isclose(q_scales, amax[k] / 127, rtol=1e-6).any(), k


def test_tensorrt_placement_can_leave_the_residual_adds_in_float(tmp_path):
    """tensorrt_residuals="float" (--tensorrt-float-residuals): the attention MatMuls keep both inputs
    quantized, the residual Adds read float tensors, and their QAT ranges are not used."""
    from holoserve.export.onnx_export import export_checkpoint

    ckpt = make_calibrated_checkpoint(tmp_path, layers=2, tensorrt_qat=True)
    res = export_checkpoint(ckpt, ["tensorrt"], progress=False, tensorrt_residuals="float")
    # per layer: Q, K, V + softmax (trained); no residual-Add inputs
    assert res.report["tensorrt_extra_ranges"] == {"from_checkpoint_qat": 8, "calibrated_here": 0}
    m = onnx.load(str(ckpt / "model.trt.onnx"))
    prod = {o: x for x in m.graph.node for o in x.output}
    mm = [x for x in m.graph.node if x.op_type == "MatMul"]  # 2 x 6 Linears + 2 x 2 attention MatMuls
    assert len(mm) == 16 and all(prod[i].op_type == "DequantizeLinear" for x in mm for i in x.input)
    adds = [x for x in m.graph.node if x.op_type == "Add" and len(x.input) == 2 and all(i in prod for i in x.input)]
    residual = [x for x in adds if "encoder" in x.name and any(prod[i].op_type == "Add" for i in x.input)]
    assert len(residual) == 4 and not any(prod[i].op_type == "DequantizeLinear" for x in residual for i in x.input)
    entry = load_artifact(ckpt).export("tensorrt-onnx")
    assert "0 of 8 residual Add inputs" in entry.activations
    assert entry.residual_adds["mode"] == "float" and len(entry.residual_adds["float"]) == 8


def _exact_int8_session(path: Path):
    """ORT with exact int8 GEMMs on every CPU: session.x64quantprecision swaps the uint8 x int8 GEMM for
    uint8 x uint8 where the former saturates (x86-64 without VNNI) and changes nothing elsewhere."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.x64quantprecision", "1")
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


def test_tensorrt_qat_numerics_are_what_model_trt_onnx_computes(tmp_path):
    """QAT trains what the TensorRT placement deploys: PyTorch with the checkpoint's TensorRT-QAT quantizers
    and ONNX Runtime on model.trt.onnx give the same logits, padded rows included, while `holoserve eval`'s
    numerics (Linear inputs only) are far off; "auto" follows what QAT left in float, and the export's
    check reports the comparison, or where ORT's own int8 GEMM saturates on this CPU, says so."""
    from holoserve.export.onnx_export import export_checkpoint
    from holoserve.export.reference import load_torch_model, reference_logits
    from holoserve.export.checks import INT8_GEMM_SATURATES, int8_gemm_saturates, ort_logits

    ckpt = make_calibrated_checkpoint(tmp_path, layers=2, tensorrt_qat=True, classifier_gain=300.0)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    amax = manifest["quantization"]["activations"]["amax"]
    del amax[next(k for k in amax if k.endswith("layer.1.output.dense.output"))]  # as if its SQNR were low
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    res = export_checkpoint(ckpt, ["tensorrt"], progress=False)
    rec = load_artifact(ckpt).export("tensorrt-onnx").residual_adds
    assert rec["chosen_by"] == "checkpoint's TensorRT QAT" and len(rec["float"]) == 1 and rec["int8"] == 7
    assert res.report["tensorrt_extra_ranges"] == {"from_checkpoint_qat": 15, "calibrated_here": 0}
    v = res.report["verification"]["tensorrt"]
    if int8_gemm_saturates():  # the check ran a kernel that clamps pair sums: its number is not the export's
        assert v["onnxruntime_int8_gemm"] == INT8_GEMM_SATURATES
    else:
        assert "onnxruntime_int8_gemm" not in v and v["parity_vs_pytorch_tensorrt_qat"]["max_abs_diff"] < 1e-3

    art = load_artifact(ckpt)
    model = load_torch_model(art)
    b = _feeds(model.config.vocab_size, 6, 12)
    b["attention_mask"][3:, 8:] = 0
    got = ort_logits(_exact_int8_session(ckpt / "model.trt.onnx"), [b])
    trained = reference_logits(model, art, [b], tensorrt=True)
    plain = reference_logits(model, art, [b])
    assert np.abs(got - trained).max() < 1e-4
    assert np.abs(got - plain).max() > 1e-2 > 100 * np.abs(got - trained).max()


def _residual_qdq(path: Path) -> tuple[int, set[str]]:
    """(residual-Add inputs in the graph, those of them read through a DequantizeLinear, by source tensor)."""
    m = onnx.load(str(path))
    prod = {o: x for x in m.graph.node for o in x.output}
    adds = [x for x in m.graph.node if x.op_type == "Add" and "encoder" in x.name and len(x.input) == 2
            and all(i in prod for i in x.input)]
    residual = [x for x in adds if any(prod[i].op_type in ("Add", "DequantizeLinear") for i in x.input)
                and any(prod[i].op_type in ("LayerNormalization", "DequantizeLinear") for i in x.input)]
    inputs = [i for x in residual for i in x.input]
    quantized = {prod[prod[i].input[0]].input[0] for i in inputs if prod[i].op_type == "DequantizeLinear"}
    return len(inputs), quantized


def test_tensorrt_residuals_auto_spares_exactly_the_inputs_below_the_sqnr_floor(tmp_path, monkeypatch):
    """"auto" measures every residual input's INT8 SQNR on the calibration rows, records it, and leaves in
    float exactly those below qdq.RESIDUAL_MIN_SQNR_DB; the others keep their Q/DQ pair with the range that
    "int8" gives them."""
    from holoserve.export import qdq
    from holoserve.export.onnx_export import export_checkpoint

    ckpt = make_calibrated_checkpoint(tmp_path, layers=2, biases=True)
    export_checkpoint(ckpt, ["tensorrt"], progress=False, verify_exports=False, tensorrt_residuals="int8")
    n_int8, q_int8 = _residual_qdq(ckpt / "model.trt.onnx")
    assert n_int8 == 8 and len(q_int8) == 8
    assert load_artifact(ckpt).export("tensorrt-onnx").residual_adds == {"mode": "int8", "int8": 8, "float": []}

    # random weights: every residual input is near-Gaussian, ~40 dB in INT8, so all stay quantized
    export_checkpoint(ckpt, ["tensorrt"], progress=False, verify_exports=False)
    rec = load_artifact(ckpt).export("tensorrt-onnx").residual_adds
    assert rec["mode"] == "auto" and rec["float"] == [] and rec["min_sqnr_db"] == qdq.RESIDUAL_MIN_SQNR_DB
    sqnr = rec["sqnr_db"]
    assert set(sqnr) == q_int8 and all(25 < v < 60 for v in sqnr.values())
    assert _residual_qdq(ckpt / "model.trt.onnx") == (8, q_int8)

    # a floor between the measured values sends exactly the lower ones to float
    floor = sorted(sqnr.values())[3] + 1e-3
    monkeypatch.setattr(qdq, "RESIDUAL_MIN_SQNR_DB", floor)
    export_checkpoint(ckpt, ["tensorrt"], progress=False, verify_exports=False)
    rec = load_artifact(ckpt).export("tensorrt-onnx").residual_adds
    low = {t for t, v in sqnr.items() if v < floor}
    assert len(low) == 4 and set(rec["float"]) == low and rec["int8"] == 4
    assert _residual_qdq(ckpt / "model.trt.onnx") == (8, q_int8 - low)
    assert "4 of 8 residual Add inputs" in load_artifact(ckpt).export("tensorrt-onnx").activations


def test_int8_error_separates_outlier_tensors_from_gaussian_ones():
    """The SQNR behind "auto": a Gaussian tensor at its max range keeps ~40 dB; one whose range is set by rare
    outliers 100x the bulk (as the FFN outputs of trained BERTs) rounds most values to zero and falls
    far below the 20 dB floor."""
    from holoserve.export.qdq import RESIDUAL_MIN_SQNR_DB, int8_error

    rng = np.random.default_rng(0)
    x = rng.standard_normal(100_000).astype(np.float32)
    signal, noise = int8_error(x, float(np.abs(x).max()))
    assert np.isclose(signal, float((x.astype(np.float64) ** 2).sum()))
    step = np.abs(x).max() / 127
    assert np.isclose(noise / x.size, step ** 2 / 12, rtol=0.05)  # uniform rounding noise
    assert 10 * np.log10(signal / noise) > RESIDUAL_MIN_SQNR_DB + 15
    y = x.copy()
    y[::10_000] = 100.0  # 0.01 % outliers
    signal, noise = int8_error(y, 100.0)
    assert 10 * np.log10(signal / noise) < RESIDUAL_MIN_SQNR_DB
    signal, noise = int8_error(y, 50.0)  # a clipped range adds the clipping error
    assert noise > int8_error(y, 100.0)[1]


def test_eval_cli_onnx_flag(exported, tmp_path, capsys):
    from holoserve.cli import main

    ckpt, _ = exported
    assert main(["eval", str(ckpt), "--data-dir", str(_tiny_sst2_dir(tmp_path)), "--onnx", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["numerics"].startswith("ONNX Runtime") and out["rows"] == 8 and "accuracy" in out["metrics"]
    assert main(["eval", str(ckpt), "--data-dir", str(_tiny_sst2_dir(tmp_path)), "--onnx",
                 "--onnx-export", "tensorrt-onnx"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "model.trt.onnx" in out["numerics"] and out["rows"] == 8
    assert main(["eval", str(ckpt), "--data-dir", str(_tiny_sst2_dir(tmp_path)), "--onnx", "--fp32"]) != 0
    assert "do not combine" in capsys.readouterr().err
    assert main(["eval", str(ckpt), "--data-dir", str(_tiny_sst2_dir(tmp_path)), "--backend", "onnxruntime",
                 "--compare", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["numerics"].startswith("ONNX Runtime") and out["compare"]["identical_predictions"] == 1.0
    # the checkpoint's own numerics are the `torch` backend, as in serving; "pytorch", its earlier name, still works
    for name in ("torch", "pytorch"):
        assert main(["eval", str(ckpt), "--data-dir", str(_tiny_sst2_dir(tmp_path)), "--backend", name]) == 0
        assert not json.loads(capsys.readouterr().out)["numerics"].startswith("ONNX Runtime")
    assert main(["eval", str(ckpt), "--data-dir", str(_tiny_sst2_dir(tmp_path)), "--backend", "torch",
                 "--compare"]) != 0
    assert "--compare compares" in capsys.readouterr().err


# ------------------------------------------------------------------------------ attention fusion (ORT)


def _feeds(vocab: int, rows: int, seq: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, (rows, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def test_onnxruntime_target_fuses_attention_into_multihead_attention(exported):
    ckpt, res = exported
    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    m = onnx.load(str(ckpt / "model.onnx"))
    ops = [n.op_type for n in m.graph.node]
    inner = [n for n in m.graph.node if n.op_type == "MultiHeadAttention"]
    assert "Softmax" not in ops and "If" not in ops and len(inner) == layers
    assert {x.domain for x in inner} == {"com.microsoft"}
    # every block gets the [batch, seq] padding mask, padded or not (one kernel: a row scores the same
    # in any batch); all read the Q/K/V projections, whose integer MatMuls already added the biases
    from holoserve.export.fusion import MASK_INT32

    assert all(x.input[4] == MASK_INT32 for x in inner)
    prod = {o: n for n in m.graph.node for o in n.output}
    assert all(prod[t].op_type == "MatMulIntegerToFloat" for x in inner for t in x.input[:3])
    assert all(len(x.input) < 4 or not x.input[3] for x in inner)
    entry = res.entries["onnxruntime"]["attention"]
    assert entry["blocks"] == layers and entry["num_heads"] == 2
    # the mask-building subgraph of the eager export is gone with the blocks that read it
    assert "Expand" not in ops and "Where" not in ops
    # the TensorRT target keeps explicit attention MatMuls for its Q/DQ pairs
    assert "Softmax" in {n.op_type for n in onnx.load(str(ckpt / "model.trt.onnx")).graph.node}


def test_fused_attention_matches_the_unfused_graph_padded_or_not(exported, tmp_path):
    from holoserve.export.onnx_export import export_checkpoint
    from holoserve.export.checks import ort_session

    ckpt, _ = exported
    export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path, progress=False, polygraphy=False, verify_exports=False,
                      fuse_attention=False)
    plain = onnx.load(str(tmp_path / "model.onnx"))
    assert "Softmax" in {n.op_type for n in plain.graph.node}
    fused, unfused = ort_session(ckpt / "model.onnx"), ort_session(tmp_path / "model.onnx")
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    padded = _feeds(vocab, 4, 19, seed=1)
    padded["attention_mask"][1, 7:] = 0
    padded["attention_mask"][3, 12:] = 0
    for feed in (_feeds(vocab, 3, 16), padded):
        a, b = fused.run(None, feed)[0], unfused.run(None, feed)[0]
        np.testing.assert_allclose(a, b, atol=1e-4)
    # the mask really masks, and exactly: a padded row scores as that row alone, to the bit
    alone = {k: v[1:2, :7] for k, v in padded.items()}
    junk = {k: v.copy() for k, v in padded.items()}
    junk["input_ids"][1, 7:] = 7
    np.testing.assert_array_equal(fused.run(None, junk)[0][1], fused.run(None, alone)[0][0])
    np.testing.assert_array_equal(fused.run(None, padded)[0][1], fused.run(None, alone)[0][0])


def test_fusion_refuses_an_attention_graph_it_cannot_match(exported, tmp_path):
    from holoserve.export.fusion import find_attention, fuse_attention
    from holoserve.export.onnx_export import export_checkpoint

    ckpt, _ = exported
    export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path, progress=False, polygraphy=False, verify_exports=False,
                      fuse_attention=False)
    m = onnx.load(str(tmp_path / "model.onnx"))
    assert len(find_attention(m)) == 2
    # a block whose attention probabilities are also read elsewhere is left alone ...
    sm = [n for n in m.graph.node if n.op_type == "Softmax"]
    m.graph.output.append(onnx.helper.make_empty_tensor_value_info(sm[0].output[0]))
    assert len(find_attention(m)) == 1
    # ... so is one whose additive term is not the padding mask (a learned bias would be lost)
    add = next(n for n in m.graph.node if n.output[0] == sm[1].input[0])
    bias = onnx.numpy_helper.from_array(np.zeros((1, 2, 8, 8), np.float32), "relative_position_bias")
    m.graph.initializer.append(bias)
    saved = add.input[1]
    add.input[1] = bias.name
    assert len(find_attention(m)) == 0
    add.input[1] = saved
    assert len(find_attention(m)) == 1
    # ... and a graph with Softmax nodes but no block to fuse is an error, not a silent no-op
    for s in sm[1:]:
        m.graph.output.append(onnx.helper.make_empty_tensor_value_info(s.output[0]))
    with pytest.raises(ValueError, match="no eager self-attention block"):
        fuse_attention(m, 2)
    with pytest.raises(ValueError, match="num_heads"):
        fuse_attention(m, 0)


def test_cpu_latency_bench_can_give_the_baselines_the_same_attention_fusion(exported, tmp_path, monkeypatch):
    """bench/cpu_latency end to end on the tiny export: every engine timed and scored on dev (the
    OpenVINO ones, NNCF's INT8 calibrated on training rows, where OpenVINO and NNCF are installed,
    ours on HoloServe's 2:4 kernels where the CPU can run them, else skipped with the reason), ORT
    baselines given our attention fusion and classifier-row rewrite on request."""
    import importlib.util
    import shutil

    from holoserve.export.onnx_export import export_checkpoint
    from holoserve.kernels import cpu_missing
    from tests.helpers.bench import bench_module

    monkeypatch.delenv("HOLOSERVE_DATA_DIR", raising=False)
    has_ov = importlib.util.find_spec("openvino") is not None
    has_nncf = has_ov and importlib.util.find_spec("nncf") is not None
    has_kernels = has_ov and not cpu_missing()  # AVX-512 VNNI and VBMI
    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported[0], ckpt)  # the module's checkpoint stays without an openvino export
    if has_ov:
        export_checkpoint(ckpt, ["openvino"], progress=False, polygraphy=False, verify_exports=False)
    glue = tmp_path / "glue"
    (glue / "SST-2").mkdir(parents=True)
    texts = ["a good film", "the plot is thin and the acting is worse", "fun", "dull , slow and long",
             "a warm , funny story", "i wanted to leave"]
    for split, n in (("train", 12), ("dev", 6)):
        (glue / "SST-2" / f"{split}.tsv").write_text(
            "sentence\tlabel\n" + "".join(f"{texts[i % 6]}\t{i % 2}\n" for i in range(n)))
    run = bench_module("cpu_latency", "run")
    rc = run.main([str(ckpt), "--out", str(tmp_path), "--name", "lat", "--runs", "2", "--warmup", "1",
                   "--batches", "1,2", "--seqs", "8", "--threads", "1", "--fuse-baseline-attention",
                   "--baseline-classifier-row", "--data-dir", str(glue), "--calibration-rows", "8",
                   *(["--also", str(ckpt)] if has_ov else [])])
    assert rc == 0
    r = json.loads((tmp_path / "lat.json").read_text())
    assert r["also_checkpoint"] == ("ckpt" if has_ov else None)
    assert r["method"]["baseline_attention"].startswith("2 blocks fused")
    assert [(x["batch"], x["seq"]) for x in r["results"]] == [(1, 8), (2, 8)]
    ran = [k for k in run.ENGINES if (k not in run.OPENVINO_ENGINES and k not in run.STATIC_OF or has_ov)
           and (run.STATIC_OF.get(k, k) != "openvino_nncf_int8" or has_nncf)
           and (k not in run.KERNEL_ROWS or has_kernels)]
    assert r["engines"] == ran and set(r["skipped_engines"]) == set(run.ENGINES) - set(ran)
    for k, why in r["skipped_engines"].items():  # never silently: the reason is recorded and shown
        assert ("not installed" in why or why == "no --also checkpoint given"
                or k in run.KERNEL_ROWS and why.startswith(f"this CPU lacks {', '.join(cpu_missing())}"))
        assert f"Not run: {run.LABELS[k]}" in (tmp_path / "lat.md").read_text()
    for x in r["results"]:
        assert all(x[k]["median_ms"] > 0 for k in ran)
    dynamic = [k for k in ran[1:] if k not in run.STATIC_OF]  # static rows: the same models, one shape each
    assert set(r["dev_accuracy"]) >= set(dynamic) and r["dev_accuracy"]["rows"] == 6
    assert all(0.0 <= r["dev_accuracy"][k] <= 1.0 for k in dynamic)
    assert not set(r["dev_accuracy"]) & set(run.STATIC_OF)
    if has_nncf:
        assert r["method"]["nncf_calibration"]["rows"] == 8
        assert r["openvino"]["openvino_nncf_int8"]["gemm_precisions"].get("u8", 0) > 0  # NNCF made INT8 GEMMs
        assert all(x["speedup_vs_openvino_nncf_int8"]["openvino_nncf_int8"] == 1.0 for x in r["results"])
    if has_ov:
        assert r["openvino"]["ours_openvino"]["gemm_precisions"].get("u8", 0) > 0
        # the A/B row: the same model with OpenVINO's sparse-weight decompression on (where the CPU has AMX)
        from holoserve.backends.openvino import cpu_has_amx

        assert r["openvino"]["ours_openvino"]["sparse_weights_decompression"].startswith("off")
        assert r["openvino"]["ours_openvino_f32"]["inference_precision"] == "f32"  # holoserve eval's numerics
        assert r["openvino"]["ours_openvino_sparse"]["sparse_weights_decompression"].startswith(
            "on" if cpu_has_amx() else "off: this CPU has no AMX")
    assert r["method"]["baseline_classifier_row"] == "last layer on the [CLS] row only, as in ours (17 nodes)"
    md = (tmp_path / "lat.md").read_text()
    assert "Attention in the ORT baselines: 2 blocks fused" in md and "their last layer: last layer on the [CLS]" in md
    assert all(f" {run.LABELS[k]} |" in md for k in ran)
    if has_nncf:  # ours static: both precisions, the 2:4 kernels where they run, the --also checkpoint; vs NNCF static
        assert md.count("vs OpenVINO INT8 (NNCF PTQ), static shape: batch 1 seq 8 ×") == 3 + has_kernels
    if has_nncf:  # the per-operation profile of ours and NNCF's INT8 on OpenVINO
        prof = bench_module("cpu_latency", "profile_openvino")
        assert prof.main([str(ckpt), "--dense", str(ckpt), "--data-dir", str(glue), "--calibration-rows", "8",
                          "--batch", "2", "--seq", "8", "--runs", "2", "--warmup", "1", "--out", str(tmp_path),
                          "--name", "prof", "--kernels"]) == 0
        p = json.loads((tmp_path / "prof.json").read_text())
        assert ("ours on OpenVINO + 2:4 kernels / NNCF" in (tmp_path / "prof.md").read_text()) == has_kernels
        assert p["skipped_engines"] == ({} if has_kernels else {"ours_openvino_kernels": run.kernels_missing()})
        assert ("Not run: ours on OpenVINO + 2:4 kernels" in (tmp_path / "prof.md").read_text()) != has_kernels
        for k in ("ours_openvino", "openvino_nncf_int8", *(["ours_openvino_kernels"] if has_kernels else [])):
            e = p["engines"][k]
            assert e["per_class_ms"]["gemm"] > 0 and e["wall_median_ms"] > 0
            assert abs(sum(e["per_class_ms"].values()) - e["node_sum_ms"]) < 0.01
            assert any(x["kind"].startswith("FullyConnected") for x in e["per_kind"])
        assert "| gemm (ms, share) |" in (tmp_path / "prof.md").read_text()
    # no OpenVINO export in the checkpoint, and no data dir: ours on OpenVINO and NNCF's INT8 say why they did not run
    if has_nncf:
        rc = run.main([str(exported[0]), "--out", str(tmp_path), "--name", "lat2", "--runs", "1", "--warmup", "1",
                       "--batches", "1", "--seqs", "8", "--threads", "1", "--skip", "ort_fp32,ort_dynamic_int8"])
        assert rc == 0
        r = json.loads((tmp_path / "lat2.json").read_text())
        assert r["engines"] == ["pytorch_fp32", "openvino_fp32", "ours_qdq_int8"]
        assert "--target openvino" in r["skipped_engines"]["ours_openvino"]
        assert r["skipped_engines"]["ours_openvino_static"] == r["skipped_engines"]["ours_openvino"]
        assert r["skipped_engines"]["ours_openvino_static_f32"] == r["skipped_engines"]["ours_openvino_f32"]
        assert "training rows to calibrate on" in r["skipped_engines"]["openvino_nncf_int8"]
        assert r["skipped_engines"]["ort_fp32"] == "left out (--skip)"
        assert "skipped" in r["dev_accuracy"]  # no data dir given: latency only, said so
        assert r["skipped_engines"]["also_openvino_static"] == "no --also checkpoint given"
        with pytest.raises(SystemExit, match="--also .*no OpenVINO export .*--target openvino"):
            run.main([str(ckpt), "--also", str(exported[0]), "--out", str(tmp_path), "--name", "lat3"])


def test_fused_ops_match_standard_onnx_ops(exported, tmp_path):
    """Every ORT-specific rewrite (integer MatMuls with folded biases, MultiHeadAttention, the
    classifier row) gives the logits of the same export written with standard ONNX ops only and
    all rows computed, padded rows included."""
    from holoserve.export.onnx_export import export_checkpoint
    from holoserve.export.checks import ort_session

    ckpt, _ = exported
    kw = {"progress": False, "polygraphy": False, "verify_exports": False}
    export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path / "plain", fuse_attention=False, fuse_matmul=False,
                      fuse_gelu=False, classifier_row=False, **kw)
    export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path / "mha", fuse_matmul=False, **kw)
    # standard ops, last layer on the [CLS] row, the attention along its query path too
    rows_res = export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path / "rows", fuse_attention=False,
                                 fuse_matmul=False, fuse_gelu=False, **kw)
    # Q projection (MatMul, bias Add), the 9 nodes of the attention's query path (head split Reshape + Transpose,
    # Q·Kᵀ, scale, mask Add, Softmax, ·V, Transpose + Reshape), output projection (activation Q, DQ, MatMul, bias
    # Add), residual Add, LayerNorm, feed-forward 2 x (Q, DQ, MatMul, bias Add) around the 5-op GELU, residual
    # Add, LayerNorm; Slices: the dequantized Q/K/V input, the padding mask (along the query axis), the residual
    assert rows_res.entries["onnxruntime"]["fused_ops"]["classifier_row"] == {"row_nodes": 32, "slices": 3}
    rows = onnx.load(str(tmp_path / "rows" / "model.onnx"))
    prod = {o: n for n in rows.graph.node for o in n.output}
    last_softmax = [n for n in rows.graph.node if n.op_type == "Softmax"][-1]
    mask_add = prod[last_softmax.input[0]]
    sliced = [prod[t] for t in mask_add.input if prod[t].op_type == "Slice"]
    assert len(sliced) == 1 and _inits(rows)[sliced[0].input[3]].tolist() == [2]  # the mask's query axis
    scores = prod[prod[[t for t in mask_add.input if prod[t] is not sliced[0]][0]].input[0]]

    def projection_input(heads):  # Transpose <- Reshape <- bias Add <- MatMul: what the projection reads
        add = prod[prod[heads.input[0]].input[0]]
        matmul = next(prod[t] for t in add.input if t in prod and prod[t].op_type == "MatMul")
        return prod[matmul.input[0]]

    q_heads, k_heads = (prod[t] for t in scores.input)
    assert projection_input(q_heads).op_type == "Slice"  # the Q projection runs on the [CLS] row ...
    assert projection_input(k_heads).op_type == "DequantizeLinear"  # ... the keys on every row
    plain = onnx.load(str(tmp_path / "plain" / "model.onnx"))
    assert not [n for n in plain.graph.node if n.domain]
    assert {"MatMul", "DequantizeLinear", "Softmax"} <= {n.op_type for n in plain.graph.node}
    # without the integer MatMuls, the attention fusion takes the Q/K/V biases into its own bias input
    mha = onnx.load(str(tmp_path / "mha" / "model.onnx"))
    inner = [n for n in mha.graph.node if n.op_type == "MultiHeadAttention"]
    hidden = json.loads((ckpt / "config.json").read_text())["hidden_size"]
    assert inner and all(_inits(mha)[x.input[3]].shape == (3 * hidden,) for x in inner)
    sessions = [ort_session(p) for p in (ckpt / "model.onnx", tmp_path / "mha" / "model.onnx",
                                         tmp_path / "rows" / "model.onnx", tmp_path / "plain" / "model.onnx")]
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    padded = _feeds(vocab, 4, 19, seed=2)
    padded["attention_mask"][2, 5:] = 0
    for feed in (_feeds(vocab, 3, 16, seed=3), padded):
        ref = sessions[-1].run(None, feed)[0]
        assert np.abs(ref).max() > 0.01  # the biases were not all zero (else nothing was tested)
        for s in sessions[:-1]:
            np.testing.assert_allclose(s.run(None, feed)[0], ref, atol=1e-4)


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu_new"])
def test_tanh_gelu_model_exports_fast_gelu(tmp_path, act):
    """A model whose feed-forward activation is the tanh GELU (torch's spelling, or the Pow one of
    gelu_new): the ORT target computes it with FastGelu and scores as the elementwise spelling and
    the PyTorch fake-quant model do."""
    from holoserve.export.onnx_export import export_checkpoint
    from holoserve.export.checks import ort_session

    ckpt = make_calibrated_checkpoint(tmp_path, biases=True, hidden_act=act)
    assert json.loads((ckpt / "config.json").read_text())["hidden_act"] == act
    res = export_checkpoint(ckpt, ["onnxruntime"], progress=False, polygraphy=False)
    entry = res.entries["onnxruntime"]
    assert entry["fused_ops"]["fast_gelu"] == 2
    par = entry["verification"]["parity_vs_pytorch_fakequant"]
    assert par["rows"] > 0 and par["max_abs_diff"] < 0.05  # as close as the exact-GELU export (above)
    m = onnx.load(str(ckpt / "model.onnx"))
    ops = [(n.op_type, n.domain) for n in m.graph.node]
    assert ops.count(("FastGelu", "com.microsoft")) == 2 and ops.count(("Tanh", "")) == 1  # the pooler's
    export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path / "plain", progress=False, polygraphy=False,
                      verify_exports=False, fuse_gelu=False)
    assert [n.op_type for n in onnx.load(str(tmp_path / "plain" / "model.onnx")).graph.node].count("Tanh") == 3
    feed = _feeds(json.loads((ckpt / "config.json").read_text())["vocab_size"], 3, 16, seed=4)
    np.testing.assert_allclose(ort_session(ckpt / "model.onnx").run(None, feed)[0],
                               ort_session(tmp_path / "plain" / "model.onnx").run(None, feed)[0], atol=1e-4)


def _gelu_graph(pow_form: bool = False, c: float = 0.044715, read_inner: bool = False):
    from onnx import TensorProto, helper

    k = lambda name, v: helper.make_node("Constant", [], [name],  # noqa: E731
                                         value=helper.make_tensor(name, TensorProto.FLOAT, [], [v]))
    nodes = [k("c", c), k("s", 0.7978845608), k("one", 1.0), k("half", 0.5), k("three", 3.0)]
    if pow_form:  # the gelu_new spelling: 0.5 * x * (1 + tanh(s * (x + c * x^3)))
        nodes += [helper.make_node("Pow", ["x", "three"], ["x3"])]
    else:  # torch's gelu(approximate="tanh"): x * x * x
        nodes += [helper.make_node("Mul", ["x", "x"], ["x2"]), helper.make_node("Mul", ["x", "x2"], ["x3"])]
    nodes += [helper.make_node("Mul", ["c", "x3"], ["cx3"]), helper.make_node("Add", ["x", "cx3"], ["inner"]),
              helper.make_node("Mul", ["s", "inner"], ["arg"]), helper.make_node("Tanh", ["arg"], ["t"]),
              helper.make_node("Add", ["one", "t"], ["t1"]), helper.make_node("Mul", ["half", "x"], ["hx"]),
              helper.make_node("Mul", ["hx", "t1"], ["y"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if read_inner:
        outs.append(helper.make_tensor_value_info("t", TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])], outs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8  # what the exporter writes; ONNX Runtime may lag the onnx package
    return m


def test_gelu_tanh_fusion_checks_the_formula_not_the_spelling():
    from holoserve.export.fusion import fuse_gelu_tanh, gelu_tanh

    for pow_form in (False, True):
        m = _gelu_graph(pow_form)
        assert fuse_gelu_tanh(m) == 1
        assert [(n.op_type, list(n.input), list(n.output)) for n in m.graph.node] == [("FastGelu", ["x"], ["y"])]
        x = np.linspace(-5, 5, 40, dtype=np.float32).reshape(10, 4)
        y = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(y, gelu_tanh(x), atol=1e-5)
    # a lookalike with another constant, or one whose inner tensor is read elsewhere, is left alone
    for m in (_gelu_graph(c=0.05), _gelu_graph(read_inner=True)):
        before = [n.op_type for n in m.graph.node]
        assert fuse_gelu_tanh(m) == 0 and [n.op_type for n in m.graph.node] == before


def test_cpu_latency_compare_times_exports_side_by_side(exported, tmp_path, capsys):
    from holoserve.export.onnx_export import export_checkpoint
    from tests.helpers.bench import bench_module

    ckpt, _ = exported
    export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path / "plain", progress=False, polygraphy=False,
                      verify_exports=False, fuse_attention=False, fuse_matmul=False)
    compare = bench_module("cpu_latency", "compare")
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    models = [f"fused={ckpt / 'model.onnx'}", f"plain={tmp_path / 'plain' / 'model.onnx'}"]
    rc = compare.main(models + ["--batch", "2", "--seq", "8", "--runs", "3", "--warmup", "1", "--rounds", "2",
                                "--vocab", str(vocab), "--out", str(tmp_path), "--name", "ab"])
    assert rc == 0
    r = json.loads((tmp_path / "ab.json").read_text())
    assert list(r["median_ms"]) == ["fused", "plain"] and r["speedup_vs_first"]["fused"] == 1.0
    assert len(r["rounds"]) == 2 and all(v > 0 for v in r["median_ms"].values())
    assert "| plain |" in (tmp_path / "ab.md").read_text() and r["runtime"] == "onnxruntime"
    import importlib.util

    if importlib.util.find_spec("openvino") is not None:  # two OpenVINO models, each compiled for the shape
        export_checkpoint(ckpt, ["openvino"], out_dir=tmp_path / "ov", progress=False, polygraphy=False,
                          verify_exports=False)
        ov_models = [f"a={tmp_path / 'ov' / 'model.ov.onnx'}", f"b={tmp_path / 'ov' / 'model.ov.onnx'}"]
        assert compare.main(ov_models + ["--runtime", "openvino", "--batch", "2", "--seq", "8", "--runs", "3",
                                         "--warmup", "1", "--rounds", "1", "--vocab", str(vocab), "--out",
                                         str(tmp_path), "--name", "ab-ov"]) == 0
        r = json.loads((tmp_path / "ab-ov.json").read_text())
        assert r["runtime"] == "openvino" and r["openvino"] and all(v > 0 for v in r["median_ms"].values())
        assert "compiled for this one shape" in (tmp_path / "ab-ov.md").read_text()
    for bad, msg in ((models[:1], "at least two"), ([str(ckpt / "model.onnx")] * 2, "LABEL=PATH"),
                     ([models[0], "fused=" + str(tmp_path / "plain" / "model.onnx")], "labels must differ"),
                     ([models[0], "x=" + str(tmp_path / "missing.onnx")], "no such ONNX file")):
        with pytest.raises(SystemExit, match=msg):
            compare.main(bad + ["--out", str(tmp_path)])


def test_export_refuses_when_the_integer_matmul_rewrite_misses_a_linear(exported, tmp_path, monkeypatch):
    """An exporter change that the rewrite no longer matches must not silently ship the slower graph."""
    from holoserve.export import fusion
    from holoserve.export.onnx_export import export_checkpoint
    from holoserve import HoloServeError

    ckpt, _ = exported
    real = fusion.fuse_integer_matmuls

    def misses_one(model):  # as if one Linear's pattern were not recognised: undo nothing, under-report
        got = real(model)
        return {**got, "matmuls": got["matmuls"] - 1}

    monkeypatch.setattr(fusion, "fuse_integer_matmuls", misses_one)
    with pytest.raises(HoloServeError, match=r"matched 11 of 12.*--no-fuse-matmul"):
        export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path, progress=False, verify_exports=False)
    assert not (tmp_path / "model.onnx").exists()


# ------------------------------------------------------------------------ classifier row (ORT)


def test_last_layer_computes_only_the_classifier_row(exported, tmp_path):
    """The last layer runs its Q projection, attention query, output projection, LayerNorms and
    feed-forward on the [CLS] row only, keys and values on every token; logits are unchanged."""
    from holoserve.export.standard_rewrites import CLS_SUFFIX
    from holoserve.export.onnx_export import export_checkpoint
    from holoserve.export.checks import ort_session

    ckpt, res = exported
    got = res.entries["onnxruntime"]["fused_ops"]["classifier_row"]
    # Q projection, attention (MultiHeadAttention), output projection, residual Add, LayerNorm, 2 x (quantizer +
    # projection), the 5 ops of the erf GELU, residual Add, LayerNorm
    assert got == {"row_nodes": 17, "slices": 2}
    m = onnx.load(str(ckpt / "model.onnx"))
    prod = {o: n for n in m.graph.node for o in n.output}
    slices = [n for n in m.graph.node if n.op_type == "Slice" and n.output[0].endswith(CLS_SUFFIX)]
    assert len(slices) == 2
    # one Slice feeds the last query projection its input row (uint8, shared with K and V) ...
    last_mha = [n for n in m.graph.node if n.op_type == "MultiHeadAttention"][-1]
    q = last_mha.input[0]
    assert prod[q].op_type == "MatMulIntegerToFloat" and prod[prod[q].input[0]].op_type == "Slice"
    k = last_mha.input[1]
    assert prod[prod[k].input[0]].op_type == "QuantizeLinear"  # ... keys (and values) read every row
    # ... the other feeds the residual its row of the previous layer's output
    assert prod[slices[1].input[0]].op_type == "LayerNormalization"
    export_checkpoint(ckpt, ["onnxruntime"], out_dir=tmp_path, progress=False, polygraphy=False, verify_exports=False,
                      classifier_row=False)
    assert not [n for n in onnx.load(str(tmp_path / "model.onnx")).graph.node if n.output[0].endswith(CLS_SUFFIX)]
    a, b = ort_session(ckpt / "model.onnx"), ort_session(tmp_path / "model.onnx")
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    padded = _feeds(vocab, 4, 19, seed=5)
    padded["attention_mask"][0, 3:] = 0
    padded["attention_mask"][2, 11:] = 0
    for feed in (_feeds(vocab, 3, 16, seed=6), padded, _feeds(vocab, 1, 1, seed=7)):
        np.testing.assert_allclose(a.run(None, feed)[0], b.run(None, feed)[0], rtol=0, atol=1e-6)


def _row_graph(index: int = 0, axis: int = 1):
    """x [B, S, 4] -> MatMul W -> + b = h; mean over the sequence; LayerNorm(h + mean) -> Gather."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
             numpy_helper.from_array(np.ones(4, np.float32), "g"),
             numpy_helper.from_array(np.asarray(index, np.int64), "idx")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["h"]),
             helper.make_node("ReduceMean", ["h"], ["mean"], axes=[1], keepdims=1),
             helper.make_node("Add", ["h", "mean"], ["r"]),
             helper.make_node("LayerNormalization", ["r", "g"], ["n"], axis=-1),
             helper.make_node("Gather", ["n", "idx"], ["y"], axis=axis)]
    g = helper.make_graph(nodes, "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_classifier_row_walk_stops_where_a_tensor_is_needed_whole():
    """Row-wise nodes behind the Gather run on one row; a node that mixes rows (here a mean over the
    sequence) keeps its full input, and the rows-only part reads a Slice of it."""
    from holoserve.export.fusion import tensor_ranks
    from holoserve.export.standard_rewrites import keep_classifier_row

    x = np.random.default_rng(1).standard_normal((3, 5, 4)).astype(np.float32)

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    m = _row_graph()
    ref = run(m)
    assert keep_classifier_row(m, tensor_ranks(m)) == {"row_nodes": 2, "slices": 2}  # the Add and the LayerNorm
    by_out = {n.output[0]: n for n in m.graph.node}
    # both Add inputs are sliced: [B, 1, 4] mean broadcasts over the sequence, so its slice is itself
    assert list(by_out["r"].input) == ["h/cls_row", "mean/cls_row"]
    assert by_out["h"].op_type == "Add" and by_out["mean"].input == ["h"]
    np.testing.assert_allclose(run(m), ref, rtol=0, atol=1e-6)
    n_nodes = len(m.graph.node)
    assert keep_classifier_row(m, tensor_ranks(_row_graph())) == {"row_nodes": 0, "slices": 0}  # applied once only
    assert len(m.graph.node) == n_nodes
    # another row, another axis, or no shapes known: nothing to do
    for m in (_row_graph(index=1), _row_graph(axis=2)):
        before = [(n.op_type, list(n.input)) for n in m.graph.node]
        assert keep_classifier_row(m, tensor_ranks(m)) == {"row_nodes": 0, "slices": 0}
        assert [(n.op_type, list(n.input)) for n in m.graph.node] == before
    assert keep_classifier_row(_row_graph(), {}) == {"row_nodes": 0, "slices": 0}


def _float_types(model) -> dict[str, int]:
    """Element type of every float tensor the graph computes or stores (after ONNX shape inference)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    out = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.output)}
    out.update({i.name: i.data_type for i in g.initializer})
    return {k: v for k, v in out.items() if v in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}


def test_tensorrt_target_is_float16_outside_qdq(exported, tmp_path):
    """--tensorrt-precision fp16: float16 everywhere outside Q/DQ (float16 scales, so every Q/DQ pair stays),
    LayerNormalization and Softmax in float32 between Casts, float32 logits; ORT parity within tolerance."""
    from holoserve.export.onnx_export import export_checkpoint

    ckpt, r32 = exported  # the default: float32
    res = export_checkpoint(ckpt, ["tensorrt"], progress=False, polygraphy=False, out_dir=tmp_path,
                            tensorrt_precision="fp16")
    F, H = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    m = onnx.load(str(tmp_path / "model.trt.onnx"))
    g = m.graph
    assert next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) == 19
    entry = res.entries["tensorrt-onnx"]
    assert entry["opset"] == 19 and "float16 outside Q/DQ" in entry["activations"]
    f16 = entry["fused_ops"]["float16"]
    assert f16["fp32_ops"] == {"LayerNormalization": 5, "Softmax": 2}
    types = _float_types(m)
    kept = [n for n in g.node if n.op_type in ("LayerNormalization", "Softmax")]
    fp32_ok = {"logits"} | {x for n in kept for x in list(n.input) + list(n.output)}
    assert {t for t, v in types.items() if v == F} == fp32_ok & set(types)
    assert all(types[n.output[0]] == H for n in g.node if n.op_type == "DequantizeLinear")
    inits = _inits(m)
    scales = [inits[n.input[1]] for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert scales and all(s.dtype == np.float16 for s in scales)
    # each kept op reads a Cast to float32 and is read through a Cast back to float16
    prod = {o: n for n in g.node for o in n.output}
    assert all(prod[n.input[0]].op_type == "Cast" for n in kept)
    assert g.output[0].type.tensor_type.elem_type == F and prod["logits"].op_type == "Cast"
    # the Q/DQ placement is the float32 one's: same Q/DQ counts, every attention MatMul input dequantized
    m32 = onnx.load(str(ckpt / "model.trt.onnx"))
    assert r32.entries["tensorrt-onnx"]["opset"] == 17 and "fused_ops" not in r32.entries["tensorrt-onnx"]
    assert all(v == F for v in _float_types(m32).values())
    for op in ("QuantizeLinear", "DequantizeLinear", "MatMul"):
        assert entry["ops"][op] == r32.entries["tensorrt-onnx"]["ops"][op]
    assert all(prod[i].op_type == "DequantizeLinear" for x in g.node if x.op_type == "MatMul" for i in x.input)
    # ONNX Runtime parity: float16 vs the PyTorch fake-quant model, and vs the float32 placement
    v = entry["verification"]
    assert v["onnx_checker_full"] == "passed"
    assert v["parity_vs_pytorch_fakequant"]["max_abs_diff"] < 0.05
    assert v["parity_vs_fp32_placement"]["max_abs_diff"] < 0.01
    assert v["parity_vs_fp32_placement"]["argmax_agreement"] == 1.0
    assert "float32 between Casts" in v["ort_float16_note"]


def test_tensorrt_precision_is_validated():
    from holoserve import HoloServeError
    from holoserve.export.options import ExportOptions

    assert ExportOptions().tensorrt_precision == "fp32"
    with pytest.raises(HoloServeError, match="--tensorrt-precision"):
        ExportOptions(tensorrt_precision="bf16").validate()


def test_tensorrt_residuals_option():
    """auto by default; --tensorrt-float-residuals is the same as --tensorrt-residuals float; a bad mode names
    the choices."""
    from holoserve import HoloServeError
    from holoserve.cli import build_parser
    from holoserve.export.options import ExportOptions

    parse = build_parser().parse_args
    assert ExportOptions().tensorrt_residuals == "auto" == parse(["export", "ck"]).tensorrt_residuals
    assert parse(["export", "ck", "--tensorrt-float-residuals"]).tensorrt_residuals == "float"
    assert parse(["export", "ck", "--tensorrt-residuals", "int8"]).tensorrt_residuals == "int8"
    with pytest.raises(HoloServeError, match="--tensorrt-residuals 'some'.*auto, int8, float"):
        ExportOptions(tensorrt_residuals="some").validate()


def test_prediction_check_allows_rounding_flips_but_not_a_different_model():
    """prediction_check (the export's rule): a few borderline rows flipped pass, whichever way (float rounding
    does that); more than 1 % changed, a regression metric moved by more than 0.2 points or a user's
    --max-metric-diff exceeded fail, each with the reason."""
    from holoserve.data.tasks import get_task
    from holoserve.data.metrics import prediction_check

    sst2, stsb = get_task("sst2"), get_task("stsb")
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 872)
    ref = np.zeros((872, 2), np.float32)
    ref[np.arange(872), labels] = 1.0  # the reference gets every row right ...
    ref[:100] = ref[:100, ::-1]  # ... but the first hundred

    def flipped(rows):
        got = ref.copy()
        got[rows] = got[rows, ::-1]
        return got

    rec, why = prediction_check(sst2, flipped([0, 1, 500]), ref, labels)  # two rows right now, one wrong
    assert why is None and rec["changed_predictions"] == 3 and rec["allowed_changed_predictions"] == 8
    assert rec["dev_metric_diff_points"] == pytest.approx(100 / 872, abs=1e-4) and rec["mcnemar_exact_p"] == 1.0
    _, why = prediction_check(sst2, flipped(list(range(5)) + list(range(500, 505))), ref, labels)
    assert why.startswith("10 of 872 predictions changed (allowed 8, 1%")
    rec, why = prediction_check(sst2, flipped(list(range(7))), ref, labels)  # seven rows, all now right: recorded
    assert why is None and (rec["right_here_only"], rec["right_in_reference_only"]) == (7, 0)
    assert rec["mcnemar_exact_p"] == pytest.approx(2 / 2 ** 7)
    # a precision change (float16): more rows may change, the accuracy may not
    even = list(range(10)) + list(range(500, 510))  # 20 rows: ten now right, ten now wrong
    assert prediction_check(sst2, flipped(even), ref, labels, precision_change=True)[1] is None
    _, why = prediction_check(sst2, flipped(list(range(7))), ref, labels, precision_change=True)
    assert why.startswith("the 7 changed predictions change the accuracy (7 right only here, 0 only in the reference")
    _, why = prediction_check(sst2, flipped([0, 1, 500]), ref, labels, max_metric_diff=0.1)
    assert why == "accuracy moved by 0.11 points (allowed by --max-metric-diff: 0.1)"
    small = labels[:12]  # on a dozen rows one change may happen, two may not
    assert prediction_check(sst2, flipped([200])[200:212], ref[200:212], small)[1] is None
    assert prediction_check(sst2, flipped([200, 201])[200:212], ref[200:212], small)[1].startswith("2 of 12")
    y = rng.normal(size=(50, 1)).astype(np.float32)
    assert prediction_check(stsb, y + 1e-4, y, y[:, 0])[1] is None
    rec, why = prediction_check(stsb, y + rng.normal(scale=0.3, size=y.shape), y, y[:, 0])
    assert why.startswith("pearson moved by") and rec["allowed_metric_diff_points"] == 0.2


def test_export_refuses_a_graph_that_changes_dev_predictions(exported, tmp_path, monkeypatch):
    """When the export's dev predictions differ from the PyTorch fake-quant model's by more than rounding
    explains, nothing is written and the error says what changed and what to do."""
    import shutil

    from holoserve.export import verify
    from holoserve.export.checks import ExportVerificationError
    from holoserve.export.onnx_export import export_checkpoint

    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported[0], ckpt)
    before = (ckpt / "manifest.json").read_bytes()
    glue = _tiny_sst2_dir(tmp_path)
    shutil.copy(glue / "SST-2" / "dev.tsv", glue / "SST-2" / "train.tsv")
    real = verify.reference_logits
    monkeypatch.setattr(verify, "reference_logits", lambda *a, **k: -real(*a, **k))  # every class order reversed
    with pytest.raises(ExportVerificationError,
                       match=r"does not reproduce the checkpoint: on dev through ONNX "
                             r"Runtime .* 8 of 8 predictions changed \(allowed 1.*--no-verify"):
        export_checkpoint(ckpt, ["onnxruntime"], data_dir=glue, progress=False, polygraphy=False)
    assert (ckpt / "manifest.json").read_bytes() == before
    res = export_checkpoint(ckpt, ["onnxruntime"], data_dir=glue, progress=False, polygraphy=False,
                            check_predictions=False)  # what --no-verify's users get, with the record kept
    assert res.entries["onnxruntime"]["verification"]["changed_predictions"] == 8
