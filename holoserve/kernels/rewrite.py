"""Rewrite an `openvino` export's 2:4 INT8 Linears and attention blocks to HoloServe's kernels (see
holoserve.kernels)."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import DOMAIN, TILE, WINDOW, pack_24

ACTIVATIONS = {"gelu": lambda v: 0.5 * v * (1.0 + np.vectorize(math.erf)(v / math.sqrt(2.0))),
               "relu": lambda v: np.maximum(v, 0.0)}


@dataclass
class Linear:
    quantize: onnx.NodeProto  # QuantizeLinear of the input
    matmul: onnx.NodeProto
    add: onnx.NodeProto       # the bias Add: its output is the Linear's
    x: str                    # the float input
    x_scale: float
    weights: np.ndarray       # int8 [K, N]
    w_scale: np.ndarray       # [N]
    bias: np.ndarray          # [N]
    slice: onnx.NodeProto | None = None  # a Slice of the dequantized input before the MatMul (the [CLS] row)

    @property
    def source(self) -> tuple[str, str | None]:
        """What the Linear reads: its quantizer's output, and the Slice of it where there is one."""
        return self.quantize.output[0], self.slice.output[0] if self.slice is not None else None


class _Graph:
    def __init__(self, model: onnx.ModelProto):
        self.g = model.graph
        self.init = {i.name: i for i in self.g.initializer}
        self.consts = {n.output[0]: n for n in self.g.node if n.op_type == "Constant"}
        self.producer = {o: n for n in self.g.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in self.g.output}

    def array(self, name: str) -> np.ndarray | None:
        """The constant value of a tensor (an initializer, a Constant, or either through Identity nodes)."""
        if name in self.init:
            return numpy_helper.to_array(self.init[name])
        producer = self.producer.get(name)
        if producer is not None and producer.op_type == "Identity":
            return self.array(producer.input[0])
        node = self.consts.get(name)
        if node is not None and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        """The one node reading `name`, or None (several, none, or the value is also a graph output)."""
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None

    def read_only_by(self, name: str, nodes: list[onnx.NodeProto]) -> bool:
        """Whether only `nodes` read `name` (and it is no graph output)."""
        ids = {id(n) for n in nodes}
        return name not in self.outputs and all(id(c) in ids for c in self.consumers.get(name, []))


