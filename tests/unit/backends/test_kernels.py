"""HoloServe's 2:4 INT8 kernels for OpenVINO (holoserve.kernels): the packing, each operation against a
numpy reference, the rewrite of a real export, and the backend's --openvino-kernels. Each test that runs the
kernels runs both builds: the AVX-512 one (served) where this CPU has AVX-512 VNNI + VBMI, and the portable
reference build on any x86-64 CPU, so a CI machine of either kind runs the ops, the rewrite and the backend."""
import math
from typing import NamedTuple

import numpy as np
import pytest

pytest.importorskip("openvino")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from holoserve import kernels  # noqa: E402
from holoserve.kernels import KernelsUnavailable, pack_24, unpack_24  # noqa: E402
from holoserve.kernels.rewrite import rewrite  # noqa: E402
from holoserve.backends.openvino import cpu_has_bf16  # noqa: E402


class Built(NamedTuple):
    path: object  # the library
    mode: str  # the --openvino-kernels value that serves it


def skip_without_avx512():
    if kernels.cpu_missing():
        pytest.skip(f"the AVX-512 build of the 2:4 kernels needs AVX-512 VNNI and VBMI; this CPU lacks "
                    f"{', '.join(kernels.cpu_missing())} (the reference build's tests run here instead)")


@pytest.fixture(scope="module", params=[kernels.AVX512, kernels.REFERENCE])
def library(request):
    """Each build of the extension (built once per test run, tests/conftest.py), its cache in effect."""
    if request.param == kernels.AVX512:
        skip_without_avx512()
        (cache, path), mode = request.getfixturevalue("kernel_build"), "on"
    else:
        (cache, path), mode = request.getfixturevalue("kernel_reference_build"), kernels.REFERENCE
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.CACHE_ENV, str(cache))
        yield Built(path, mode)


