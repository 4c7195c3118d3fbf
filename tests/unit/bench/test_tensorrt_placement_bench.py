"""bench/accuracy/tensorrt_placement.py: it finds every extra Q/DQ pair of the TensorRT placement by kind,
and a graph stripped of all of them computes the onnxruntime placement's numerics (its fidelity reference)."""
import numpy as np
import onnx

from tests.helpers.bench import bench_module
from tests.unit.export.test_export import exported  # noqa: F401  (the fixture: a tiny checkpoint, both placements)


def test_extra_pairs_by_kind_and_the_stripped_graph_is_the_onnxruntime_placement(exported, tmp_path):
    from holoserve.core.artifact import load_artifact
    from holoserve.export.reference import encode_batches, make_tokenizer
    from holoserve.export.checks import ort_logits, ort_session

    mod = bench_module("accuracy", "tensorrt_placement")
    ckpt, res = exported
    trt = onnx.load(str(ckpt / "model.trt.onnx"))
    pairs = mod.extra_pairs(trt)
    kinds = {}
    for kind, *_ in pairs.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    layers = 2  # make_calibrated_checkpoint's default
    residual = res.entries["tensorrt-onnx"]["residual_adds"]["int8"]
    assert kinds == {"qkv": 3 * layers, "softmax": layers, "residual": residual} and residual > 0
    assert len(pairs) == res.entries["tensorrt-onnx"]["activation_qdq_pairs"] - res.entries["onnxruntime"][
        "activation_qdq_pairs"]

    stripped, n = mod.without(trt, ("softmax", "qkv", "residual"))
    assert n == len(pairs) and not mod.extra_pairs(stripped)
    only_softmax, n = mod.without(trt, ("softmax",))
    assert n == layers and set(k for k, *_ in mod.extra_pairs(only_softmax).values()) == {"qkv", "residual"}
    onnx.save(stripped, str(tmp_path / "stripped.onnx"))
    art = load_artifact(ckpt)
    batches = [b for _, b in encode_batches(make_tokenizer(art), ["the movie was good", "a bad , dull film", "fun"],
                                            batch_size=2)]
    plain = ort_logits(ort_session(tmp_path / "stripped.onnx"), batches)
    ref = ort_logits(ort_session(ckpt / "model.onnx"), batches)
    full = ort_logits(ort_session(ckpt / "model.trt.onnx"), batches)
    assert np.abs(plain - ref).max() < 0.1 * np.abs(full - ref).max()  # the extra pairs are what differs
