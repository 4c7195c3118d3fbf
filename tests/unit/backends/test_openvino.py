"""The OpenVINO backend runs the checkpoint's own QDQ model (the openvino export) and `auto` picks the
faster CPU backend by measuring both here, saying so."""
import numpy as np
import pytest

pytest.importorskip("openvino")

from holoserve.backends import load_backend
from holoserve.backends.auto import select_backend
from holoserve.backends.openvino import OpenVinoBackend
from holoserve.backends.profile import batch_sizes
from holoserve.core.artifact import load_artifact
from holoserve.core.tokenizer import TextEncoder, pad_batch
from tests.unit.export.test_export import exported  # noqa: F401  (the fixture: a calibrated tiny checkpoint)


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
    import json

    import onnx

    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    assert entry["fused_ops"]["key_transposes_split"] == layers  # every layer's Kᵀ, for OpenVINO's MatMul
    perms = [list(a.ints) for n in onnx.load(str(ckpt / "model.ov.onnx")).graph.node if n.op_type == "Transpose"
             for a in n.attribute if a.name == "perm"]
    assert [0, 2, 3, 1] not in perms and perms.count([0, 1, 3, 2]) == layers
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
    assert decision["picked"] in ("openvino", "onnxruntime", "onnxruntime+openvino", "openvino+onnxruntime")
    assert backend.name == decision["picked"]
    reason = decision["reason"]
    assert "the fastest CPU backend by the median of" in reason and "rounds timed at start-up on " in reason
    assert reason.count(" ms") == 2 * len(batch_sizes(32))  # both backends at each batch size
    assert decision["serving_profile"] == "none" and "holoserve tune" in reason


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


def test_openvino_refuses_a_precision_whose_gemms_would_run_reference_kernels(with_openvino):
    """OpenVINO's CPU plugin has no optimised INT8 GEMM with f16 outputs on some CPUs (a Xeon with AVX-512
    FP16 ran them in its reference kernel, 2,600x slower): the backend then refuses to load, naming the
    precisions to use, instead of serving at that speed. Whatever loads reports its kernels, none of them
    reference ones, all chosen (dynamic models pick theirs at a first, tiny run)."""
    from holoserve.backends.base import BackendUnavailable

    ckpt, _ = with_openvino
    art = load_artifact(ckpt)
    for precision in ("auto", "f32", "f16"):
        try:
            ov = load_backend("openvino", art, threads=1, openvino_precision=precision)
        except BackendUnavailable as e:
            assert precision == "f16", e  # auto and f32 always have optimised kernels
            assert "reference kernel at inference precision f16" in str(e)
            assert "use --openvino-precision auto, bf16 or f32" in str(e)
            continue
        kernels = ov.info()["gemm_kernels"]
        assert sum(kernels.values()) == sum(ov.info()["gemm_precisions"].values()) > 0
        assert not [k for k in kernels if k.startswith(("ref", "undef"))], kernels


def test_openvino_export_check_runs_at_the_requested_precision(exported, tmp_path):
    from holoserve.export.onnx_export import export_checkpoint

    from tests.unit.export.test_export import _tiny_sst2_dir

    ckpt, _ = exported
    glue = _tiny_sst2_dir(tmp_path)
    (glue / "SST-2" / "train.tsv").write_text((glue / "SST-2" / "dev.tsv").read_text())  # calibration rows
    res = export_checkpoint(ckpt, ["openvino"], progress=False, polygraphy=False, out_dir=tmp_path / "ov",
                            openvino_precision="f32", data_dir=glue)
    v = res.entries["openvino"]["verification"]
    assert v["openvino_inference_precision"] == "f32"
    rows = v["openvino_vs_pytorch_fakequant_rows"]  # labelled dev rows: which rows each gets right, McNemar
    agree = v["parity_openvino_vs_pytorch_fakequant"]["argmax_agreement"]
    assert rows["identical_predictions"] == pytest.approx(agree, abs=1e-6) and 0 < rows["mcnemar_exact_p"] <= 1
    assert rows["within_rounding"] == (rows["different_predictions"] <= 1)  # 8 rows: one change may happen


