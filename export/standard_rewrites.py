"""Exact rewrites in standard ONNX ops, after the QDQ placement: the last layer computes only the [CLS]
row the classifier reads (keep_classifier_row; the onnxruntime and openvino targets), and OpenVINO's
split of each attention's Kᵀ head transpose (split_key_transposes; the openvino target).

The row walk understands the attention blocks export/fusion.py finds, in standard ops or fused into
MultiHeadAttention, so it runs after the contrib-op rewrites on the onnxruntime target.
"""
from __future__ import annotations

import numpy as np

from .fusion import (
    CONTRIB,
    FUSED_OP,
    GELU_TANH_OP,
    INT_MATMUL_OP,
    AttentionBlock,
    _attr,
    const_value,
    _install,
    transpose_perm,
    _reads,
    find_attention,
)
from .qdq import consumer_map, producer_map

# ------------------------------------------------------------------ the classifier's row only

CLS_SUFFIX = "/cls_row"
_ROW_UNARY = {"Erf", "Tanh", "Relu", "Sigmoid", "Sqrt", "Neg", "Abs", "Exp", "Cast", "Identity", "Gelu", GELU_TANH_OP}
_ROW_BINARY = {"Add", "Sub", "Mul", "Div", "Pow"}


def _attention(node):
    """A MultiHeadAttention written by fuse_attention, or None. Its inputs are query, key, value, bias
    and the key padding mask: nothing with a query axis besides the query. (A block with an attention
    bias input, which has a query axis, is not one: the row walk stops there.)"""
    if node.op_type != FUSED_OP or node.domain != CONTRIB or len(node.input) > 5:
        return None
    return node


def _row_inputs(node, inits, producers, ranks) -> list[str] | None:
    """The inputs of `node` that carry one row per token, if the node computes each token's output
    from that token's row alone (so the [B, 1, ...] slice in gives the [B, 1, ...] slice out); else None."""
    def const(t: str) -> np.ndarray | None:
        return const_value(inits, t, producers) if t else None

    def act(t: str) -> bool:  # a per-token activation: [batch, seq, features]
        return bool(t) and const(t) is None and ranks.get(t) == 3

    def vector(t: str) -> bool:  # a constant that broadcasts along the features only
        v = const(t)
        return v is not None and v.ndim <= 1

    if not all(ranks.get(o) == 3 for o in node.output if o):
        return None
    op, ins = node.op_type, list(node.input)
    if op == INT_MATMUL_OP:
        b = const(ins[1])
        ok = act(ins[0]) and b is not None and b.ndim == 2 and all(const(t) is not None for t in ins[2:] if t)
        return [ins[0]] if ok else None
    if op == "MatMul":  # a float Linear: constant [in, out] weights, or int8 ones through DequantizeLinear
        b, w = producers.get(ins[1]), const(ins[1])
        if w is None and b is not None and b.op_type == "DequantizeLinear":
            w = const(b.input[0])
        return [ins[0]] if act(ins[0]) and w is not None and w.ndim == 2 else None
    if op in ("QuantizeLinear", "DequantizeLinear"):
        params = [const(t) for t in ins[1:] if t]
        per_tensor = all(p is not None and p.size == 1 for p in params)
        per_feature = all(p is not None and p.ndim <= 1 for p in params) and _attr(node, "axis", 1) in (-1, 2)
        return [ins[0]] if act(ins[0]) and (per_tensor or per_feature) else None
    if op == "LayerNormalization":
        ok = act(ins[0]) and _attr(node, "axis", -1) in (-1, 2) and all(const(t) is not None for t in ins[1:] if t)
        return [ins[0]] if ok else None
    if op in _ROW_UNARY:
        ok = act(ins[0]) and all(vector(t) for t in ins[1:] if t)
        return [ins[0]] if ok else None
    if op in _ROW_BINARY:
        rows = [t for t in ins if act(t)]
        consts_ok = all(vector(t) for t in ins if t not in rows)
        return rows if rows and consts_ok else None
    if _attention(node) is not None:
        q = node.input[0]
        return [q] if act(q) else None
    return None