def random_24(rng, K, N, sparse_groups=0.2):
    """int8 [K, N], at most two non-zeros per aligned group of four along K; some groups hold fewer."""
    g = rng.integers(-127, 128, (K // 4, 4, N)).astype(np.int8)
    keep = np.argsort(rng.random((K // 4, 4, N)), axis=1)[:, :2]
    mask = np.zeros(g.shape, bool)
    np.put_along_axis(mask, keep, True, axis=1)
    mask &= rng.random(g.shape) > sparse_groups  # some groups with one non-zero, a few with none
    return (g * mask).reshape(K, N).astype(np.int8)


def test_packing_round_trips_and_refuses_what_it_cannot_hold():
    rng = np.random.default_rng(0)
    w = random_24(rng, 128, 96)
    values, index, comp = pack_24(w)
    assert values.shape == index.shape == (3, 16, 32, 4) and values.dtype == np.int8 and index.dtype == np.uint8
    assert int(index.max()) < 64
    np.testing.assert_array_equal(unpack_24(values, index), w)
    np.testing.assert_array_equal(comp, 128 * w.astype(np.int64).sum(0))
    dense = w.copy()
    dense[0:4, 5] = [1, 2, 3, 0]
    with pytest.raises(ValueError, match="not 2:4"):
        pack_24(dense)
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_24(w[:96])


def quantize(x, scale):  # ONNX QuantizeLinear, uint8, zero point 128 (the kernels multiply by 1 / scale)
    return np.clip(np.rint(x * np.float32(1.0 / np.float32(scale))), -128, 127).astype(np.int64) + 128


def linear_ref(codes, w, scale, bias):
    acc = codes @ w.astype(np.int64) - 128 * w.astype(np.int64).sum(0)
    return acc.astype(np.float64) * scale + bias


def linear_inputs(rng, name, K, N, x_scale):
    w = random_24(rng, K, N)
    w_scale = rng.uniform(1e-3, 4e-3, N).astype(np.float32)
    bias = rng.normal(0, 0.1, N).astype(np.float32)
    values, index, comp = pack_24(w)
    arrays = {"values": values, "index": index, "comp": comp, "scale": np.float32(x_scale) * w_scale, "bias": bias}
    inits = [numpy_helper.from_array(a, f"{name}.{k}") for k, a in arrays.items()]
    return [f"{name}.{k}" for k in arrays], inits, (w, arrays["scale"].astype(np.float64), bias)


def compile_onnx(library, model):
    """An ONNX model with the kernels' nodes, compiled by OpenVINO's CPU plugin (float ops in f32)."""
    import tempfile
    from pathlib import Path

    import openvino as ov

    core = ov.Core()
    core.add_extension(str(library.path))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        onnx.save(model, str(path))
        return core.compile_model(core.read_model(str(path)), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 2})


def run_node(library, nodes, inits, x, outputs):
    """Outputs of a graph of `nodes` (one node or a list) from the float input "x"."""
    graph = helper.make_graph(nodes if isinstance(nodes, list) else [nodes], "kernel",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("holoserve", 1)])
    compiled = compile_onnx(library, model)
    out = compiled.create_infer_request().infer({"x": x})
    return [np.asarray(out[compiled.output(i)]) for i in range(len(outputs))]


def test_gemm_of_linears_sharing_an_input_matches_the_integer_reference(library):
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (3, 11, 128)).astype(np.float32)  # 33 rows: four blocks of 8 and a tail of 1
    s = 0.03
    names_a, inits_a, ref_a = linear_inputs(rng, "a", 128, 64, s)
    names_b, inits_b, ref_b = linear_inputs(rng, "b", 128, 96, s)
    node = helper.make_node("Sparse24Gemm", ["x", *names_a, *names_b], ["ya", "yb"], domain="holoserve", x_scale=s)
    ya, yb = run_node(library, node, inits_a + inits_b, x, ["ya", "yb"])
    codes = quantize(x.reshape(-1, 128), s)
    assert ya.shape == (3, 11, 64) and yb.shape == (3, 11, 96)
    np.testing.assert_allclose(ya.reshape(-1, 64), linear_ref(codes, *ref_a), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(yb.reshape(-1, 96), linear_ref(codes, *ref_b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_ffn_matches_linear_activation_quantize_linear(library, activation):
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, (2, 9, 64)).astype(np.float32)
    s, h = 0.03, 0.02
    names_up, inits_up, ref_up = linear_inputs(rng, "up", 64, 128, s)
    names_down, inits_down, ref_down = linear_inputs(rng, "down", 128, 64, h)
    node = helper.make_node("Sparse24Ffn", ["x", *names_up, *names_down], ["y"], domain="holoserve",
                            x_scale=s, h_scale=h, activation=activation)
    (y,) = run_node(library, node, inits_up + inits_down, x, ["y"])

    def reference(inputs):
        pre = linear_ref(quantize(inputs.reshape(-1, 64), s), *ref_up)
        act = (0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2))) if activation == "gelu"
               else np.maximum(pre, 0))
        return linear_ref(quantize(act.astype(np.float32), h), *ref_down)

    assert y.shape == (2, 9, 64)
    # a hidden code may land on the other side of a rounding tie (erf is evaluated to about 1.2e-7)
    diff = np.abs(y.reshape(-1, 64) - reference(x))
    assert np.mean(diff > 1e-4) < 0.01 and diff.max() < 0.05, (diff.max(), np.mean(diff > 1e-4))
    # bf16 in and out (as OpenVINO runs the graph around the kernels in bf16): the same on bf16 inputs, to
    # within bf16's rounding of the output (2^-8 relative). Where OpenVINO has no bf16 (a CPU without bf16
    # units), it runs the casts in f32 and the kernels get the f32 input.
    node_bf16 = helper.make_node("Sparse24Ffn", ["xb", *names_up, *names_down], ["yb"], domain="holoserve",
                                 x_scale=s, h_scale=h, activation=activation)
    cast_in = helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16)
    cast_out = helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT)
    (yb,) = run_node(library, [cast_in, node_bf16, cast_out], inits_up + inits_down, x, ["y"])
    yb = yb.reshape(-1, 64)
    ref_b = reference(bf16(x)) if cpu_has_bf16() else reference(x)
    close = np.abs(yb - ref_b) <= (2.0 ** -8 if cpu_has_bf16() else 1e-5) * np.abs(ref_b) + 1e-4
    assert np.mean(~close) < 0.01, np.mean(~close)