def test_bad_openvino_precision_names_the_choices():
    from holoserve import HoloServeError
    from holoserve.backends.openvino import compile_model
    from holoserve.export.options import ExportOptions
    from holoserve.server.config import ServerConfig

    with pytest.raises(HoloServeError, match="unknown OpenVINO precision 'fp64'.*f32"):
        compile_model("unused.onnx", precision="fp64")
    with pytest.raises(HoloServeError, match="unknown OpenVINO precision 'f64'"):
        ExportOptions(openvino_precision="f64").validate()
    with pytest.raises(HoloServeError, match="openvino precision 'fp16' is not one of auto, f32, bf16, f16"):
        ServerConfig(openvino_precision="fp16").validate()


def _rows(rng, vocab: int, batch: int, seq: int):
    """Random ids with rows of different lengths (the first row full), padded with mask 0."""
    ids = rng.integers(5, vocab, size=(batch, seq), dtype=np.int64)
    lengths = np.concatenate([[seq], rng.integers(2, seq + 1, size=batch - 1)])
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    return ids * mask, mask, np.zeros_like(ids)


def test_static_shapes_run_padded_batches_with_the_dynamic_models_logits(with_openvino):
    """--openvino-shapes: a batch that fits a listed shape in at most STATIC_PAD_SHARE more tokens than the
    dynamic model would run (its length padded to SEQ_MULTIPLE) runs on the model compiled for it (rows
    repeated, positions masked, extra logits dropped) and gives the dynamic model's logits; a batch that would
    need more padding runs on the dynamic model; the server passes the setting through and info() says what
    ran where, shape by shape."""
    import json

    from holoserve import HoloServeError
    from holoserve.backends.openvino import STATIC_PAD_SHARE
    from holoserve.server.config import ServerConfig
    from holoserve.server.service import open_backend

    assert STATIC_PAD_SHARE == 0.10  # the cases below sit on its edges
    ckpt, _ = with_openvino
    art = load_artifact(ckpt)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    dyn = load_backend("openvino", art, threads=1, openvino_precision="f32")
    st, decision = open_backend(ServerConfig(artifact_dir=str(ckpt), backend="openvino", threads=1,
                                             openvino_precision="f32", openvino_shapes="11x12, 3x16"), art)
    assert st.info()["static_shapes"] == ["3x16", "11x12"] and decision["picked"] == "openvino"
    rng = np.random.default_rng(0)
    # (batch, seq) -> where it runs, against the dynamic model's [batch, 16] (SEQ_MULTIPLE): 3x15 and 3x14 run
    # 3x16 (48 tokens either way), 10x12 runs 11x12 (132 <= 176), 3x16 fits exactly; 2x16 would add a row
    # (48 > 35.2 tokens), and 12x12 / 3x17 fit no shape
    cases = [((3, 15), "static"), ((10, 12), "static"), ((3, 16), "static"), ((3, 14), "static"),
             ((2, 16), "dynamic"), ((12, 12), "dynamic"), ((3, 17), "dynamic")]
    for (b, s), where in cases:
        before = dict(st.runs)
        batch = _rows(rng, vocab, b, s)
        want, got = dyn.infer(*batch), st.infer(*batch)
        assert got.shape == (b, art.num_labels) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * max(1.0, float(np.abs(want).max())))
        assert st.runs[where] == before[where] + 1, ((b, s), st.runs, before)
    info = st.info()
    assert info["runs"] == {"static": 4, "dynamic": 3}
    assert info["static_shape_runs"] == {"3x16": 3, "11x12": 1}
    assert info["dynamic_length_runs"] == {"16": 2, "32": 1}  # 2x16 and 12x12 at 16, 3x17 padded to 32
    too_long = f"1x{art.max_seq_length + 1}"  # no request can be that long: refused at start-up, not kept idle
    with pytest.raises(HoloServeError, match=f"static shape '{too_long}' is longer than the longest sequence"):
        open_backend(ServerConfig(artifact_dir=str(ckpt), backend="openvino", openvino_shapes=too_long), art)