def _query_row_inputs(node, block: AttentionBlock, ranks, axis_of: dict[str, int]) -> list[str]:
    """The inputs of a node on a standard-op attention block's query path that carry query rows.

    Along the path each query row is computed from its own row alone: the scores Q·Kᵀ, their scale,
    Softmax over the keys, the product with V and the head merge. The keys and values are read in
    full. An Add of the scores also reads the padding mask ([batch, 1, 1 or seq, seq]) or an
    attention bias; those have a query axis too and are sliced along it. Inside the block the
    token axis of [batch, heads, seq, ...] tensors is 2; `axis_of` records it for every such tensor.
    """
    path = block.query_path
    inside = {o for n in path[1:-2] for o in n.output}  # Transpose of Q .. MatMul with V: [batch, heads, seq, ...]
    for t in inside:
        axis_of[t] = 2
    chain = {o for n in path for o in n.output}
    if node is path[0]:  # the head split reads the [batch, seq, hidden] query
        return [node.input[0]]
    rows = [t for t in node.input if t in chain]
    if node.op_type == "Add":
        for t in node.input:
            if t and t not in chain and ranks.get(t) == 4:
                axis_of[t] = 2
                rows.append(t)
        if len(rows) != len([t for t in node.input if t]):
            return []  # an additive term of unknown layout: stop here
    return rows


def _classifier_rows(g, inits, producers, ranks) -> list:
    """Gather(axis=1, index 0) of a rank-3 tensor: the [CLS] row a BERT-style pooler/classifier reads."""
    seeds = []
    for n in g.node:
        if n.op_type == "Gather" and _attr(n, "axis", 0) == 1 and ranks.get(n.input[0]) == 3:
            idx = const_value(inits, n.input[1], producers)
            if idx is not None and idx.shape == () and int(idx) == 0:
                seeds.append(n)
    return seeds


