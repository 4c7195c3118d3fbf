"""The tensorrt target in float16 (--tensorrt-precision fp16): a QDQ graph rewritten to compute in
float16 outside its Q/DQ pairs, with LayerNormalization and Softmax kept in float32."""
from __future__ import annotations

from typing import Iterable

import numpy as np

FP16_OPSET = 19  # QuantizeLinear with a float16 input and DequantizeLinear with a float16 scale need opset 19
KEEP_FP32_OPS = ("LayerNormalization", "Softmax")  # normalisation statistics and softmax sums stay float32
_FP16_MAX = float(np.finfo(np.float16).max)


def _to_fp16(a) -> np.ndarray:
    a = np.asarray(a, np.float32)
    return np.clip(a, -_FP16_MAX, _FP16_MAX).astype(np.float16)


def to_float16(model, keep_fp32: Iterable[str] = KEEP_FP32_OPS) -> dict:
    """Make a (TensorRT-placement) QDQ graph compute in float16 outside its Q/DQ pairs, in place.

    A strongly typed TensorRT network (TensorRT-RTX, TensorRT >= 11) runs every layer in its ONNX
    types, so float16 has to be in the graph. Every float32 initializer, Constant, ConstantOfShape
    value and Cast-to-float becomes float16 (values clipped to +-65504: the attention mask's
    float32-min becomes -65504), so the Q/DQ scales are float16 too: QuantizeLinear reads float16 and
    DequantizeLinear writes float16, and every Q/DQ pair stays intact for TensorRT's INT8 fusion.
    The ops in `keep_fp32` run in float32 between two Casts, on float32 copies of their parameters.
    The graph outputs stay float32 (one Cast at the end), the inputs are unchanged (int64), and the
    opset becomes 19. Returns counts for the manifest.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
    keep_fp32 = tuple(keep_fp32)
    g = model.graph
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in
             list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)}
    types.update({i.name: i.data_type for i in g.initializer})
    kept = [n for n in g.node if n.op_type in keep_fp32]
    # parameters of kept ops (LayerNorm scale/bias) stay float32: each reads a float32 copy of its
    # initializer (the exporter may share one through Identity nodes with other readers)
    inits = {i.name: i for i in g.initializer}
    prod = {o: n for n in g.node for o in n.output}
    fp32_params = {}
    for n in kept:
        for k in range(1, len(n.input)):
            src = n.input[k]
            while src not in inits and src in prod and prod[src].op_type == "Identity":
                src = prod[src].input[0]
            if src not in inits or inits[src].data_type != FLOAT:
                continue
            name = f"{src}.fp32"
            if name not in fp32_params:
                fp32_params[name] = numpy_helper.from_array(numpy_helper.to_array(inits[src]), name)
            n.input[k] = name
    _drop_unused(g)
    converted = 0
    for i, init in enumerate(g.initializer):
        if init.data_type == FLOAT:
            g.initializer[i].CopyFrom(numpy_helper.from_array(_to_fp16(numpy_helper.to_array(init)), init.name))
            converted += 1
    g.initializer.extend(fp32_params.values())
    casts = 0
    for n in g.node:
        for a in n.attribute:
            if n.op_type in ("Constant", "ConstantOfShape") and a.name == "value" and a.t.data_type == FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(_to_fp16(numpy_helper.to_array(a.t)), a.t.name))
            elif n.op_type == "Cast" and a.name == "to" and a.i == FLOAT:
                a.i = HALF
        if n.op_type == "ConstantOfShape" and not n.attribute and types.get(n.output[0]) == FLOAT:
            n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.zeros(1, np.float16))))
        if n.op_type == "Constant" and any(a.name in ("value_float", "value_floats") for a in n.attribute):
            raise ValueError(f"{n.name}: float Constant attribute form is not handled")
    for n in kept:
        idx = list(g.node).index(n)
        x = n.input[0]
        c_in = helper.make_node("Cast", [x], [f"{n.name}.input_fp32"], name=f"{n.name}/CastToFloat", to=FLOAT)
        n.input[0] = c_in.output[0]
        y = n.output[0]
        n.output[0] = f"{n.name}.output_fp32"
        c_out = helper.make_node("Cast", [n.output[0]], [y], name=f"{n.name}/CastToHalf", to=HALF)
        g.node.insert(idx, c_in)
        g.node.insert(idx + 2, c_out)
        casts += 2
    # float32 graph outputs stay float32 (the I/O contract)
    for o in g.output:
        if o.type.tensor_type.elem_type == FLOAT:
            last = next(n for n in g.node if o.name in n.output)
            half = f"{o.name}.fp16"
            last.output[list(last.output).index(o.name)] = half
            for n in g.node:
                for k, x in enumerate(n.input):
                    if x == o.name:
                        n.input[k] = half
            g.node.append(helper.make_node("Cast", [half], [o.name], name=f"{o.name}/CastToFloat", to=FLOAT))
            casts += 1
    del g.value_info[:]
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx") and op.version < FP16_OPSET:
            op.version = FP16_OPSET
    return {"initializers_fp16": converted, "initializers_fp32": len(fp32_params), "casts": casts,
            "fp32_ops": {t: sum(n.op_type == t for n in kept) for t in keep_fp32}}


def _drop_unused(g) -> None:
    """Remove nodes whose outputs nothing reads (Identity leftovers) and initializers nothing reads."""
    while True:
        used = {x for n in g.node for x in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if n.op_type == "Identity" and not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    used = {x for n in g.node for x in n.input}
    for i in [i for i in g.initializer if i.name not in used]:
        g.initializer.remove(i)