def test_the_dynamic_model_runs_lengths_padded_to_a_few_that_recur(with_openvino):
    """OpenVINO prepares its kernels for each new input shape, so the dynamic model runs each batch padded up
    to a multiple of SEQ_MULTIPLE tokens (never past the checkpoint's length, never cutting a longer input):
    the logits are those of the exact length, and the shape that ran is the padded one."""
    import json

    from holoserve.backends.openvino import SEQ_MULTIPLE

    ckpt, _ = with_openvino
    art = load_artifact(ckpt)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    dyn = load_backend("openvino", art, threads=1, openvino_precision="f32")
    longest = art.max_seq_length
    assert dyn.info()["dynamic_seq_multiple"] == SEQ_MULTIPLE == 16
    assert [dyn.dynamic_seq(s) for s in (1, 16, 17)] == [16, 16, 32]
    assert dyn.dynamic_seq(longest - 1) == longest and dyn.dynamic_seq(longest + 3) == longest + 3
    exact = dyn.compiled.create_infer_request()
    rng = np.random.default_rng(1)
    for b, s in ((1, 5), (3, 17), (2, longest - 1)):
        batch = _rows(rng, vocab, b, s)
        want = exact.infer(dict(zip(("input_ids", "attention_mask", "token_type_ids"), batch)))
        want = np.asarray(want[dyn.output], dtype=np.float32)
        before = dict(dyn.dynamic_lengths)
        got = dyn.infer(*batch)
        ran = {n: c - before.get(n, 0) for n, c in dyn.dynamic_lengths.items() if c != before.get(n, 0)}
        assert ran == {dyn.dynamic_seq(s): 1}  # padded to the multiple
        assert got.shape == (b, art.num_labels)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * max(1.0, float(np.abs(want).max())))


def test_bad_openvino_shapes_say_what_to_write():
    from holoserve import HoloServeError
    from holoserve.backends.openvino import parse_shapes
    from holoserve.server.config import ServerConfig

    assert parse_shapes("32x128, 1x128,1X128") == [(1, 128), (32, 128)]
    assert parse_shapes("") == [] and parse_shapes([(2, 8)]) == [(2, 8)]
    for bad, why in (("1x", "write BATCHxSEQ"), ("128", "write BATCHxSEQ"), ("0x8", ">= 1"), ("axb", "BATCHxSEQ")):
        with pytest.raises(HoloServeError, match=why):
            parse_shapes(bad)
    with pytest.raises(HoloServeError, match="invalid server settings: bad OpenVINO static shape '4x'"):
        ServerConfig(openvino_shapes="1x8,4x").validate()
    with pytest.raises(HoloServeError, match="longer than the longest sequence served \\(max_seq_length 64\\)"):
        parse_shapes("1x128", max_seq_length=64)


def test_sparse_weight_decompression_is_off_by_default_and_on_when_asked(with_openvino):
    from holoserve.backends.openvino import cpu_has_amx
    from holoserve.server.config import ServerConfig
    from holoserve.server.service import open_backend

    ckpt, _ = with_openvino
    art = load_artifact(ckpt)
    assert load_backend("openvino", art, threads=1).info()["sparse_weights_decompression"].startswith("off")
    served, _ = open_backend(ServerConfig(artifact_dir=str(ckpt), backend="openvino", threads=1,
                                          openvino_sparse_weights=True), art)
    note = served.info()["sparse_weights_decompression"]
    assert note.startswith("on (CPU_SPARSE_WEIGHTS_DECOMPRESSION_RATE") if cpu_has_amx() else \
        note.startswith("off: this CPU has no AMX")


def test_holoserve_bench_can_time_openvino_on_static_shapes(with_openvino, tmp_path):
    import json

    from holoserve.cli import main

    ckpt, _ = with_openvino
    rc = main(["bench", str(ckpt), "--backend", "openvino", "--batch", "1,2", "--seq", "8", "--warmup", "1",
               "--iters", "2", "--openvino-static", "--out", str(tmp_path), "--name", "b"])
    assert rc == 0
    report = json.loads((tmp_path / "b.json").read_text())
    info = report["backends"]["openvino"]["info"]
    assert info["static_shapes"] == ["1x8", "2x8"] and report["method"]["openvino_static_shapes"] is True
    assert info["runs"] == {"static": 2 * (1 + 2), "dynamic": 0}  # every warm-up and timed call ran static