def attention_model(B, Sq, S, H, D, mask_rows, scale_op="Mul", k_transposes=2):
    """The exporter's attention block on graph inputs q [B, Sq, H * D], k and v [B, S, H * D] and an additive
    mask [B, 1, mask_rows, S]: per-head views (Reshape to D, Transposes), MatMul(q, k^T), scaled by a constant,
    mask added, Softmax, MatMul with v, heads merged back."""
    shape = numpy_helper.from_array(np.array([0, 0, -1, D], np.int64), "heads_shape")
    merged = numpy_helper.from_array(np.array([0, 0, H * D], np.int64), "merged_shape")
    factor = numpy_helper.from_array(np.array(D ** -0.5 if scale_op == "Mul" else D ** 0.5, np.float32), "factor")
    nodes = []
    for t in "qkv":
        nodes.append(helper.make_node("Reshape", [t, "heads_shape"], [f"{t}4"]))
    nodes.append(helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]))
    nodes.append(helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]))
    if k_transposes == 2:
        nodes += [helper.make_node("Transpose", ["k4"], ["kh"], perm=[0, 2, 1, 3]),
                  helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2])]
    else:
        nodes.append(helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]))
    nodes += [helper.make_node("MatMul", ["qh", "kt"], ["qk"]),
              helper.make_node(scale_op, ["qk", "factor"], ["scaled"]),
              helper.make_node("Add", ["scaled", "mask"], ["scores"]),
              helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "vh"], ["ctx"]),
              helper.make_node("Transpose", ["ctx"], ["ctx2"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx2", "merged_shape"], ["y"])]
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, Sq, H * D]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, S, H * D]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, [B, S, H * D]),
              helper.make_tensor_value_info("mask", TensorProto.FLOAT, [B, 1, mask_rows, S])]
    graph = helper.make_graph(nodes, "attention", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [shape, merged, factor])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def attention_inputs(rng, B, Sq, S, H, D, mask_rows):
    """Random q, k, v and a mask like the exporter's: 0 where a key is attended, float32's lowest where padded."""
    q, k, v = (rng.normal(0, 2, (B, n, H * D)).astype(np.float32) for n in (Sq, S, S))
    mask = np.zeros((B, 1, mask_rows, S), np.float32)
    for b in range(B):
        mask[b, :, :, rng.integers(1, S + 1):] = np.finfo(np.float32).min
    return {"q": q, "k": k, "v": v, "mask": mask}


def attention_ref(f, D):
    B, Sq, HD = f["q"].shape
    H = HD // D
    heads = [f[t].astype(np.float64).reshape(B, -1, H, D).transpose(0, 2, 1, 3) for t in "qkv"]
    s = heads[0] @ heads[1].transpose(0, 1, 3, 2) / math.sqrt(D) + f["mask"].astype(np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ heads[2]).transpose(0, 2, 1, 3).reshape(B, Sq, H * D)


# (B, Sq, S, H, D, mask rows, scale op, k's transposes): a key tail (21, 37), the [CLS]-row query (Sq 1),
# head sizes 16 to 64, a mask per query row, the scale as Div, k^T in one Transpose
ATTENTION_CASES = [(2, 21, 21, 3, 32, 1, "Mul", 2), (3, 1, 37, 2, 64, 1, "Mul", 2),
                   (1, 16, 16, 4, 16, 16, "Div", 1), (2, 5, 5, 2, 48, 5, "Mul", 1)]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[6]}")
def test_attention_matches_softmax_attention(library, case):
    B, Sq, S, H, D, rows, op, kt = case
    model, counts = rewrite(attention_model(B, Sq, S, H, D, rows, op, kt))
    assert counts.get("Attention") == 1 and [n.op_type for n in model.graph.node] == ["Attention"], counts
    feed = attention_inputs(np.random.default_rng(D + S), B, Sq, S, H, D, rows)
    out = compile_onnx(library, model).create_infer_request().infer(feed)
    y = np.asarray(next(iter(out.values())))
    assert y.shape == (B, Sq, H * D)
    np.testing.assert_allclose(y, attention_ref(feed, D), rtol=1e-5, atol=2e-6)


