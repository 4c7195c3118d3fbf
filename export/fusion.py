"""Rewrite the onnxruntime-target graph into ONNX Runtime contrib ops that its CPU kernels run faster.

Three rewrites, each exact up to float rounding and each checked against the standard-op export
in the tests: QDQ Linears -> MatMulIntegerToFloat with the bias folded in
(fuse_integer_matmuls), a tanh-approximated GELU -> FastGelu (fuse_gelu_tanh), and each eager
self-attention block -> MultiHeadAttention (fuse_attention), described next. The exact rewrites in
standard ops that run after them (the [CLS] row only, OpenVINO's Kᵀ split) are in
export/standard_rewrites.py.

The TorchScript export of eager attention spells the block out: Reshape + Transpose of Q, K and V
into heads, MatMul Q·Kᵀ, a scale Mul, the Add of a [batch, 1, seq, seq] float mask (which the
graph builds from `attention_mask` with Range/Expand/Where on every run), Softmax, MatMul with V,
Transpose + Reshape back. On a CPU that is float work around the INT8 GEMMs (why fuse it:
docs/results/2026-11-22-cpu-latency.md). `com.microsoft.MultiHeadAttention` (ONNX Runtime contrib op,
CPU kernel) does the same computation in one kernel from the [batch, seq, hidden] Q/K/V and the raw
[batch, seq] padding mask, so the transposes and the mask construction disappear too.

A block whose scores get a learned additive term besides the mask before the Softmax (MPNet's
relative-position bias, [batch, heads, seq, seq], computed once and read by every layer) is fused
too: the term becomes the fused op's attention-bias input. Any other additive term leaves the block
in standard ops.

Numerics: identical up to float rounding, except that padded keys get ONNX Runtime's additive
mask value (-10000 before softmax) instead of the float minimum; both give them a weight of
exactly 0 after softmax for any realistic logit range. Padded *query* positions may differ, as
they do between attention kernels in PyTorch; nothing downstream of the [CLS] pooler reads them.

Only for the onnxruntime placement: TensorRT fuses attention itself, and the TensorRT placement
needs the attention MatMuls explicit for their Q/DQ pairs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .qdq import consumer_map, producer_map

CONTRIB = "com.microsoft"
FUSED_OP = "MultiHeadAttention"
MASK_INPUT = "attention_mask"
MASK_INT32 = "attention_mask.int32"


@dataclass
class AttentionBlock:
    q: str  # [batch, seq, hidden] tensors the block reads (after the bias Add)
    k: str
    v: str
    out: str  # [batch, seq, hidden] tensor the block writes (the final Reshape's output)
    scale: float
    nodes: list  # nodes the fused op replaces
    bias: np.ndarray | None = None  # [3 * hidden] Q, K, V projection biases, folded into the fused op
    attention_bias: str | None = None  # a [batch or 1, heads or 1, seq, seq] additive term (relative positions)
    # the nodes from the query's head split to the output, in order: Reshape, Transpose, MatMul Q·Kᵀ, the
    # scale, the scores' Adds, Softmax, MatMul with V, Transpose, Reshape. Each query row flows along it alone
    query_path: list = field(default_factory=list)


def tensor_ranks(model) -> dict[str, int]:
    """Rank of every tensor ONNX shape inference can type (graph inputs, outputs, intermediates).

    Run on the graph before the contrib-op rewrites (ONNX does not know their schemas); the
    rewrites keep the names of the tensors they do not remove.
    """
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    out = {}
    for v in list(g.input) + list(g.value_info) + list(g.output):
        t = v.type.tensor_type
        if t.HasField("shape"):
            out[v.name] = len(t.shape.dim)
    return out


def const_value(inits, name: str, producers) -> np.ndarray | None:
    """The value of `name` if it is a constant (initializer, Constant node, Identity of one); else None."""
    from onnx import numpy_helper

    if name in inits:
        return numpy_helper.to_array(inits[name])
    n = producers.get(name)
    if n is not None and n.op_type == "Identity":  # the exporter shares equal initializers this way
        return const_value(inits, n.input[0], producers)
    if n is not None and n.op_type == "Constant":
        for a in n.attribute:
            if a.name == "value":
                return numpy_helper.to_array(a.t)
    return None


def _attr(node, name: str, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def transpose_perm(node) -> list[int]:
    return list(_attr(node, "perm", []))


def _heads(producers, tensor: str, perm: list[int]):
    """tensor = Transpose(perm)(Reshape(x)) -> (x, [transpose, reshape]) or None."""
    t = producers.get(tensor)
    if t is None or t.op_type != "Transpose" or transpose_perm(t) != perm:
        return None
    r = producers.get(t.input[0])
    if r is None or r.op_type != "Reshape":
        return None
    return r.input[0], [t, r]


def _bias_add(inits, producers, consumers, tensor: str):
    """tensor = Add(x, 1-D constant bias) read only by the head Reshape -> (x, bias, add) or None."""
    add = producers.get(tensor)
    if add is None or add.op_type != "Add" or len(consumers.get(tensor, [])) != 1:
        return None
    consts = [(i, const_value(inits, i, producers)) for i in add.input]
    bias = [v for _, v in consts if v is not None]
    x = [i for i, v in consts if v is None]
    if len(bias) != 1 or len(x) != 1 or bias[0].ndim != 1:
        return None
    return x[0], bias[0], add


def _is_padding_mask(inits, tensor: str, producers) -> bool:
    """True when `tensor`'s values come from the attention_mask input and small constants only.

    That is what the exporter's mask construction looks like; an additive term built from a
    learned table (e.g. a relative-position bias) reads a large initializer and would be lost
    by the fusion, so such a block is left alone.
    """
    seen, stack, reads_mask = set(), [tensor], False
    while stack:
        t = stack.pop()
        if t in seen or not t:
            continue
        seen.add(t)
        if t == MASK_INPUT:
            reads_mask = True
            continue
        if t in inits:
            if int(np.prod(inits[t].dims)) > 4:
                return False
            continue
        n = producers.get(t)
        if n is None:
            return False  # another graph input
        if n.op_type == "Constant":
            v = const_value(inits, t, producers)
            if v is None or v.size > 4:
                return False
            continue
        if n.op_type in ("Shape", "Size"):  # reads only the shape of its input, never its values
            continue
        stack.extend(n.input)
    return reads_mask


def _additive_terms(add, inits, producers, consumers, graph_outputs):
    """The scores' additive terms ahead of the Softmax: (scale node, attention bias or None, inner Adds) or None.

    Add(scaled scores, padding mask) is BERT's block. Add(Add(scaled scores, term), padding mask) (or
    with the two terms the other way round) is one with a learned additive term besides the mask, e.g.
    MPNet's relative-position bias, computed once and shared by every layer: ONNX Runtime's fused op
    takes it as its attention bias input, so nothing is lost. Every block must have the padding mask.
    """
    def scaled_of(node):
        return next((producers[i] for i in node.input if i in producers
                     and producers[i].op_type in ("Mul", "Div")), None)

    scaled = scaled_of(add)
    if scaled is not None:
        mask = [i for i in add.input if i != scaled.output[0]]
        if len(mask) != 1 or not _is_padding_mask(inits, mask[0], producers):
            return None
        return scaled, None, []
    for k, t in enumerate(add.input[:2]):
        inner = producers.get(t)
        if inner is None or inner.op_type != "Add" or len(consumers.get(t, [])) != 1 or t in graph_outputs:
            continue
        scaled = scaled_of(inner)
        if scaled is None:
            continue
        terms = [i for i in inner.input if i != scaled.output[0]] + [add.input[1 - k]]
        if len(terms) != 2:
            continue
        masks = [i for i in terms if _is_padding_mask(inits, i, producers)]
        if len(masks) != 1:
            continue
        bias = next(i for i in terms if i not in masks)
        if const_value(inits, bias, producers) is not None:
            continue  # a constant term: not an attention bias this matcher knows
        return scaled, bias, [inner]
    return None


def _merge_reshape(tensor: str, consumers, graph_outputs, limit: int = 32):
    """The Reshape that merges the heads of `tensor` back into [batch, seq, hidden], or None.

    Besides that Reshape, `tensor` may be read only by Shape nodes whose results go nowhere but the
    Reshape's target shape (a model that computes the merged shape from the tensor's own size, like
    MPNet): those become dead when the block is fused, and the rewrite prunes them.
    """
    readers = consumers.get(tensor, [])
    merges = [n for n in readers if n.op_type == "Reshape" and n.input[0] == tensor]
    if len(merges) != 1 or tensor in graph_outputs:
        return None
    merge = merges[0]
    todo = [n for n in readers if n is not merge]
    seen: set[int] = set()
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if len(seen) > limit or (tensor in n.input and n.op_type != "Shape"):
            return None  # a reader of the values, or a long computation: leave the block alone
        for o in n.output:
            if o in graph_outputs:
                return None
            for c in consumers.get(o, []):
                if c is merge:
                    if merge.input[0] == o:
                        return None
                    continue
                todo.append(c)
    return merge


def find_attention(model) -> list[AttentionBlock]:
    """Every Softmax that sits in the eager-attention pattern above, as an AttentionBlock."""
    g = model.graph
    producers, consumers = producer_map(g), consumer_map(g)
    inits = {t.name: t for t in g.initializer}
    graph_outputs = {o.name for o in g.output}

    def only_consumer(t: str, op: str):
        cs = consumers.get(t, [])
        if len(cs) != 1 or cs[0].op_type != op or t in graph_outputs:
            return None
        return cs[0]

    blocks, ranks = [], None
    for sm in g.node:
        if sm.op_type != "Softmax":
            continue
        axis = _attr(sm, "axis", -1)
        add = producers.get(sm.input[0])
        if axis not in (-1, 3) or add is None or add.op_type != "Add":
            continue
        terms = _additive_terms(add, inits, producers, consumers, graph_outputs)
        if terms is None:
            continue
        scaled, attention_bias, extra_adds = terms
        if attention_bias is not None:
            if ranks is None:
                ranks = tensor_ranks(model)
            if ranks.get(attention_bias) != 4:
                continue  # ONNX Runtime takes a [batch or 1, heads or 1, seq, seq] attention bias only
        values = [const_value(inits, i, producers) for i in scaled.input]
        factor = next((v for v in values if v is not None), None)
        operand = next((i for i, v in zip(scaled.input, values) if v is None), None)
        if factor is None or np.size(factor) != 1 or operand is None:
            continue
        factor = float(np.asarray(factor).reshape(()))
        scale = factor if scaled.op_type == "Mul" else 1.0 / factor
        qk = producers.get(operand)
        if qk is None or qk.op_type != "MatMul":
            continue
        q = _heads(producers, qk.input[0], [0, 2, 1, 3])
        k = _heads(producers, qk.input[1], [0, 2, 3, 1])
        av = only_consumer(sm.output[0], "MatMul")
        if q is None or k is None or av is None or av.input[0] != sm.output[0]:
            continue
        v = _heads(producers, av.input[1], [0, 2, 1, 3])
        back = only_consumer(av.output[0], "Transpose")
        if v is None or back is None or transpose_perm(back) != [0, 2, 1, 3]:
            continue
        merge = _merge_reshape(back.output[0], consumers, graph_outputs)
        if merge is None:
            continue
        inner = [qk, scaled, *extra_adds, add, sm, av]
        if any(len(consumers.get(n.output[0], [])) != 1 for n in inner + q[1] + k[1] + v[1]):
            continue  # an intermediate is read elsewhere: leave the block alone
        inner += [back, merge]
        block = AttentionBlock(q[0], k[0], v[0], merge.output[0], scale, inner + q[1] + k[1] + v[1],
                               attention_bias=attention_bias, query_path=[q[1][1], q[1][0], *inner])
        biased = [_bias_add(inits, producers, consumers, t) for t in (block.q, block.k, block.v)]
        if all(biased) and len({b[1].shape for b in biased}) == 1:
            block.q, block.k, block.v = (b[0] for b in biased)
            block.bias = np.concatenate([b[1] for b in biased]).astype(np.float32)
            block.nodes += [b[2] for b in biased]
        blocks.append(block)
    return blocks


def _reads(node) -> set[str]:
    """Tensors a node reads, including outer-scope names its subgraphs (If/Loop/Scan bodies) use."""
    out = {i for i in node.input if i}
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            inner = ({o for n in sub.node for o in n.output} | {i.name for i in sub.input}
                     | {t.name for t in sub.initializer})
            out |= {t for n in sub.node for t in _reads(n)} - inner
    return out


def prune_dead(model) -> int:
    """Remove nodes none of whose outputs reach a graph output (after a rewrite). Returns how many."""
    g = model.graph
    needed = {o.name for o in g.output}
    keep = []
    for n in reversed(list(g.node)):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(_reads(n))
    removed = len(g.node) - len(keep)
    keep.reverse()
    del g.node[:]
    g.node.extend(keep)
    used = {i for n in g.node for i in _reads(n)} | {o.name for o in g.output}
    inits = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(inits)
    return removed


def _mha(inputs: list[str], output: str, num_heads: int, scale: float, name: str):
    from onnx import helper

    while inputs and not inputs[-1]:  # trailing optional inputs left out
        inputs = inputs[:-1]
    return helper.make_node(FUSED_OP, inputs, [output], name=name, domain=CONTRIB,
                            num_heads=int(num_heads), scale=float(scale))


def fuse_attention(model, num_heads: int) -> int:
    """Replace every eager attention block with MultiHeadAttention. Returns the number fused.

    The Q, K and V projection biases move into the fused op's bias input (three Adds fewer). Every
    block gets the [batch, seq] key padding mask, padded or not, so a row scores exactly the same
    alone or padded in any batch. (Without a mask ONNX Runtime's CPU kernel takes a flash-attention
    path on unpadded batches that rounds differently from the masked kernel; the INT8 quantizers
    downstream turn that into flipped codes, and a request's answer would depend on which requests it
    was batched with. Why: docs/results/2026-11-24-batch-invariance.md.)

    Raises ValueError when the graph has Softmax nodes but none matches (an exporter change would
    otherwise silently leave the slow path in place).
    """
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    blocks = find_attention(model)
    softmaxes = sum(1 for n in g.node if n.op_type == "Softmax")
    if softmaxes and not blocks:
        raise ValueError(f"found {softmaxes} Softmax nodes but no eager self-attention block to fuse")
    if not blocks:
        return 0
    if MASK_INPUT not in {i.name for i in g.input}:
        raise ValueError(f"the graph has no {MASK_INPUT!r} input to build the key padding mask from")
    dead = {id(n) for b in blocks for n in b.nodes}
    typed = {v.name for v in g.value_info}
    by_out = {b.out: b for b in blocks}
    nodes = [
        helper.make_node("Cast", [MASK_INPUT], [MASK_INT32], name="attention_mask/CastInt32", to=TensorProto.INT32),
    ]
    for i, n in enumerate(g.node):
        if id(n) not in dead:
            nodes.append(n)
        elif n.output[0] in by_out:  # the block's final Reshape: emit the fused op in its place
            b = by_out[n.output[0]]
            base = f"attention_{len(nodes)}_{i}"
            bias = ""
            if b.bias is not None:
                bias = f"{base}.qkv_bias"
                g.initializer.append(numpy_helper.from_array(b.bias, bias))
            nodes.append(_mha([b.q, b.k, b.v, bias, MASK_INT32, b.attention_bias or ""], b.out, num_heads, b.scale,
                              f"{base}/MultiHeadAttention"))
            if b.out not in typed:  # a contrib op's output type is unknown to ONNX shape inference
                g.value_info.append(helper.make_tensor_value_info(b.out, TensorProto.FLOAT, None))
    _install(model, nodes)
    return len(blocks)


# ------------------------------------------------------------------------------ integer MatMuls

INT_MATMUL_OP = "MatMulIntegerToFloat"


def _scalar_const(inits, name: str, producers) -> np.ndarray | None:
    v = const_value(inits, name, producers) if name else None
    return v if v is not None and v.size == 1 else None


def fuse_integer_matmuls(model) -> dict[str, int]:
    """DequantizeLinear(x_q) · DequantizeLinear(W_int8) [+ bias] -> com.microsoft.MatMulIntegerToFloat.

    ONNX Runtime turns each QDQ MatMul into MatMulIntegerToFloat itself when it loads the model,
    but leaves the bias Add (and, for Q/K/V, the bias inside MultiHeadAttention) as a separate
    pass over the [batch, seq, hidden] float output. Written out here, the bias becomes the op's
    own bias input, added in the GEMM's output stage. The arithmetic is the same: int32
    accumulation, times the activation scale and each column's weight scale, plus the bias.

    Only sites ONNX Runtime would fuse anyway are rewritten: a uint8/int8 activation with a scalar
    scale and zero point, int8 2-D weights with a per-column (or scalar) scale and zero point 0.
    Returns {"matmuls": n, "bias_folded": k}.
    """
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    producers, consumers = producer_map(g), consumer_map(g)
    inits = {t.name: t for t in g.initializer}
    graph_outputs = {o.name for o in g.output}
    replace: dict[int, object] = {}  # id(MatMul) -> new node
    dead: set[int] = set()  # ids of bias Adds folded into the new node
    folded = 0
    for mm in g.node:
        if mm.op_type != "MatMul":
            continue
        a, b = (producers.get(i) for i in mm.input)
        if a is None or b is None or a.op_type != "DequantizeLinear" or b.op_type != "DequantizeLinear":
            continue
        a_in = list(a.input) + [""] * (3 - len(a.input))
        b_in = list(b.input) + [""] * (3 - len(b.input))
        sx, zx = _scalar_const(inits, a_in[1], producers), _scalar_const(inits, a_in[2], producers)
        if sx is None or zx is None or zx.dtype not in (np.uint8, np.int8):
            continue
        w = inits.get(b_in[0])
        if w is None or w.data_type != TensorProto.INT8 or len(w.dims) != 2:
            continue
        n_out = int(w.dims[1])
        sw = const_value(inits, b_in[1], producers)
        zw = const_value(inits, b_in[2], producers) if b_in[2] else np.zeros(1, np.int8)
        axis = next((x.i for x in b.attribute if x.name == "axis"), 1)
        if sw is None or zw is None or np.any(zw):
            continue
        if sw.size != 1 and not (sw.shape == (n_out,) and axis in (1, -1)):
            continue
        inputs = [a_in[0], b_in[0], a_in[1], b_in[1], a_in[2], ""]  # b_zero_point 0: left out
        out = mm.output[0]
        users = consumers.get(out, [])
        if out not in graph_outputs and len(users) == 1 and users[0].op_type == "Add":
            add = users[0]
            other = [i for i in add.input if i != out]
            bias = const_value(inits, other[0], producers) if len(other) == 1 else None
            if bias is not None and bias.shape == (n_out,) and bias.dtype == np.float32:
                name = other[0]
                if name not in inits:
                    name = f"{mm.name or out}.bias"
                    g.initializer.append(numpy_helper.from_array(bias, name))
                    inits[name] = g.initializer[-1]
                inputs.append(name)
                out = add.output[0]
                dead.add(id(add))
                folded += 1
        while not inputs[-1]:
            inputs.pop()
        replace[id(mm)] = helper.make_node(INT_MATMUL_OP, inputs, [out], name=f"{mm.name or out}/Integer",
                                           domain=CONTRIB)
    if not replace:
        return {"matmuls": 0, "bias_folded": 0}
    _install(model, [replace.get(id(n), n) for n in g.node if id(n) not in dead])
    return {"matmuls": len(replace), "bias_folded": folded}


def _install(model, nodes: list) -> None:
    """Make `nodes` (topologically ordered) the graph's nodes, declare the contrib domain, and
    drop what no graph output reads any more."""
    from onnx import helper

    g = model.graph
    del g.node[:]
    g.node.extend(nodes)
    if not any(o.domain == CONTRIB for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CONTRIB, 1))
    prune_dead(model)


# ----------------------------------------------------------------------------------- tanh GELU

GELU_TANH_OP = "FastGelu"
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow"}


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _gelu_region(g, tanh, producers, consumers, inits, graph_outputs):
    """The elementwise subgraph around one Tanh that computes y = gelu_tanh(x): (x, y, nodes) or None.

    Found by structure (x: the one non-constant tensor the Tanh's elementwise ancestors read; the
    region: every elementwise node reachable from x whose other inputs are constants or the
    region's own tensors), then checked by evaluating the region on a sweep of x values, so any
    spelling of the formula (x*x*x or Pow, constant order) is accepted and nothing else is.
    """
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    def is_const(t: str) -> bool:  # scalar constants only: a bias vector is not part of the formula
        v = const_value(inits, t, producers)
        return v is not None and v.size == 1

    def scalar_op(n) -> bool:
        return n is not None and n.op_type in _ELEMENTWISE and all(
            is_const(i) or const_value(inits, i, producers) is None for i in n.input)

    leaves, stack, seen = set(), [tanh.input[0]], set()
    while stack:
        t = stack.pop()
        if t in seen or is_const(t):
            continue
        seen.add(t)
        n = producers.get(t)
        if scalar_op(n):
            stack.extend(n.input)
        else:
            leaves.add(t)
    if len(leaves) != 1:
        return None
    x = leaves.pop()
    region, made = [], {x}
    for n in g.node:  # graph order is topological
        if n.op_type not in _ELEMENTWISE | {"Tanh"}:
            continue
        if any(i in made for i in n.input) and all(i in made or is_const(i) for i in n.input):
            region.append(n)
            made.update(n.output)
    if tanh not in region:
        return None
    outs = {o for n in region for o in n.output}
    ids = {id(n) for n in region}
    read_outside = {t for t in outs if t in graph_outputs or any(id(c) not in ids for c in consumers.get(t, []))}
    if len(read_outside) != 1:
        return None
    y = read_outside.pop()
    consts = sorted({i for n in region for i in n.input if i not in made})
    probe = helper.make_graph(
        [helper.make_node(n.op_type, list(n.input), list(n.output)) for n in region], "probe",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [None])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [None])],
        [numpy_helper.from_array(np.asarray(const_value(inits, c, producers)), c) for c in consts])
    sweep = np.linspace(-8.0, 8.0, 2001, dtype=np.float32)
    try:
        got = ReferenceEvaluator(helper.make_model(probe)).run(None, {x: sweep})[0]
    except Exception:  # noqa: BLE001 - a region that does not evaluate on its own is not a GELU
        return None
    if np.shape(got) != sweep.shape or np.abs(got - gelu_tanh(sweep)).max() > 1e-5:
        return None
    return x, y, region


def fuse_gelu_tanh(model) -> int:
    """Replace each tanh-approximated GELU spelled out in elementwise ops with com.microsoft.FastGelu.

    The exporter writes gelu(approximate="tanh") as nine Mul/Add/Tanh nodes, each a full pass over
    the [batch, seq, intermediate] tensor; ONNX Runtime does not recognise that spelling. FastGelu
    computes the same formula in one kernel. The exact (erf) GELU is left to ONNX Runtime, which
    fuses it itself. Returns the number fused.
    """
    from onnx import helper

    g = model.graph
    producers, consumers = producer_map(g), consumer_map(g)
    inits = {t.name: t for t in g.initializer}
    graph_outputs = {o.name for o in g.output}
    fused: dict[int, object] = {}
    dead: set[int] = set()
    for t in [n for n in g.node if n.op_type == "Tanh"]:
        if id(t) in dead:
            continue
        found = _gelu_region(g, t, producers, consumers, inits, graph_outputs)
        if found is None:
            continue
        x, y, region = found
        last = producers[y]
        fused[id(last)] = helper.make_node(GELU_TANH_OP, [x], [y], name=f"{last.name or y}/FastGelu", domain=CONTRIB)
        dead.update(id(n) for n in region if n is not last)
    if not fused:
        return 0
    _install(model, [fused.get(id(n), n) for n in g.node if id(n) not in dead])
    return len(fused)