def test_key_transpose_split_is_exact(tmp_path):
    """Transpose(0,2,3,1) into a MatMul's second input, written as Transpose(0,2,1,3) + Transpose(0,1,3,2):
    bit-identical results through ONNX Runtime; a transpose feeding anything else is left alone."""
    import onnx
    from onnx import TensorProto, helper

    from holoserve.core.ort import session
    from holoserve.export.standard_rewrites import split_key_transposes

    g = helper.make_graph(
        [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1], name="kt"),
         helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
         helper.make_node("Transpose", ["k"], ["other"], perm=[0, 2, 3, 1], name="other")],
        "g", [helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, 3, 5, 4]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, 5, 3, 4])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 3, 5, 5]),
         helper.make_tensor_value_info("other", TensorProto.FLOAT, [2, 3, 4, 5])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    feed = {"q": rng.standard_normal((2, 3, 5, 4)).astype(np.float32),
            "k": rng.standard_normal((2, 5, 3, 4)).astype(np.float32)}
    onnx.save(m, str(tmp_path / "before.onnx"))
    before = session(tmp_path / "before.onnx", threads=1).run(None, feed)
    assert split_key_transposes(m) == 1
    onnx.checker.check_model(m)
    onnx.save(m, str(tmp_path / "after.onnx"))
    after = session(tmp_path / "after.onnx", threads=1).run(None, feed)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_eval_scores_the_openvino_export_and_compares_it_with_the_checkpoint(with_openvino, tmp_path):
    """`holoserve eval --backend openvino --compare`: the served OpenVINO model's dev metric, and how its
    predictions differ from the checkpoint's own numerics on the same rows."""
    import json

    from holoserve.compress.evaluate import EvalOptions, evaluate_checkpoint
    from tests.unit.export.test_export import _tiny_sst2_dir

    ckpt, _ = with_openvino
    data_dir = _tiny_sst2_dir(tmp_path)
    got = evaluate_checkpoint(ckpt, EvalOptions(data_dir=data_dir, backend="openvino", openvino_precision="f32",
        threads=1, batch_size=3, compare=True, predictions=tmp_path / "ov.jsonl"))
    ref = evaluate_checkpoint(ckpt, EvalOptions(data_dir=data_dir, batch_size=3,
        predictions=tmp_path / "torch.jsonl"))
    assert got["numerics"].startswith("OpenVINO (model.ov.onnx, float ops in f32") and got["rows"] == 8
    cmp = got["compare"]
    assert cmp["reference_metrics"] == ref["metrics"] and "checkpoint's numerics" in cmp["reference"]
    ov = [json.loads(x) for x in (tmp_path / "ov.jsonl").read_text().splitlines()]
    pt = [json.loads(x) for x in (tmp_path / "torch.jsonl").read_text().splitlines()]
    same = sum(a["prediction"] == b["prediction"] for a, b in zip(ov, pt))
    here = sum(a["prediction"] == a["label"] != b["prediction"] for a, b in zip(ov, pt))
    there = sum(b["prediction"] == b["label"] != a["prediction"] for a, b in zip(ov, pt))
    assert (cmp["identical_predictions"], cmp["different_predictions"]) == (pytest.approx(same / 8), 8 - same)
    assert (cmp["right_here_only"], cmp["right_in_reference_only"]) == (here, there)
    assert cmp["primary_difference"] == pytest.approx((here - there) / 8)
    assert 0 < cmp["mcnemar_exact_p"] <= 1


def test_the_int8_probe_finds_what_this_cpu_does():
    """OpenVINO's INT8 GEMM is exact where the CPU has VNNI (AVX-512 VNNI, AVX-VNNI or AMX) and saturates on
    x86-64 without it, as ONNX Runtime's does without session.x64quantprecision."""
    import platform

    from holoserve.backends import openvino as ov_backend
    from holoserve.core.machine import cpu_flags

    flags = cpu_flags()
    vnni = bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the saturating kernels are x86-64's; this is {platform.machine()}")
    assert ov_backend._measured_saturates() == (not vnni)


def test_auto_leaves_out_openvino_where_its_int8_gemms_saturate(with_openvino, monkeypatch):
    """Stated either way (HOLOSERVE_INT8_PROBE): saturating, `auto` serves ONNX Runtime and says why, while
    `--backend openvino` still loads, reporting it; exact, both are timed."""
    ckpt, _ = with_openvino
    monkeypatch.setenv("HOLOSERVE_INT8_PROBE", "saturates")
    backend, decision = select_backend(load_artifact(ckpt), threads=1)
    assert backend.name == "onnxruntime" and "saturate" in decision["skipped"]["openvino"]
    forced = OpenVinoBackend(load_artifact(ckpt), threads=1)
    assert forced.info()["int8_gemm"].startswith("saturates")
    monkeypatch.setenv("HOLOSERVE_INT8_PROBE", "exact")
    backend, decision = select_backend(load_artifact(ckpt), threads=1)
    assert "openvino" not in decision["skipped"]