def test_rewrite_leaves_attention_it_cannot_take():
    """A head size the kernel does not take (not a multiple of 16), and a score read elsewhere, stay as they are."""
    _, counts = rewrite(attention_model(1, 8, 8, 2, 24, 1))
    assert not counts.get("Attention")
    model = attention_model(1, 8, 8, 2, 32, 1)
    model.graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, None))
    out, counts = rewrite(model)
    assert not counts.get("Attention") and "Softmax" in [n.op_type for n in out.graph.node]


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (to nearest, ties to even), as float32."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny GELU and ReLU checkpoints whose widths the kernels take (64 and 128), with openvino exports."""
    from holoserve.export.onnx_export import export_checkpoint
    from tests.helpers.tiny import calibrated_tiny_checkpoint

    out = {}
    for act in ("gelu", "relu"):
        root = tmp_path_factory.mktemp(f"kernels-{act}")
        *_, art = calibrated_tiny_checkpoint(root, hidden=64, intermediate=128, max_seq_length=32, hidden_act=act)
        export_checkpoint(art.path, ["onnxruntime", "openvino"], progress=False, polygraphy=False)
        out[act] = art.path
    return out


def test_rewrite_puts_every_2_4_linear_on_the_kernels(checkpoints):
    for act, ckpt in checkpoints.items():
        model, counts = rewrite(onnx.load(str(ckpt / "model.ov.onnx")))
        ops = [n.op_type for n in model.graph.node]
        assert counts["Sparse24Ffn"] == ops.count("Sparse24Ffn") == 2, (act, counts)
        # per layer Q, K, V as one node and the attention output; the last layer's [CLS]-row query, which reads
        # its row sliced from the dequantized input, as a node of its own on that row of the float input
        assert counts["linears"] == 12 and counts["linears_kept"] == 0, counts
        assert counts["Sparse24Gemm"] == ops.count("Sparse24Gemm") == 5, counts
        producer = {o: n for n in model.graph.node for o in n.output}
        sliced = [n for n in model.graph.node
                  if n.op_type == "Sparse24Gemm" and producer[n.input[0]].op_type == "Slice"]
        assert len(sliced) == 1 and len(sliced[0].output) == 1, [n.name for n in sliced]
        assert producer[producer[sliced[0].input[0]].input[0]].op_type == "LayerNormalization"
        ffn = next(n for n in model.graph.node if n.op_type == "Sparse24Ffn")
        assert helper.get_attribute_value(next(a for a in ffn.attribute if a.name == "activation")).decode() == act
        # the GELU went into the FFN nodes, every quantizer into a kernel
        assert "Erf" not in ops and "QuantizeLinear" not in ops and "DequantizeLinear" not in ops
        wrapped, _ = rewrite(onnx.load(str(ckpt / "model.ov.onnx")), bf16=True)
        producer = {o: n for n in wrapped.graph.node for o in n.output}
        for node in (n for n in wrapped.graph.node if n.domain == "holoserve"):
            # bf16 in: a Cast from float32, or straight from the kernel before it (Q, K, V into attention,
            # attention into the output Linear), never through a float32 round trip
            for name in node.input[:3 if node.op_type == "Attention" else 1]:
                src = producer[name]
                assert (src.op_type == "Cast" and producer[src.input[0]].domain != "holoserve") or \
                    src.domain == "holoserve", (node.name, name)
        # Q, K and V of every layer, the last one's [CLS]-row query included, straight from a Q/K/V kernel
        attention = [n for n in wrapped.graph.node if n.op_type == "Attention"]
        assert all(producer[i].op_type == "Sparse24Gemm" for n in attention for i in n.input[:3])
        # each layer's attention, the last one's [CLS]-row query included
        assert counts["Attention"] == ops.count("Attention") == 2 and "Softmax" not in ops, counts


