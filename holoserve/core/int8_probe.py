"""A one-MatMul ONNX model that tells whether a runtime's INT8 GEMM is exact on this CPU.

On x86-64 CPUs without VNNI, INT8 GEMM kernels built on VPMADDUBSW add each pair of u8 x s8 products in 16
bits, which saturates for full-range int8 weights (ONNX Runtime's quantization guide, "When and why do I need
to try U8U8?"; OpenVINO's CPU plugin does the same). The probe's every product is 127 x 127 (uint8 code 255
at zero point 128): a saturating kernel loses nearly all of the sum, an exact one returns K x 127 x 127.
"""
from __future__ import annotations

import os

import numpy as np

# HOLOSERVE_INT8_PROBE=exact or saturates states the probe's answer for every runtime instead of measuring it
# (tests of either kind of CPU, a fleet whose CPUs are known)
ENV = "HOLOSERVE_INT8_PROBE"

K = 64
FEED = {"x": np.full((4, K), 127.0, np.float32)}
EXACT = K * 127 * 127


def probe_onnx() -> bytes:
    """The probe model, serialized (opset 17)."""
    from onnx import TensorProto, helper, numpy_helper

    init = [numpy_helper.from_array(np.full((K, 8), 127, np.int8), "w"),
            numpy_helper.from_array(np.array(1.0, np.float32), "s"),
            numpy_helper.from_array(np.array(0, np.int8), "w_zp"),
            numpy_helper.from_array(np.array(128, np.uint8), "x_zp")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "x_zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "x_zp"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "s", "w_zp"], ["wd"]),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "int8_gemm_probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def exact(y: np.ndarray) -> bool:
    """Whether the probe's output is what an exact GEMM gives."""
    return bool(np.all(np.asarray(y) == EXACT))


def stated() -> bool | None:
    """The answer HOLOSERVE_INT8_PROBE states (True: the GEMMs saturate), or None where it states none."""
    value = os.environ.get(ENV, "").strip().lower()
    return value == "saturates" if value in ("exact", "saturates") else None