@pytest.mark.parametrize("flags,cap,permitted,amx", [
    ({"amx_int8", "amx_tile"}, None, True, True),
    ({"amx_int8", "amx_tile"}, "ALL", True, True),
    ({"amx_int8", "amx_tile"}, "avx512_core_amx", True, True),
    ({"amx_int8", "amx_tile"}, "AVX512_CORE_BF16", True, False),
    ({"amx_int8", "amx_tile"}, "AVX512_CORE_VNNI", True, False),
    ({"amx_int8", "amx_tile"}, None, False, False),
    ({"avx512_vnni", "avx512vbmi"}, None, True, False),
    ({"avx512_vnni", "avx512vbmi"}, "AVX10_1_512_AMX", True, False),
])
def test_amx_is_the_cpus_unless_withheld(monkeypatch, flags, cap, permitted, amx):
    import holoserve.backends.openvino as ovb

    monkeypatch.setattr(ovb, "cpu_flags", lambda: flags)
    monkeypatch.setattr(ovb, "amx_permitted", lambda: permitted)
    if cap is None:
        monkeypatch.delenv(ovb.ISA_LIMIT_ENV, raising=False)
    else:
        monkeypatch.setenv(ovb.ISA_LIMIT_ENV, cap)
    assert ovb.cpu_has_amx() is amx
    withheld = ovb.amx_withheld()
    assert (withheld is None) is (amx or "amx_int8" not in flags), withheld
    if withheld and not permitted:
        assert "the OS refuses AMX" in withheld


def test_a_onednn_cap_below_amx_keeps_openvino_off_amx_and_the_kernels_on_auto(with_openvino, kernel_build):
    """ONEDNN_MAX_CPU_ISA below AMX (set as a user or a benchmark sets it, before the process starts: oneDNN
    reads it once) keeps OpenVINO's GEMMs off AMX tiles, and HoloServe then serves the CPU as one without AMX:
    `--openvino-kernels auto` runs the 2:4 kernels wherever the CPU has AVX-512 VNNI + VBMI. On a Xeon with AMX
    this is the stand-in for the kernels' CPU; elsewhere the cap changes nothing and the same holds."""
    import json
    import os
    import subprocess
    import sys

    from holoserve import kernels
    from holoserve.backends.openvino import ISA_LIMIT_ENV

    ckpt, _ = with_openvino
    cache, _ = kernel_build
    code = ("import json, sys; from holoserve.backends import load_backend; "
            "from holoserve.backends.openvino import cpu_has_amx; from holoserve.core.artifact import load_artifact; "
            "ov = load_backend('openvino', load_artifact(sys.argv[1]), threads=1); "
            "print(json.dumps({'amx': cpu_has_amx(), 'kernels': ov.info()['kernels']['status'], "
            "'gemms': ov.info()['gemm_kernels']}))")
    env = {**os.environ, ISA_LIMIT_ENV: "AVX512_CORE_BF16", kernels.CACHE_ENV: str(cache)}
    run = subprocess.run([sys.executable, "-c", code, str(ckpt)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["amx"] is False
    assert not [k for k in got["gemms"] if "amx" in k.lower()], got["gemms"]
    if kernels.cpu_missing():
        assert got["kernels"].startswith("off: this CPU lacks"), got
    else:
        assert got["kernels"].startswith("on (HoloServe's 2:4 INT8 kernels"), got


def test_openvino_runs_one_stream_per_instance(with_openvino):
    """--instances 2: OpenVINO compiles two streams, each batch takes a free infer request (static shapes too),
    and batches run from two threads at once give what they give one after another."""
    from holoserve.backends.routed import RoutedCpuBackend
    from tests.unit.server.test_instances import concurrent_matches_serial, rows

    art = load_artifact(with_openvino[0])
    be = load_backend("openvino", art, threads=2, instances=2, openvino_precision="f32", openvino_shapes="2x16")
    assert be.instances == 2 and be.compiled.get_property("NUM_STREAMS") == 2
    assert be.compiled.get_property("ENABLE_CPU_PINNING") is False
    concurrent_matches_serial(be)
    assert be.runs == {"static": 0, "dynamic": 16}
    ids, mask, types = rows(0, 2)
    be.infer(ids, mask, types)
    assert be.runs == {"static": 1, "dynamic": 16}  # 2 rows of 9 tokens: the 2x16 static shape
    one = load_backend("openvino", art, threads=2, openvino_precision="f32")
    assert one.instances == 1 and one.compiled.get_property("NUM_STREAMS") == 1
    ort = load_backend("onnxruntime", art, threads=2, instances=2)
    assert RoutedCpuBackend(ort, one, max_small_rows=1).instances == 1  # as many as both sides take
    assert RoutedCpuBackend(ort, be, max_small_rows=1).instances == 2