def test_bf16_kernel_to_kernel_skips_the_float32_round_trip_exactly(checkpoints, library, monkeypatch):
    """Reading a kernel's bf16 output directly instead of through Cast to float32 and back changes no bit."""
    import holoserve.kernels.rewrite as rw

    model = onnx.load(str(checkpoints["gelu"] / "model.ov.onnx"))
    direct, _ = rewrite(model, bf16=True)
    monkeypatch.setattr(rw, "_skip_round_trips", lambda nodes: nodes)
    round_trip, _ = rewrite(model, bf16=True)
    casts = [sum(n.op_type == "Cast" for n in m.graph.node) for m in (direct, round_trip)]
    assert casts[0] < casts[1], casts
    rng = np.random.default_rng(3)
    feed = {i.name: np.ones((3, 32), np.int64) if "mask" in i.name else
            rng.integers(5, 100, (3, 32)) if "input_ids" in i.name else np.zeros((3, 32), np.int64)
            for i in model.graph.input}
    outs = [compile_onnx(library, m).create_infer_request().infer(feed) for m in (direct, round_trip)]
    np.testing.assert_array_equal(*(np.asarray(o[0]) for o in outs))


def test_rewrite_leaves_a_linear_that_is_not_2_4_alone(checkpoints):
    model = onnx.load(str(checkpoints["gelu"] / "model.ov.onnx"))
    init = next(i for i in model.graph.initializer if i.name.endswith("intermediate.dense.weight_int8"))
    w = numpy_helper.to_array(init).copy()
    w[:4, 0] = [3, 5, 7, 9]  # one dense group
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    _, counts = rewrite(model)
    assert counts["Sparse24Ffn"] == 1 and counts["linears_kept"] >= 1


def test_rewrite_keeps_values_read_elsewhere(checkpoints, library):
    """An FFN whose hidden pre-activation is also a graph output is not fused; the graph stays whole."""
    model = onnx.load(str(checkpoints["gelu"] / "model.ov.onnx"))
    hidden = next(n.output[0] for n in model.graph.node
                  if n.op_type == "Add" and "layer.0/intermediate/dense" in n.name)
    model.graph.output.append(helper.make_tensor_value_info(hidden, TensorProto.FLOAT, ["batch", "seq", 128]))
    out, counts = rewrite(model)
    assert counts["Sparse24Ffn"] == 1, counts  # layer 1's FFN only
    onnx.checker.check_model(out)
    assert hidden in {o for n in out.graph.node for o in n.output}
    assert len(compile_onnx(library, out).outputs) == 2


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_backend_with_kernels_agrees_with_onnxruntime(checkpoints, library, precision):
    from holoserve.backends import load_backend
    from holoserve.core.artifact import load_artifact
    from holoserve.core.tokenizer import TextEncoder, pad_batch

    for act, ckpt in checkpoints.items():
        art = load_artifact(ckpt)
        ours = load_backend("openvino", art, threads=1, openvino_kernels=library.mode, openvino_precision=precision)
        plain = load_backend("openvino", art, threads=1, openvino_kernels="off", openvino_precision=precision)
        ort = load_backend("onnxruntime", art, threads=1)
        info = ours.info()["kernels"]
        runs = precision if cpu_has_bf16() else "f32"  # OpenVINO runs bf16 only where the CPU has bf16 units
        assert info["status"].startswith(library.mode) and f"{runs} in and out" in info["status"], info
        assert plain.info()["kernels"]["status"].startswith("off")
        enc = TextEncoder(ckpt / "tokenizer.json", art.max_seq_length)
        texts = ["a good film", "the plot is thin and the acting is worse", "fun", "not bad at all, really"] * 3
        batch = pad_batch(enc.encode(texts), enc.pad_id)
        a, p, r = ours.infer(*batch), plain.infer(*batch), ort.infer(*batch)
        assert a.shape == r.shape == (12, art.num_labels) and a.dtype == np.float32
        scale = max(1.0, float(np.abs(r).max()))
        # the kernels compute the Linears as ONNX Runtime does (integer GEMMs, exact): in f32 they are
        # at least as close to it as OpenVINO's own GEMMs
        assert np.abs(a - r).max() < 0.25 * scale, (act, precision)
        if precision == "f32":
            assert np.abs(a - r).max() <= np.abs(p - r).max() + 0.02 * scale, (act, np.abs(a - r).max(),
                                                                               np.abs(p - r).max())


