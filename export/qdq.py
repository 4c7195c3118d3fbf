"""Rewrite an fp32 ONNX export of a BERT classifier into a QDQ graph (onnx + numpy only).

Two placements, because the runtimes fuse different patterns:

* ``onnxruntime`` — Q/DQ only in front of the encoder Linears' MatMuls, activations as uint8 with
  zero-point 128 (a symmetric int8 range maps exactly onto it: q_u8 = q_i8 + 128), weights as
  int8 initializers + per-output-channel DequantizeLinear. ONNX Runtime's CPU QDQ transformer
  turns every such MatMul into MatMulIntegerToFloat/QLinearMatMul. These are exactly the
  checkpoint's fake-quant numerics (compress/quant.py), so ORT reproduces `holoserve eval`.
* ``tensorrt`` — the QDQBERT placement: int8 Q/DQ (zero-point 0) on every Linear input and
  weight, on both inputs of the two attention MatMuls and on both inputs of the residual Adds,
  so that every GEMM is INT8-in/INT8-out, which TensorRT needs before it picks sparse INT8
  tactics; residual inputs that one per-tensor INT8 scale cannot hold stay in float (RESIDUAL_MODES).
  The extra tensors' ranges are calibrated separately (see export/onnx_export.py).
  export/float16.py then makes such a graph compute in float16 outside the Q/DQ pairs (float16 scales,
  LayerNormalization and Softmax kept in float32), for strongly typed TensorRT networks.

Encoder Linear weights are found by value: the exporter stores W^T as the MatMul's B
initializer, so matching the checkpoint's weights needs no knowledge of the exporter's names.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from holoserve.core.artifact import act_key, output_key, residual_key, softmax_key
from holoserve.core.numerics import RESIDUAL_MIN_SQNR_DB, int8_error  # noqa: F401 (re-exported for the export)
from holoserve.core.numerics import UINT8_ZERO_POINT, WEIGHT_QMAX, activation_scale, grid_codes, round_codes

PLACEMENTS = ("onnxruntime", "tensorrt")

# The TensorRT placement's residual-Add inputs: "int8" quantizes all of them, "float" none, "auto" (the
# default) each one whose per-tensor INT8 Q/DQ keeps at least RESIDUAL_MIN_SQNR_DB (holoserve.core.numerics)
# of signal-to-noise on the calibration rows, or, for a checkpoint made with TensorRT QAT, those QAT trained.
# An input with outlier channels (a wide range against a small RMS) loses most of its values to zero on one
# per-tensor scale. Why "auto": docs/results/2026-11-24-tensorrt-placement.md
RESIDUAL_MODES = ("auto", "int8", "float")


@dataclass
class LinearSite:
    """Where one encoder Linear lives in the graph."""

    layer: str  # module name, e.g. bert.encoder.layer.0.attention.self.query
    node: str  # MatMul (or Gemm) node name
    weight: str  # initializer name of its weight (after renaming: "<layer>.weight_t")
    activation: str  # tensor name of the MatMul's activation input
    transposed: bool  # True: B is W^T [in, out] (MatMul); False: Gemm with transB=1, B is W [out, in]
    bias_add: str | None = None  # node name of the Add that adds the bias, if any


@dataclass
class QdqReport:
    placement: str
    linears: list[str] = field(default_factory=list)
    activation_qdq: int = 0
    weight_dq: int = 0
    extra_tensors: list[str] = field(default_factory=list)  # attention/residual tensors (tensorrt only)


def _digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return hashlib.sha1(a.tobytes() + str(a.shape).encode()).hexdigest()


def producer_map(graph) -> dict[str, object]:
    return {o: n for n in graph.node for o in n.output}


def consumer_map(graph) -> dict[str, list]:
    out: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def ensure_node_names(model) -> None:
    seen = set()
    for i, n in enumerate(model.graph.node):
        if not n.name or n.name in seen:
            n.name = f"{n.op_type}_{i}"
        seen.add(n.name)


def find_linears(model, weights: Mapping[str, np.ndarray], *, rename: bool = True) -> list[LinearSite]:
    """Locate each named Linear (weights: layer -> W [out, in]) by its weight's value.

    Raises ValueError naming the layers that could not be found (e.g. an exporter that folded
    the weight into something else), because quantizing a guessed tensor would be silent damage.
    """
    from onnx import numpy_helper

    g = model.graph
    ensure_node_names(model)
    inits = {i.name: i for i in g.initializer}
    by_digest: dict[str, str] = {}
    for layer, w in weights.items():
        w = np.asarray(w, dtype=np.float32)
        by_digest[_digest(w.T)] = layer + "|T"
        by_digest.setdefault(_digest(w), layer + "|N")
    consumers = consumer_map(g)
    sites: dict[str, LinearSite] = {}
    renames: dict[str, str] = {}
    for n in g.node:
        if n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in inits:
            arr = numpy_helper.to_array(inits[n.input[1]])
            hit = by_digest.get(_digest(arr)) if arr.ndim == 2 else None
            if hit and hit.endswith("|T"):
                layer = hit[:-2]
                if layer in sites:
                    continue
                sites[layer] = LinearSite(layer, n.name, n.input[1], n.input[0], True)
        elif n.op_type == "Gemm" and len(n.input) >= 2 and n.input[1] in inits:
            attrs = {a.name: a for a in n.attribute}
            trans_b = attrs["transB"].i if "transB" in attrs else 0
            arr = numpy_helper.to_array(inits[n.input[1]])
            hit = by_digest.get(_digest(arr)) if arr.ndim == 2 else None
            if hit and ((trans_b and hit.endswith("|N")) or (not trans_b and hit.endswith("|T"))):
                layer = hit[:-2]
                if layer not in sites:
                    sites[layer] = LinearSite(layer, n.name, n.input[1], n.input[0], not trans_b)
    missing = [k for k in weights if k not in sites]
    if missing:
        raise ValueError(
            f"{len(missing)} encoder Linear weights were not found as MatMul/Gemm initializers in the ONNX graph "
            f"(first: {missing[0]}); the exporter may have folded or shared them"
        )
    # bias Add: MatMul -> Add(initializer)
    for s in sites.values():
        for c in consumers.get(_node_output(g, s.node), []):
            if c.op_type == "Add" and any(i in inits for i in c.input):
                s.bias_add = c.name
                break
    if rename:
        used = {i.name for i in g.initializer}
        for s in sites.values():
            new = f"{s.layer}.weight_t" if s.transposed else f"{s.layer}.weight"
            if new != s.weight and new not in used:
                renames[s.weight] = new
                s.weight = new
        _rename_tensors(model, renames)
    return [sites[k] for k in weights]


def _node_output(graph, name: str) -> str:
    for n in graph.node:
        if n.name == name:
            return n.output[0]
    raise KeyError(name)


def _rename_tensors(model, renames: Mapping[str, str]) -> None:
    if not renames:
        return
    g = model.graph
    for i in g.initializer:
        if i.name in renames:
            i.name = renames[i.name]
    for n in g.node:
        for k, x in enumerate(n.input):
            if x in renames:
                n.input[k] = renames[x]
    for vi in list(g.value_info) + list(g.input):
        if vi.name in renames:
            vi.name = renames[vi.name]


def weight_codes(w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """int8 codes of a weight that is already on its per-channel grid (W == q * s exactly)."""
    q = grid_codes(np.asarray(w, np.float32), np.asarray(scales, np.float32))
    if q is None:
        raise ValueError("weight is not exactly int8 x per-channel scale; the checkpoint is not on its INT8 grid")
    return q


def quantize_weight(model, site: LinearSite, scales: np.ndarray) -> None:
    """Replace the fp32 weight initializer by int8 codes + scale + DequantizeLinear (zero-point 0).

    For a MatMul, B is W^T with shape [in, out]: the output channel is axis 1.
    """
    from onnx import helper, numpy_helper

    g = model.graph
    init = next(i for i in g.initializer if i.name == site.weight)
    b = numpy_helper.to_array(init).astype(np.float32)
    w = b.T if site.transposed else b  # [out, in]
    q = weight_codes(w, scales)
    qb = q.T if site.transposed else q
    base = site.layer
    qname, sname, zname, dq_out = (f"{base}.weight_int8", f"{base}.weight_scale", f"{base}.weight_zero_point",
                                   f"{base}.weight_dq")
    g.initializer.remove(init)
    g.initializer.extend(
        [
            numpy_helper.from_array(np.ascontiguousarray(qb), qname),
            numpy_helper.from_array(np.asarray(scales, np.float32), sname),
            numpy_helper.from_array(np.zeros(len(scales), np.int8), zname),
        ]
    )
    dq = helper.make_node(
        "DequantizeLinear", [qname, sname, zname], [dq_out], name=f"{base}/weight/DequantizeLinear",
        axis=1 if site.transposed else 0,
    )
    node = next(n for n in g.node if n.name == site.node)
    for k, x in enumerate(node.input):
        if x == site.weight:
            node.input[k] = dq_out
    _insert_before(g, node, [dq])


def _insert_before(graph, node, new_nodes) -> None:
    idx = list(graph.node).index(node)
    for k, n in enumerate(new_nodes):
        graph.node.insert(idx + k, n)


def insert_qdq(model, tensor: str, amax: float, consumer_inputs: Iterable[tuple[object, int]], *, name: str,
               unsigned: bool) -> None:
    """Insert QuantizeLinear -> DequantizeLinear on `tensor` for the given (node, input index) uses.

    Symmetric per-tensor scale amax/127; int8 with zero-point 0, or uint8 with zero-point 128
    (the same codes shifted), saturating and rounding half to even as QuantizeLinear does.
    """
    from onnx import helper, numpy_helper

    if not (amax > 0 and np.isfinite(amax)):
        raise ValueError(f"activation range for {tensor!r} must be a positive number, got {amax}")
    g = model.graph
    scale = np.asarray(activation_scale(amax), dtype=np.float32)
    zp = np.asarray(UINT8_ZERO_POINT, np.uint8) if unsigned else np.asarray(0, np.int8)
    s_name, z_name = f"{name}.scale", f"{name}.zero_point"
    q_out, dq_out = f"{name}.quantized", f"{name}.dequantized"
    g.initializer.extend([numpy_helper.from_array(scale, s_name), numpy_helper.from_array(zp, z_name)])
    qn = helper.make_node("QuantizeLinear", [tensor, s_name, z_name], [q_out], name=f"{name}/QuantizeLinear")
    dqn = helper.make_node("DequantizeLinear", [q_out, s_name, z_name], [dq_out], name=f"{name}/DequantizeLinear")
    uses = list(consumer_inputs)
    first = min(uses, key=lambda u: list(g.node).index(u[0]))[0]
    for node, k in uses:
        node.input[k] = dq_out
    _insert_before(g, first, [qn, dqn])


def attention_matmuls(model, sites: list[LinearSite]) -> list:
    """MatMuls with two activation inputs (Q·K^T and P·V) in the encoder."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    linear_nodes = {s.node for s in sites}
    return [
        n for n in g.node
        if n.op_type == "MatMul" and n.name not in linear_nodes and not any(i in inits for i in n.input)
    ]