def _linear(G: _Graph, mm: onnx.NodeProto) -> Linear | None:
    """The 2:4 INT8 Linear ending at this MatMul, or None when the graph is not exactly that. Its input may be
    sliced after dequantizing (the last layer's [CLS]-row query): the same as quantizing the sliced input."""
    dqx, dqw = G.producer.get(mm.input[0]), G.producer.get(mm.input[1])
    cut = None
    if dqx is not None and dqx.op_type == "Slice" and G.only_consumer(dqx.output[0]) is mm:
        cut, dqx = dqx, G.producer.get(dqx.input[0])
    if not (dqx and dqw and dqx.op_type == "DequantizeLinear" and dqw.op_type == "DequantizeLinear"):
        return None
    q = G.producer.get(dqx.input[0])
    if not (q and q.op_type == "QuantizeLinear") or len(q.input) < 3 or len(dqx.input) < 3:
        return None
    sx, zx, sx2, zx2 = (G.array(n) for n in (q.input[1], q.input[2], dqx.input[1], dqx.input[2]))
    if any(a is None or a.size != 1 for a in (sx, zx, sx2, zx2)) or zx.dtype != np.uint8 or int(zx) != 128:
        return None
    if float(sx) != float(sx2) or int(zx2) != 128 or float(sx) <= 0:
        return None
    w, sw = G.array(dqw.input[0]), G.array(dqw.input[1])
    zw = G.array(dqw.input[2]) if len(dqw.input) > 2 else None
    if w is None or w.dtype != np.int8 or w.ndim != 2 or sw is None or (zw is not None and zw.any()):
        return None
    axis = next((a.i for a in dqw.attribute if a.name == "axis"), 1)
    K, N = w.shape
    if sw.size not in (1, N) or (sw.size == N and axis not in (1, -1)) or K % WINDOW or N % TILE:
        return None
    if (w.reshape(K // 4, 4, N) != 0).sum(1).max() > 2:
        return None
    add = G.only_consumer(mm.output[0])
    if add is None or add.op_type != "Add":
        return None
    other = add.input[1] if add.input[0] == mm.output[0] else add.input[0]
    bias = G.array(other)
    if bias is None or bias.shape != (N,):
        return None
    return Linear(q, mm, add, q.input[0], float(sx), w, np.broadcast_to(sw, (N,)).astype(np.float32),
                  bias.astype(np.float32), cut)


def _activation_between(G: _Graph, src: str, dst: str) -> tuple[str, list[onnx.NodeProto]] | None:
    """(name, nodes) when the nodes from tensor `src` to tensor `dst` compute exact GELU or ReLU of it
    element-wise, and nothing else reads their intermediate values."""
    nodes, frontier, seen = [], [dst], set()
    while frontier:
        name = frontier.pop()
        if name == src or name in seen:
            continue
        seen.add(name)
        node = G.producer.get(name)
        if node is None or node.op_type not in ("Div", "Erf", "Add", "Mul", "Relu", "Constant"):
            return None
        nodes.append(node)
        frontier.extend(i for i in node.input if i not in G.init)
        if len(nodes) > 12:
            return None
    for n in nodes:  # constants may be shared; computed values must not be
        if n.op_type != "Constant" and n.output[0] != dst and not G.read_only_by(n.output[0], nodes):
            return None
    # evaluate the piece on sample values
    ops = [n for n in nodes if n.op_type != "Constant"]
    order = [n for n in G.g.node if any(n is m for m in nodes)]
    inits = [G.init[i] for n in ops for i in n.input if i in G.init]
    graph = helper.make_graph(order, "act", [helper.make_tensor_value_info(src, onnx.TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info(dst, onnx.TensorProto.FLOAT, [None])], inits)
    from onnx.reference import ReferenceEvaluator

    try:
        v = np.linspace(-8, 8, 1601, dtype=np.float32)
        out = ReferenceEvaluator(helper.make_model(graph)).run(None, {src: v})[0]
    except Exception:  # noqa: BLE001 - anything the evaluator cannot run is not ours to rewrite
        return None
    for name, fn in ACTIVATIONS.items():
        if np.allclose(out, fn(v.astype(np.float64)), rtol=1e-5, atol=1e-6):
            return name, ops  # unused constants go with the dead-node sweep
    return None


@dataclass
class Attention:
    nodes: list            # the nodes it replaces, from the heads' views to the merged output
    last: onnx.NodeProto   # the Reshape merging the heads: its output is the attention's
    q: str
    k: str
    v: str
    mask: str
    head_size: int
    scale: float


def _perm(node: onnx.NodeProto) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)


def _heads(G: _Graph, name: str, perm: list[int], nodes: list) -> tuple[str, int] | None:
    """(source, head size) where `name` is the source [B, S, H * D] reshaped to [B, S, H, D] (D a constant) and
    transposed by `perm` in one or more Transposes read only here; their nodes are added to `nodes`."""
    total, found = [0, 1, 2, 3], []
    node = G.producer.get(name)
    while node is not None and node.op_type == "Transpose":
        p = _perm(node)
        if p is None or len(p) != 4 or G.only_consumer(node.output[0]) is None:
            return None
        total = [p[i] for i in total]  # y = T(x, p) reads x[p[i]] at axis i
        found.append(node)
        node = G.producer.get(node.input[0])
    if total != perm or node is None or node.op_type != "Reshape" or G.only_consumer(node.output[0]) is None:
        return None
    head_size = _last_of_shape(G, node.input[1])
    if head_size is None or head_size <= 0:
        return None
    nodes += [*found, node]
    return node.input[0], head_size


def _last_of_shape(G: _Graph, name: str, depth: int = 0) -> int | None:
    """The last element of a 1-D shape tensor where it is a constant: a constant, the last part of a Concat, or
    a Slice that runs to the end (the [CLS]-row rewrite's shapes); else None."""
    value = G.array(name)
    if value is not None:
        return int(value.reshape(-1)[-1]) if value.ndim == 1 and value.size else None
    node = G.producer.get(name)
    if node is None or depth > 4:
        return None
    if node.op_type == "Concat":
        return _last_of_shape(G, node.input[-1], depth + 1)
    if node.op_type == "Slice" and len(node.input) >= 3:
        ends, steps = G.array(node.input[2]), G.array(node.input[4]) if len(node.input) > 4 else None
        if ends is not None and ends.size == 1 and int(ends.reshape(-1)[0]) >= 2 ** 31 - 1 \
                and (steps is None or (steps.size == 1 and int(steps.reshape(-1)[0]) == 1)):
            return _last_of_shape(G, node.input[0], depth + 1)
    return None


def _attention(G: _Graph, softmax: onnx.NodeProto) -> Attention | None:
    """The attention block around this Softmax, when the graph is exactly Reshape/Transpose views of q, k and v
    per head, MatMul(q, k^T), Mul or Div by a constant, Add of a mask, Softmax on the last axis, MatMul with v,
    Transpose and Reshape back to [B, S, H * D], with a head size the kernel takes; else None."""
    axis = next((a.i for a in softmax.attribute if a.name == "axis"), -1)
    add = G.producer.get(softmax.input[0])
    if axis not in (-1, 3) or add is None or add.op_type != "Add" or G.only_consumer(add.output[0]) is None:
        return None
    scaled = [G.producer.get(i) for i in add.input]
    side = next((i for i, n in enumerate(scaled) if n is not None and n.op_type in ("Mul", "Div")), None)
    if side is None:
        return None
    mul, mask = scaled[side], add.input[1 - side]
    qk = G.producer.get(mul.input[0])
    c = G.array(mul.input[1])
    if qk is None or qk.op_type != "MatMul" or c is None or c.size != 1 or float(c) == 0.0 \
            or G.only_consumer(mul.output[0]) is None or G.only_consumer(qk.output[0]) is None:
        return None
    scale = float(c) if mul.op_type == "Mul" else float(np.float32(1.0) / np.float32(c))
    pv = G.only_consumer(softmax.output[0])
    if pv is None or pv.op_type != "MatMul" or pv.input[0] != softmax.output[0]:
        return None
    back = G.only_consumer(pv.output[0])
    last = G.only_consumer(back.output[0]) if back is not None and back.op_type == "Transpose" else None
    if back is None or _perm(back) != [0, 2, 1, 3] or last is None or last.op_type != "Reshape":
        return None
    nodes: list = [qk, mul, add, softmax, pv, back, last]
    q = _heads(G, qk.input[0], [0, 2, 1, 3], nodes)
    k = _heads(G, qk.input[1], [0, 2, 3, 1], nodes)
    v = _heads(G, pv.input[1], [0, 2, 1, 3], nodes)
    if q is None or k is None or v is None or not q[1] == k[1] == v[1] or q[1] % 16 or q[1] > 64:
        return None
    return Attention(nodes, last, q[0], k[0], v[0], mask, q[1], scale)


def _inits(base: str, lin: Linear) -> tuple[list[str], list[onnx.TensorProto]]:
    values, index, comp = pack_24(lin.weights)
    arrays = {"values": values, "index": index, "comp": comp,
              "scale": (np.float32(lin.x_scale) * lin.w_scale).astype(np.float32), "bias": lin.bias}
    names = [f"{base}.{k}" for k in arrays]
    return names, [numpy_helper.from_array(a, n) for n, a in zip(names, arrays.values())]


def rewrite(model: onnx.ModelProto, bf16: bool = False) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy of `model` with its 2:4 INT8 Linears and its attention blocks on HoloServe's kernels, and what it
    replaced: {"Sparse24Gemm": nodes, "Sparse24Ffn": nodes, "Attention": nodes, "linears": Linears replaced,
    "linears_kept": left}.
    `bf16`: the kernels read and write bf16 (Cast nodes around them), for OpenVINO running its own ops in
    bf16, which otherwise reorders every tensor into and out of them."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    G = _Graph(model)
    linears = [lin for mm in G.g.node if mm.op_type == "MatMul" and (lin := _linear(G, mm)) is not None]
    by_input: dict[tuple[str, str | None], list[Linear]] = {}
    for lin in linears:
        by_input.setdefault(lin.source, []).append(lin)
    replaced: dict[int, onnx.NodeProto] = {}  # id(first removed node) -> new node
    before: dict[int, list[onnx.NodeProto]] = {}  # id(first removed node) -> nodes the new one reads
    removed: set[int] = set()
    new_inits: list[onnx.TensorProto] = []
    counts: Counter = Counter()
    taken: set[int] = set()

    # FFNs: a lone Linear whose output runs through an activation into the next Linear's quantizer
    for up in linears:
        if len(by_input[up.source]) != 1 or up.slice is not None:
            continue
        for down in linears:
            if id(down) in taken or id(up) in taken or len(by_input[down.source]) != 1 or down.slice is not None:
                continue
            if G.only_consumer(down.quantize.output[0]) is None or down.weights.shape[0] != up.weights.shape[1]:
                continue
            if G.only_consumer(down.x) is None or G.only_consumer(down.matmul.input[0]) is None:
                continue  # the activation or its dequantized codes are read elsewhere too
            found = _activation_between(G, up.add.output[0], down.x)
            if found is None or not G.read_only_by(up.add.output[0], found[1]):
                continue
            act, act_nodes = found
            base = up.matmul.name.strip("/").replace("/", ".") + ".sparse24_ffn"
            names_up, inits_up = _inits(base + ".up", up)
            names_down, inits_down = _inits(base + ".down", down)
            new_inits += inits_up + inits_down
            node = helper.make_node("Sparse24Ffn", [up.x, *names_up, *names_down], [down.add.output[0]], name=base,
                                    domain=DOMAIN, x_scale=up.x_scale, h_scale=down.x_scale, activation=act)
            replaced[id(up.matmul)] = node
            removed.update(id(n) for n in (up.matmul, up.add, down.quantize, down.matmul, down.add, *act_nodes))
            taken.update((id(up), id(down)))
            counts["Sparse24Ffn"] += 1
            counts["linears"] += 2
            break

    # Linears sharing a quantized input (Q, K, V), and any lone one left
    for group in by_input.values():
        group = [lin for lin in group if id(lin) not in taken]
        if not group:
            continue
        base = group[0].matmul.name.strip("/").replace("/", ".") + ".sparse24"
        inputs = [group[0].x]
        ahead = []
        if group[0].slice is not None:  # the same Slice, of the float input the kernel quantizes itself
            cut = group[0].slice
            ahead.append(helper.make_node("Slice", [group[0].x, *cut.input[1:]], [f"{base}.input"],
                                          name=f"{base}/slice"))
            inputs = [ahead[0].output[0]]
        for i, lin in enumerate(group):
            names, inits = _inits(f"{base}.{i}", lin)
            inputs += names
            new_inits += inits
        node = helper.make_node("Sparse24Gemm", inputs, [lin.add.output[0] for lin in group], name=base,
                                domain=DOMAIN, x_scale=group[0].x_scale)
        first = min(group, key=lambda lin: _position(G, lin.matmul))
        replaced[id(first.matmul)] = node
        before[id(first.matmul)] = ahead
        removed.update(id(n) for lin in group for n in (lin.matmul, lin.add))
        counts["Sparse24Gemm"] += 1
        counts["linears"] += len(group)

    # attention blocks: the per-head views, scores, softmax and weighted sum as one node
    for softmax in [n for n in G.g.node if n.op_type == "Softmax"]:
        att = _attention(G, softmax)
        if att is None or any(id(n) in removed or id(n) in replaced for n in att.nodes):
            continue
        name = softmax.name.strip("/").replace("/", ".").removesuffix(".Softmax") + ".attention"
        replaced[id(att.last)] = helper.make_node(
            "Attention", [att.q, att.k, att.v, att.mask], [att.last.output[0]], name=name, domain=DOMAIN,
            head_size=att.head_size, scale=att.scale)
        removed.update(id(n) for n in att.nodes if n is not att.last)
        counts["Attention"] += 1

    emit = {key: before.get(key, []) + (_cast_around(node, 3 if node.op_type == "Attention" else 1) if bf16
                                         else [node])
            for key, node in replaced.items()}
    nodes = []
    for n in G.g.node:
        if id(n) in emit:
            nodes.extend(emit[id(n)])
        elif id(n) not in removed:
            nodes.append(n)
    if bf16:
        nodes = _skip_round_trips(nodes)
    del G.g.node[:]
    G.g.node.extend(nodes)
    G.g.initializer.extend(new_inits)
    _drop_dead(model)
    if counts["linears"] or counts["Attention"]:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    producer = {o: m for m in model.graph.node for o in m.output}
    counts["linears_kept"] = sum(1 for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in producer
                                 and producer[n.input[1]].op_type == "DequantizeLinear")
    return model, dict(counts)


def _cast_around(node: onnx.NodeProto, inputs: int = 1) -> list[onnx.NodeProto]:
    """`node` reading its first `inputs` inputs and writing bf16, with Casts from and to float32 around it, in
    graph order."""
    before = []
    for i in range(inputs):
        suffix = "" if i == 0 else str(i)  # the first keeps the name the profiles and tests know
        before.append(helper.make_node("Cast", [node.input[i]], [f"{node.name}.in{suffix}_bf16"],
                                       name=f"{node.name}/to_bf16{suffix}", to=onnx.TensorProto.BFLOAT16))
        node.input[i] = before[-1].output[0]
    after = []
    for i, out in enumerate(list(node.output)):
        node.output[i] = f"{node.name}.out{i}_bf16"
        after.append(helper.make_node("Cast", [node.output[i]], [out], name=f"{node.name}/out{i}_to_f32",
                                      to=onnx.TensorProto.FLOAT))
    return [*before, node, *after]


def _skip_round_trips(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` with each Cast to bf16 of a kernel's bf16 output cast to float32 dropped, its readers reading the
    bf16 output itself (exact: bf16 -> float32 -> bf16 is the identity). Kernel to kernel (Q, K and V into
    the attention op, its output into the next Linear) then runs without the two conversions OpenVINO would
    otherwise execute."""
    producer = {o: n for n in nodes for o in n.output}

    def cast_to(n: onnx.NodeProto | None) -> int | None:
        return next((a.i for a in n.attribute if a.name == "to"), None) if n and n.op_type == "Cast" else None

    def kernel_bf16(name: str) -> str | None:  # the kernel output that `name` is a float32 copy of
        cast = producer.get(name)
        if cast_to(cast) != onnx.TensorProto.FLOAT or cast.input[0] not in producer:
            return None
        return cast.input[0] if producer[cast.input[0]].domain == DOMAIN else None

    alias = {}
    for n in nodes:
        if cast_to(n) == onnx.TensorProto.BFLOAT16 and (src := kernel_bf16(n.input[0])) is not None:
            alias[n.output[0]] = src
    for n in nodes:
        for i, name in enumerate(n.input):
            if name in alias:
                n.input[i] = alias[name]
    return [n for n in nodes if not (n.output and n.output[0] in alias)]


def _position(G: _Graph, node: onnx.NodeProto) -> int:
    return next(i for i, n in enumerate(G.g.node) if n is node)


def _drop_dead(model: onnx.ModelProto) -> None:
    """Remove the nodes and initializers nothing reads any more (the replaced Linears' quantizers)."""
    g = model.graph
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        keep = [n for n in g.node if any(o in used for o in n.output)]
        if len(keep) == len(g.node):
            break
        del g.node[:]
        g.node.extend(keep)
    inits = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(inits)