def test_kernels_off_auto_and_on_without_a_compiler(checkpoints, monkeypatch, tmp_path):
    from holoserve.backends.openvino import compile_model, cpu_has_amx

    monkeypatch.setenv("HOLOSERVE_KERNEL_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("CXX", "no-such-compiler-holoserve")
    path = checkpoints["gelu"] / "model.ov.onnx"
    with pytest.raises(KernelsUnavailable, match="no reference build .*no C\\+\\+ compiler .*install g\\+\\+.*"
                                                 "holoserve.kernels build reference"):
        compile_model(path, threads=1, kernels=kernels.REFERENCE)
    if not kernels.cpu_missing():
        with pytest.raises(KernelsUnavailable, match="no build .*no C\\+\\+ compiler .*install g\\+\\+"):
            compile_model(path, threads=1, kernels="on")
    report = {}
    compile_model(path, threads=1, kernels="auto", report=report)
    # auto leaves CPUs with AMX to OpenVINO's own GEMMs before it looks for a build
    expected = "off: this CPU has AMX" if cpu_has_amx() else "off: this CPU lacks" if kernels.cpu_missing() \
        else "off: no build of the 2:4 kernels"
    assert report["status"].startswith(expected), report
    with pytest.raises(Exception, match="--openvino-kernels"):
        compile_model(path, threads=1, kernels="sometimes")


def test_shapes_serving_meets_many_rows_and_a_3072_wide_input(library):
    """Row counts past the row chunks (256) and the FFN's row blocks (512), neither a multiple of them nor of
    the register block (8), and a 3072-wide input (BERT-base's FFN): each Linear equals the integer reference."""
    rng = np.random.default_rng(3)
    s, h = 0.03, 0.02
    x = rng.normal(0, 1, (1, 1037, 64)).astype(np.float32)  # 1037 rows: 2 FFN blocks + a part, 4 chunks + a part
    names_up, inits_up, ref_up = linear_inputs(rng, "up", 64, 3072, s)
    names_down, inits_down, ref_down = linear_inputs(rng, "down", 3072, 64, h)
    node = helper.make_node("Sparse24Ffn", ["x", *names_up, *names_down], ["y"], domain="holoserve",
                            x_scale=s, h_scale=h, activation="relu")
    (y,) = run_node(library, node, inits_up + inits_down, x, ["y"])
    pre = linear_ref(quantize(x.reshape(-1, 64), s), *ref_up)
    ref = linear_ref(quantize(np.maximum(pre, 0).astype(np.float32), h), *ref_down)
    np.testing.assert_allclose(y.reshape(-1, 64), ref, rtol=1e-5, atol=1e-4)

    xk = rng.normal(0, 1, (3, 197, 3072)).astype(np.float32)  # 591 rows through a K = 3072 Linear
    names, inits, ref_k = linear_inputs(rng, "k", 3072, 96, s)
    gemm = helper.make_node("Sparse24Gemm", ["x", *names], ["y"], domain="holoserve", x_scale=s)
    (yk,) = run_node(library, gemm, inits, xk, ["y"])
    np.testing.assert_allclose(yk.reshape(-1, 96), linear_ref(quantize(xk.reshape(-1, 3072), s), *ref_k),
                               rtol=1e-5, atol=1e-4)


def test_several_threads_calling_one_compiled_model_at_once(library):
    """A server runs several infer requests of one compiled model at a time (batcher threads, static shapes):
    the nodes keep no per-call state between requests, so concurrent calls each get their own exact answer."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(4)
    s, h = 0.03, 0.02
    names_up, inits_up, ref_up = linear_inputs(rng, "up", 64, 256, s)
    names_down, inits_down, ref_down = linear_inputs(rng, "down", 256, 64, h)
    node = helper.make_node("Sparse24Ffn", ["x", *names_up, *names_down], ["y"], domain="holoserve",
                            x_scale=s, h_scale=h, activation="relu")
    graph = helper.make_graph([node], "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits_up + inits_down)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("holoserve", 1)])
    compiled = compile_onnx(library, model)
    inputs = [rng.normal(0, 1 + i, (40 + 97 * i, 64)).astype(np.float32) for i in range(8)]

    def reference(x):
        pre = linear_ref(quantize(x, s), *ref_up)
        return linear_ref(quantize(np.maximum(pre, 0).astype(np.float32), h), *ref_down)

    def call(i):
        request = compiled.create_infer_request()
        outs = []
        for _ in range(5):
            outs.append(np.asarray(request.infer({"x": inputs[i]})[compiled.output(0)]).copy())
        return outs

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(call, range(8)))
    for x, outs in zip(inputs, results):
        ref = reference(x)
        for y in outs:
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)


def test_the_avx512_build_equals_the_reference_bit_for_bit(kernel_build, kernel_reference_build):
    """The served build against the portable one on the same graphs (Q/K/V-style Gemm, GELU FFN, f32 and bf16,
    row counts off every block size): the same outputs, bit for bit, so the reference's checks hold for it."""
    skip_without_avx512()
    rng = np.random.default_rng(5)
    s, h = 0.03, 0.02
    names_a, inits_a, _ = linear_inputs(rng, "a", 192, 64, s)
    names_b, inits_b, _ = linear_inputs(rng, "b", 192, 96, s)
    names_up, inits_up, _ = linear_inputs(rng, "up", 192, 512, s)
    names_down, inits_down, _ = linear_inputs(rng, "down", 512, 192, h)
    x = rng.normal(0, 2, (3, 181, 192)).astype(np.float32)
    cast_in = helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16)
    graphs = {}
    for name, xin, casts in (("f32", "x", []), ("bf16", "xb", [cast_in])):
        nodes = [*casts,
                 helper.make_node("Sparse24Gemm", [xin, *names_a, *names_b], ["ga", "gb"], domain="holoserve",
                                  x_scale=s),
                 helper.make_node("Sparse24Ffn", [xin, *names_up, *names_down], ["f"], domain="holoserve",
                                  x_scale=s, h_scale=h, activation="gelu")]
        outs = ["ga", "gb", "f"]
        if casts:
            nodes += [helper.make_node("Cast", [o], [o + "32"], to=TensorProto.FLOAT) for o in outs]
            outs = [o + "32" for o in outs]
        graphs[name] = (nodes, outs)
    for name, (nodes, outs) in graphs.items():
        inits = inits_a + inits_b + inits_up + inits_down
        served = run_node(Built(kernel_build[1], "on"), nodes, inits, x, outs)
        reference = run_node(Built(kernel_reference_build[1], kernels.REFERENCE), nodes, inits, x, outs)
        for o, a, b in zip(outs, served, reference):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} {o}")