def _bias_outputs(graph, sites: list[LinearSite]) -> dict[str, str]:
    """{output tensor of a Linear's bias Add: that Linear's layer name}."""
    adds = {s.bias_add: s.layer for s in sites if s.bias_add}
    return {n.output[0]: adds[n.name] for n in graph.node if n.name in adds}


def residual_adds(model, sites: list[LinearSite]) -> list:
    """Adds of two activations where one side is a Linear's bias-add output (the residual connections)."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    prod = producer_map(g)
    bias_outputs = _bias_outputs(g, sites)
    out = []
    for n in g.node:
        if n.op_type == "Add" and len(n.input) == 2 and not any(i in inits for i in n.input):
            if any(i in bias_outputs for i in n.input) and all(i in prod for i in n.input):
                out.append(n)
    return out


def trained_ranges(model, sites: list[LinearSite], act_amax: Mapping[str, float]) -> dict[str, float]:
    """Ranges for the TensorRT placement's extra tensors that compression trained with (QAT), by tensor.

    Residual Adds: "<dense>.output" for the side coming from that Linear's bias Add and
    "<block>.residual" for the skip connection, each where QAT quantized it (it leaves low-SQNR ones in
    float and stores no range). Attention MatMuls: "<query|key|value>.output" for an input that is that
    Linear's bias-Add output after Reshape/Transpose only (they move values, never change them), and
    "<attention>.softmax" for the other input of the MatMul that reads V. Empty for checkpoints made
    without TensorRT QAT; what is missing here is calibrated at export.
    """
    g = model.graph
    prod = producer_map(g)
    bias_out = _bias_outputs(g, sites)
    out: dict[str, float] = {}
    for n in residual_adds(model, sites):
        dense_side = [t for t in n.input if t in bias_out]
        if len(dense_side) != 1 or not bias_out[dense_side[0]].endswith(".dense"):
            continue
        layer = bias_out[dense_side[0]]
        skip = next(t for t in n.input if t != dense_side[0])
        for t, key in ((dense_side[0], output_key(layer)), (skip, residual_key(layer[: -len(".dense")]))):
            if key in act_amax:
                out[t] = float(act_amax[key])

    def source(t: str) -> str | None:
        while t not in bias_out and t in prod and prod[t].op_type in ("Reshape", "Transpose"):
            t = prod[t].input[0]
        return bias_out.get(t)

    for n in attention_matmuls(model, sites):
        layers = [source(t) for t in n.input]
        for t, layer in zip(n.input, layers):
            if layer is not None and output_key(layer) in act_amax:
                out[t] = float(act_amax[output_key(layer)])
        values = [x for x in layers if x is not None and x.endswith(".value")]
        if len(values) == 1:  # P·V: the input that is not V is the softmax output
            key = softmax_key(values[0][: -len(".value")])
            for t, layer in zip(n.input, layers):
                if layer is None and key in act_amax:
                    out[t] = float(act_amax[key])
    return out


def residual_tensors(model, sites: list[LinearSite]) -> list[str]:
    """Both inputs of every residual Add, in graph order."""
    return list(dict.fromkeys(t for n in residual_adds(model, sites) for t in n.input))


def tensorrt_extra_tensors(model, sites: list[LinearSite],
                           float_tensors: Iterable[str] = ()) -> list[tuple[str, str, int]]:
    """(tensor, consumer node name, input index) for each extra QDQBERT quantization point: the attention
    MatMul inputs and the residual Adds' inputs, less the residual inputs in `float_tensors`."""
    keep_float = set(float_tensors)
    pts = []
    for n in attention_matmuls(model, sites):
        pts += [(t, n.name, k) for k, t in enumerate(n.input)]
    for n in residual_adds(model, sites):
        pts += [(t, n.name, k) for k, t in enumerate(n.input) if t not in keep_float]
    return pts