def keep_classifier_row(model, ranks: dict[str, int]) -> dict[str, int]:
    """Compute the last layers only for the one token the classifier reads.

    A sequence classifier reads the final hidden state of token 0 ([CLS]) and nothing else, yet the
    exported graph computes all `seq` rows of the last encoder layer. Walking back from that
    Gather(axis=1, index 0), every node that computes each token's output from the same token's
    inputs alone (the Linears, LayerNorms, residual Adds, GELU, activation quantizers) is made to
    run on the [batch, 1, ...] slice; the walk stops at a tensor something else needs in full
    (the keys and values of the last attention, the previous layer's output) and reads a Slice of
    it there. The last attention keeps all keys and values and computes one query row, whether it
    is the fused op or the standard-op block (along its query path; the head split and merge
    Reshapes get target shapes with 1 for the sequence). That removes most of the last layer's GEMM
    work (only the keys' and values' projections stay whole) and nearly all of its attention, LayerNorm
    and GELU work (what it saves: docs/results/2026-11-24-openvino.md). Exact: every kept row is
    computed from the same inputs by the same kernels. A graph that already has the rewrite is left as
    it is. Returns {"row_nodes": nodes now run on one row, "slices": Slices added}.
    """
    from onnx import helper, numpy_helper

    g = model.graph
    nodes = list(g.node)
    producers = producer_map(g)
    inits = {t.name: t for t in g.initializer}
    seeds = {id(n) for n in _classifier_rows(g, inits, producers, ranks)}
    if not seeds or any(o.endswith(CLS_SUFFIX) for n in nodes for o in n.output):  # none, or done already
        return {"row_nodes": 0, "slices": 0}
    on_path = {id(n): b for b in find_attention(model) for n in b.query_path}  # standard-op attention
    axis_of: dict[str, int] = {}  # a row input's token axis, where it is not 1
    wants: dict[str, set] = {o.name: {"full"} for o in g.output}
    row_nodes: dict[int, list[str]] = {}
    for n in reversed(nodes):  # graph order is topological
        demand = set().union(*(wants.get(o, set()) for o in n.output if o))
        rows = None
        if id(n) in seeds:
            rows = [n.input[0]]
        elif demand == {"row"}:
            if id(n) in on_path:
                rows = _query_row_inputs(n, on_path[id(n)], ranks, axis_of) or None
            else:
                rows = _row_inputs(n, inits, producers, ranks)
            if rows is not None:
                row_nodes[id(n)] = rows
        for t in _reads(n):
            wants.setdefault(t, set()).add("row" if rows is not None and t in rows else "full")
    if not row_nodes:
        return {"row_nodes": 0, "slices": 0}
    row_outputs = {o for n in nodes if id(n) in row_nodes for o in n.output}
    consts = [numpy_helper.from_array(np.asarray([v], np.int64), f"cls_row.{k}") for k, v in
              (("start", 0), ("end", 1), ("axis", 1), ("axis2", 2), ("last", np.iinfo(np.int64).max))]
    g.initializer.extend(consts)
    out, sliced, reshaped = [], {}, set()
    for n in nodes:
        rows = row_nodes.get(id(n))
        if rows is not None:
            for t in rows:
                if t not in row_outputs and t not in sliced:
                    sliced[t] = f"{t}{CLS_SUFFIX}"
                    axis = "cls_row.axis2" if axis_of.get(t) == 2 else "cls_row.axis"
                    out.append(helper.make_node("Slice", [t, "cls_row.start", "cls_row.end", axis],
                                                [sliced[t]], name=f"{t}{CLS_SUFFIX}/Slice"))
            for k, t in enumerate(n.input):
                if t in rows:
                    n.input[k] = sliced.get(t, t)
            if id(n) in on_path and n.op_type == "Reshape":  # target shape [b, seq, ...] -> [b, 1, ...]
                shape = n.input[1]
                parts = [f"{shape}{CLS_SUFFIX}.head", f"{shape}{CLS_SUFFIX}.tail", f"{shape}{CLS_SUFFIX}"]
                if parts[2] not in reshaped:  # two Reshapes may share one target shape
                    reshaped.add(parts[2])
                    out += [helper.make_node("Slice", [shape, "cls_row.start", "cls_row.end"], [parts[0]],
                                             name=f"{parts[0]}/Slice"),
                            helper.make_node("Slice", [shape, "cls_row.axis2", "cls_row.last"], [parts[1]],
                                             name=f"{parts[1]}/Slice"),
                            helper.make_node("Concat", [parts[0], "cls_row.end", parts[1]], [parts[2]], axis=0,
                                             name=f"{parts[2]}/Concat")]
                n.input[1] = parts[2]
        out.append(n)
    # the row outputs changed shape ([B, 1, ...]); keep their element type, which ONNX shape inference
    # cannot find behind a contrib op on its own
    keep_vi = [v if v.name not in row_outputs else
               helper.make_tensor_value_info(v.name, v.type.tensor_type.elem_type, None) for v in g.value_info]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    _install(model, out)
    return {"row_nodes": len(row_nodes), "slices": len(sliced)}


# ----------------------------------------------------------------------------------- OpenVINO: Kᵀ split

def split_key_transposes(model) -> int:
    """For the openvino target: write each attention's Kᵀ head split, Transpose(perm 0,2,3,1) into
    Q·Kᵀ's MatMul, as Transpose(0,2,1,3) then Transpose(0,1,3,2). OpenVINO's CPU plugin folds the
    second into the MatMul (its transpose_b) and runs the first, a plain head split, faster than the one
    0,2,3,1 transpose (its generic kernel). Exact: the same elements, moved. What it saves:
    docs/results/2026-11-24-openvino.md. Returns how many transposes it split."""
    from onnx import helper

    g = model.graph
    consumers = consumer_map(g)
    nodes, count = [], 0
    for n in g.node:
        users = consumers.get(n.output[0], []) if n.op_type == "Transpose" else []
        if transpose_perm(n) == [0, 2, 3, 1] and len(users) == 1 and users[0].op_type == "MatMul" \
                and list(users[0].input).index(n.output[0]) == 1:
            heads = n.output[0] + ".heads"
            nodes.append(helper.make_node("Transpose", [n.input[0]], [heads], perm=[0, 2, 1, 3],
                                          name=n.name + "/heads"))
            nodes.append(helper.make_node("Transpose", [heads], [n.output[0]], perm=[0, 1, 3, 2], name=n.name))
            count += 1
        else:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return count