def test_the_avx512_attention_equals_the_reference_bit_for_bit(kernel_build, kernel_reference_build):
    """Attention in both builds, f32 and bf16 in and out, every case above: the same outputs, bit for bit."""
    skip_without_avx512()
    for case in ATTENTION_CASES:
        B, Sq, S, H, D, rows, op, kt = case
        feed = attention_inputs(np.random.default_rng(S), B, Sq, S, H, D, rows)
        for bf16_io in (False, True):
            model, _ = rewrite(attention_model(B, Sq, S, H, D, rows, op, kt), bf16=bf16_io)
            served, reference = (
                np.asarray(next(iter(compile_onnx(built, model).create_infer_request().infer(feed).values())))
                for built in (Built(kernel_build[1], "on"), Built(kernel_reference_build[1], kernels.REFERENCE)))
            np.testing.assert_array_equal(served, reference, err_msg=f"{case} bf16={bf16_io}")


def test_eval_scores_the_graph_the_kernels_serve(checkpoints, library, tmp_path):
    """`holoserve eval --backend openvino --openvino-kernels on|reference --compare`: dev rows scored through
    the kernels' graph, which predicts every row as the checkpoint's own numerics do."""
    from holoserve.compress.evaluate import EvalOptions, evaluate_checkpoint
    from tests.unit.export.test_export import _tiny_sst2_dir

    got = evaluate_checkpoint(checkpoints["gelu"], EvalOptions(
        data_dir=_tiny_sst2_dir(tmp_path), backend="openvino", openvino_precision="f32",
        openvino_kernels=library.mode, threads=1, batch_size=3, compare=True))
    assert f"2:4 kernels {library.mode} (HoloServe's 2:4 INT8 kernels" in got["numerics"], got["numerics"]
    assert got["compare"]["identical_predictions"] == 1.0 and got["metrics"] == got["compare"]["reference_metrics"]