def _safe(name: str) -> str:
    return name.strip("/").replace("/", ".").replace(":", "_")


def apply_placement(
    model,
    sites: list[LinearSite],
    weight_scales: Mapping[str, np.ndarray],
    act_amax: Mapping[str, float],
    placement: str,
    extra_amax: Mapping[str, float] | None = None,
    float_tensors: Iterable[str] = (),
) -> QdqReport:
    """Quantize `model` in place for one placement. act_amax is keyed "<layer>.input" (manifest).

    For "tensorrt", extra_amax maps each tensor of `tensorrt_extra_tensors` to its range; the residual-Add
    inputs named in `float_tensors` stay in float.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown QDQ placement {placement!r}: choose one of {', '.join(PLACEMENTS)}")
    g = model.graph
    rep = QdqReport(placement)
    extra_pts = tensorrt_extra_tensors(model, sites, float_tensors) if placement == "tensorrt" else []
    nodes = {n.name: n for n in g.node}
    unsigned = placement == "onnxruntime"
    # Linears that read the same tensor with the same range (Q, K, V) share one Q/DQ pair, so the
    # runtime quantizes that activation once; different ranges get their own pair.
    groups: dict[tuple[str, float], list[LinearSite]] = {}
    for s in sites:
        key = act_key(s.layer)
        if key not in act_amax:
            raise ValueError(f"the manifest has no activation range {key!r}; "
                             "re-run calibration in `holoserve compress`")
        groups.setdefault((s.activation, float(act_amax[key])), []).append(s)
    for (tensor, amax), members in groups.items():
        uses = []
        for s in members:
            node = nodes[s.node]
            uses.append((node, list(node.input).index(s.activation)))
        insert_qdq(model, tensor, amax, uses, name=act_key(members[0].layer), unsigned=unsigned)
        rep.activation_qdq += 1
    for s in sites:
        quantize_weight(model, s, weight_scales[s.layer])
        rep.weight_dq += 1
        rep.linears.append(s.layer)
    if placement == "tensorrt":
        extra_amax = dict(extra_amax or {})
        nodes = {n.name: n for n in g.node}
        # group uses of the same tensor so one Q/DQ pair feeds them all
        groups: dict[str, list[tuple[str, int]]] = {}
        for t, nn, k in extra_pts:
            groups.setdefault(t, []).append((nn, k))
        for t, uses in groups.items():
            if t not in extra_amax:
                raise ValueError(f"no calibrated range for tensor {t!r} (TensorRT placement)")
            insert_qdq(model, t, float(extra_amax[t]), [(nodes[nn], k) for nn, k in uses], name=_safe(t) + ".qdq",
                       unsigned=False)
            rep.activation_qdq += 1
            rep.extra_tensors.append(t)
    return rep


def count_ops(model) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in model.graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return dict(sorted(out.items()))


def quantize_embedding(model, table: np.ndarray, name: str = "word_embeddings", *, lookup_first: bool = True,
                       scales: np.ndarray | None = None) -> dict:
    """Store an embedding table (found by value) as int8 codes + per-row scales.

    The table is the largest tensor of a BERT model (vocab x hidden) and stays fp32 in the
    checkpoint; keeping it fp32 here would cap what the export saves (docs/results/2026-11-22-export.md).
    Lookup becomes Gather(int8) -> Cast -> Mul(Gather(row scale)): weight-only, symmetric, so the error
    per element is at most half a step (amax_row / 254). Returns what was done, for the manifest.

    lookup_first=False instead dequantizes the table with DequantizeLinear(axis=0) and gathers
    from it: TensorRT only accepts an int8 constant that feeds a DequantizeLinear (it folds the
    table at build time), while ONNX Runtime would dequantize the whole table on every run.
    """
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    table = np.asarray(table, np.float32)
    want = _digest(table)
    inits = {i.name: i for i in g.initializer}
    hit = None
    for n in g.node:
        if n.op_type == "Gather" and n.input[0] in inits:
            arr = numpy_helper.to_array(inits[n.input[0]])
            if arr.shape == table.shape and _digest(arr) == want:
                hit = n
                break
    if hit is None:
        raise ValueError("the word embedding table was not found as a Gather initializer in the ONNX graph")
    codes, scales = embedding_codes(table, scales)
    amax = np.abs(table).max(axis=1)
    init = inits[hit.input[0]]
    ids = hit.input[1]
    axis = next((a.i for a in hit.attribute if a.name == "axis"), 0)
    if axis != 0:
        raise ValueError("embedding Gather with axis != 0 is not supported")
    out = hit.output[0]
    c_name, s_name, ax_name = f"{name}.int8", f"{name}.row_scale", f"{name}.unsqueeze_axes"
    g.initializer.remove(init)
    g.initializer.extend([
        numpy_helper.from_array(codes, c_name),
        numpy_helper.from_array(scales, s_name),
        numpy_helper.from_array(np.asarray([-1], np.int64), ax_name),
    ])
    if not lookup_first:
        z_name = f"{name}.zero_point"
        g.initializer.append(numpy_helper.from_array(np.zeros(len(scales), np.int8), z_name))
        new = [
            helper.make_node("DequantizeLinear", [c_name, s_name, z_name], [f"{name}.table"], name=f"{name}/Dequantize",
                             axis=0),
            helper.make_node("Gather", [f"{name}.table", ids], [out], name=f"{name}/Gather", axis=0),
        ]
    else:
        new = [
        helper.make_node("Gather", [c_name, ids], [f"{name}.codes"], name=f"{name}/GatherCodes", axis=0),
        helper.make_node("Cast", [f"{name}.codes"], [f"{name}.codes_f"], name=f"{name}/Cast", to=TensorProto.FLOAT),
        helper.make_node("Gather", [s_name, ids], [f"{name}.scales"], name=f"{name}/GatherScales", axis=0),
        helper.make_node("Unsqueeze", [f"{name}.scales", ax_name], [f"{name}.scales_u"], name=f"{name}/Unsqueeze"),
        helper.make_node("Mul", [f"{name}.codes_f", f"{name}.scales_u"], [out], name=f"{name}/Dequantize"),
        ]
    idx = list(g.node).index(hit)
    g.node.remove(hit)
    for k, n in enumerate(new):
        g.node.insert(idx + k, n)
    dq = codes.astype(np.float32) * scales[:, None]
    return {
        "lossless": bool(np.array_equal(dq, table)),
        "tensor": name,
        "shape": list(table.shape),
        "storage": "int8 codes + per-row float32 scale (weight-only)",
        "lookup": "Gather int8 rows, then scale" if lookup_first else "DequantizeLinear(axis=0), then Gather",
        "max_abs_error": float(np.abs(dq - table).max()),
        "max_rel_error": float((np.abs(dq - table).max(axis=1) / np.maximum(amax, 1e-12)).max()),
    }


def embedding_codes(table: np.ndarray, scales: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric int8 codes and float32 scales of an embedding table.

    `scales` are the checkpoint's own per-row scales when it quantized the table (the manifest's
    quantization.embeddings); otherwise they are derived here as amax_row / 127.
    """
    table = np.asarray(table, np.float32)
    if scales is None:
        amax = np.abs(table).max(axis=1)
        scales = np.where(amax > 0, amax / np.float32(WEIGHT_QMAX), np.float32(1.0)).astype(np.float32)
    scales = np.asarray(scales, np.float32)
    codes = round_codes(table, scales)
    return codes, scales


def dequantized_embedding(table: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
    """What the int8 embedding lookup returns for every row (codes x row scale, float32)."""
    codes, scales = embedding_codes(table, scales)
    return codes.astype(np.float32) * scales[:, None]


def embedding_is_int8_exact(table: np.ndarray, scales: np.ndarray | None = None) -> bool:
    """True when int8 storage of the table loses nothing (it already sits on a per-row int8 grid)."""
    return bool(np.array_equal(dequantized_embedding(table, scales), np.asarray(table, np.float32)))
