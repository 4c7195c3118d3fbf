"""Graph rewrites tried on ours-on-OpenVINO, each timed against the export as it is.

    python -m bench.cpu_latency.graph_variants CHECKPOINT [--batches 1,32] [--threads 1] [--seq 128]

Reads the checkpoint's `openvino` export (`model.ov.onnx`) and writes three variants of it, none of
which `holoserve export` applies, to learn whether it should:

- `qkv_fused`: each layer's Q, K and V projections, which read the same quantized input, as one
  int8 MatMul of three times the width and a Split (K and V only in the last layer, whose query is
  the [CLS] row). Exact: the same int32 sums and per-column scales.
- `kv_folded`: in the last layer (one query row) the key and value projections folded into the
  query's side: scores_h = (q_h·Wk_hᵀ)·Xᵀ and out_h = (softmax·X)·Wv_h + bv_h, so no per-token K or V
  is computed (q_h·bk_h is the same for every key and Softmax ignores it). Exact in real arithmetic;
  about 3 % fewer multiply-adds on MiniLM at seq 128.
- `int8_attention`: QuantizeLinear/DequantizeLinear pairs on both inputs of the attention MatMuls
  (Q, K and V symmetric int8, K before its head split; the softmax output uint8 with scale 1/255),
  the others' scales from
  their largest magnitude over --calibration-batches random batches through ONNX Runtime. Not
  exact: this tells the speed only.

Each variant and the unchanged export are compiled by OpenVINO for the one [batch, seq] shape with the
LATENCY hint and the CPU's default inference precision (as `holoserve serve` runs it), then timed
interleaved, one run of each per round. Reported per cell: both medians, unchanged / variant (above 1:
the variant is faster), and the variant's largest logit difference from the unchanged export on the
timed inputs. Writes bench/results/<today>-NAME/NAME.{json,md} (--out).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench.cpu_latency.common import (load_avg, output_options, parse, random_rows, require_openvino, save,
                                      timing_options)
from bench.lib.report import table
from holoserve.core.machine import describe_cpu

VARIANTS = ("qkv_fused", "kv_folded", "int8_attention")


def _graph_helpers():
    from holoserve.export import fusion
    from holoserve.export.qdq import consumer_map, producer_map

    return fusion, producer_map, consumer_map


def _weight(inits, producers, tensor):
    """A MatMul's int8 weight through DequantizeLinear: (q, scale, zero point), or None."""
    fusion, _, _ = _graph_helpers()
    dq = producers.get(tensor)
    if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 3:
        return None
    parts = [fusion.const_value(inits, t, producers) for t in dq.input[:3]]
    return None if any(p is None for p in parts) or parts[0].ndim != 2 else parts


def fuse_qkv(model) -> int:
    """Projections reading one input through int8 weights -> one MatMul + bias Add + Split."""
    from onnx import helper, numpy_helper

    fusion, producers_of, _ = _graph_helpers()
    g = model.graph
    producers = producers_of(g)
    inits = {t.name: t for t in g.initializer}
    plan, fused = {}, 0
    for b in fusion.find_attention(model):
        if b.bias is None:
            continue
        mms = [producers.get(t) for t in (b.q, b.k, b.v)]
        if any(m is None or m.op_type != "MatMul" for m in mms):
            continue
        adds = [next(n for n in g.node if t in n.input and n.op_type == "Add") for t in (b.q, b.k, b.v)]
        width = b.bias.size // 3
        groups = [(mms, adds, b.bias)] if len({m.input[0] for m in mms}) == 1 else \
            [(mms[1:], adds[1:], b.bias[width:])] if mms[1].input[0] == mms[2].input[0] else []
        for ms, ads, bias in groups:
            ws = [_weight(inits, producers, m.input[1]) for m in ms]
            if any(w is None for w in ws):
                continue
            base = f"{ms[0].output[0]}/qkv_fused"
            consts = {".w": np.concatenate([w[0] for w in ws], 1),
                      ".s": np.concatenate([np.broadcast_to(w[1], (w[0].shape[1],)) for w in ws]).astype(np.float32),
                      ".z": np.concatenate([np.broadcast_to(w[2], (w[0].shape[1],))
                                            for w in ws]).astype(ws[0][2].dtype),
                      ".b": bias.astype(np.float32), ".split": np.asarray([w[0].shape[1] for w in ws], np.int64)}
            g.initializer.extend(numpy_helper.from_array(v, base + k) for k, v in consts.items())
            plan[id(ms[0])] = [
                helper.make_node("DequantizeLinear", [base + ".w", base + ".s", base + ".z"], [base + ".wdq"], axis=1,
                                 name=base + "/W"),
                helper.make_node("MatMul", [ms[0].input[0], base + ".wdq"], [base + ".y"], name=base + "/MatMul"),
                helper.make_node("Add", [base + ".y", base + ".b"], [base + ".yb"], name=base + "/Bias"),
                helper.make_node("Split", [base + ".yb", base + ".split"], [a.output[0] for a in ads], axis=-1,
                                 name=base + "/Split")]
            for n in ms[1:] + ads:
                plan[id(n)] = []
            fused += 1
    _apply(model, plan)
    return fused


def fold_row_keys_values(model, num_heads: int) -> int:
    """The last layer's K and V projections folded into its one query row (see the module doc)."""
    from onnx import helper, numpy_helper

    from holoserve.export.standard_rewrites import CLS_SUFFIX

    fusion, producers_of, _ = _graph_helpers()
    g = model.graph
    producers = producers_of(g)
    inits = {t.name: t for t in g.initializer}
    plan = {}
    for b in fusion.find_attention(model):
        reshape, qk, av = b.query_path[0], b.query_path[2], b.query_path[-3]
        mk, mv = producers.get(b.k), producers.get(b.v)
        if not reshape.input[1].endswith(CLS_SUFFIX) or b.bias is None or mk is None or mv is None \
                or mk.op_type != "MatMul" or mv.op_type != "MatMul" or mk.input[0] != mv.input[0]:
            continue
        wk, wv = (_weight(inits, producers, m.input[1]) for m in (mk, mv))
        if wk is None or wv is None:
            continue
        wk, wv = (((q.astype(np.float32) - z.astype(np.float32)) * s.astype(np.float32)) for q, s, z in (wk, wv))
        x, (hidden, width), base = mk.input[0], wk.shape, f"{qk.output[0]}/kv_folded"
        d = width // num_heads
        consts = {".wk": np.ascontiguousarray(wk.reshape(hidden, num_heads, d).transpose(1, 2, 0)),
                  ".wv": np.ascontiguousarray(wv.reshape(hidden, num_heads, d).transpose(1, 0, 2)),
                  ".bv": b.bias[2 * width:].reshape(num_heads, 1, d).astype(np.float32),
                  ".axis": np.asarray([1], np.int64)}
        g.initializer.extend(numpy_helper.from_array(v, base + k) for k, v in consts.items())
        plan[id(qk)] = [
            helper.make_node("MatMul", [qk.input[0], base + ".wk"], [base + ".qwk"], name=base + "/QWk"),
            helper.make_node("Transpose", [x], [base + ".xt"], perm=[0, 2, 1], name=base + "/Xt"),
            helper.make_node("Unsqueeze", [base + ".xt", base + ".axis"], [base + ".xt4"], name=base + "/Xt4"),
            helper.make_node("MatMul", [base + ".qwk", base + ".xt4"], [qk.output[0]], name=base + "/Scores")]
        plan[id(av)] = [
            helper.make_node("Unsqueeze", [x, base + ".axis"], [base + ".x4"], name=base + "/X4"),
            helper.make_node("MatMul", [av.input[0], base + ".x4"], [base + ".px"], name=base + "/PX"),
            helper.make_node("MatMul", [base + ".px", base + ".wv"], [base + ".pxwv"], name=base + "/PXWv"),
            helper.make_node("Add", [base + ".pxwv", base + ".bv"], [av.output[0]], name=base + "/Bv")]
    _apply(model, plan)
    return len(plan) // 2


def attention_matmul_inputs(model) -> list[tuple[str, bool]]:
    """(tensor, is the softmax output) for both inputs of every attention MatMul. K is taken before its
    head-split Transpose (a per-tensor quantizer commutes with it), so that the Transpose still feeds
    the MatMul alone and split_key_transposes applies as in the export."""
    fusion, producers_of, _ = _graph_helpers()
    producers = producers_of(model.graph)
    out = []
    for b in fusion.find_attention(model):
        qk, av = b.query_path[2], b.query_path[-3]
        kt = producers.get(qk.input[1])
        k = kt.input[0] if kt is not None and kt.op_type == "Transpose" else qk.input[1]
        out += [(qk.input[0], False), (k, False), (av.input[0], True), (av.input[1], False)]
    return out


def quantize_attention(model, amax: dict[str, float]) -> int:
    from onnx import helper, numpy_helper

    g = model.graph
    sites = attention_matmul_inputs(model)
    renamed = {}
    for t, softmax in sites:
        scale, zp = (1 / 255, np.uint8(0)) if softmax else (max(amax[t], 1e-8) / 127, np.int8(0))
        g.initializer.extend([numpy_helper.from_array(np.asarray(scale, np.float32), t + ".aq_scale"),
                              numpy_helper.from_array(np.asarray(zp), t + ".aq_zp")])
        renamed[t] = [helper.make_node("QuantizeLinear", [t, t + ".aq_scale", t + ".aq_zp"], [t + ".aq"]),
                      helper.make_node("DequantizeLinear", [t + ".aq", t + ".aq_scale", t + ".aq_zp"], [t + ".aqdq"])]
    nodes = []
    for n in g.node:
        for k, t in enumerate(n.input):
            if t in renamed and n.op_type in ("MatMul", "Transpose"):
                n.input[k] = t + ".aqdq"
        nodes.append(n)
        nodes += [q for o in n.output for q in renamed.get(o, [])]
    del g.node[:]
    g.node.extend(nodes)
    return len(sites) // 4


def _apply(model, plan: dict) -> None:
    """Replace nodes by id as `plan` says ([] drops one), restore a topological order (a fused
    projection stands where its first MatMul stood, before the bias Adds it now writes) and prune
    what nothing reads."""
    fusion, _, _ = _graph_helpers()
    if not plan:
        return
    g = model.graph
    nodes = _topological([m for n in g.node for m in plan.get(id(n), [n])], g)
    del g.node[:]
    g.node.extend(nodes)
    fusion.prune_dead(model)


def _topological(nodes: list, g) -> list:
    have = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    out, rest = [], list(nodes)
    while rest:
        left = []
        for n in rest:
            if all(i in have for i in n.input):
                out.append(n)
                have.update(n.output)
            else:
                left.append(n)
        if len(left) == len(rest):
            raise ValueError(f"rewritten graph has a cycle or a missing input at {left[0].name}")
        rest = left
    return out


def calibrate(path: Path, tensors: list[str], feeds: list[dict]) -> dict[str, float]:
    """Largest |value| of each tensor over the feeds, through ONNX Runtime."""
    import onnx

    from holoserve.core.ort import session

    m = onnx.load(str(path))
    known = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(t) for t in tensors if t not in known)
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(m, str(Path(tmp) / "m.onnx"))
        s = session(Path(tmp) / "m.onnx", threads=1, quiet=True)
        amax = {t: 0.0 for t in tensors}
        for f in feeds:
            for t, v in zip(tensors, s.run(tensors, f)):
                amax[t] = max(amax[t], float(np.abs(v).max()))
    return amax


def join_key_transposes(model) -> int:
    """Undo split_key_transposes (the export's OpenVINO-only rewrite), so find_attention sees the
    standard head split Transpose(0,2,3,1) of K again; build() splits them back afterwards."""
    from onnx import helper

    fusion, producers_of, consumers_of = _graph_helpers()
    g = model.graph
    producers, consumers = producers_of(g), consumers_of(g)
    plan = {}
    for n in g.node:
        first = producers.get(n.input[0]) if n.op_type == "Transpose" else None
        if fusion.transpose_perm(n) == [0, 1, 3, 2] and first is not None and first.op_type == "Transpose" \
                and fusion.transpose_perm(first) == [0, 2, 1, 3] and len(consumers.get(first.output[0], [])) == 1:
            plan[id(first)] = []
            plan[id(n)] = [helper.make_node("Transpose", [first.input[0]], [n.output[0]], perm=[0, 2, 3, 1],
                                            name=n.name + "/joined")]
    _apply(model, plan)
    return len(plan) // 2


def build(src: Path, variant: str, out: Path, num_heads: int, feeds: list[dict]) -> dict:
    import onnx

    from holoserve.export.standard_rewrites import split_key_transposes

    m = onnx.load(str(src))
    joined = join_key_transposes(m)
    if variant == "qkv_fused":
        n = fuse_qkv(m)
    elif variant == "kv_folded":
        n = fold_row_keys_values(m, num_heads)
    else:
        n = quantize_attention(m, calibrate(src, [t for t, sm in attention_matmul_inputs(m) if not sm], feeds))
    if not n:
        raise SystemExit(f"{src}: the {variant} rewrite found nothing to rewrite")
    if joined:
        split_key_transposes(m)
    onnx.checker.check_model(m)
    onnx.save(m, str(out))
    return {"rewritten": n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.graph_variants", description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    timing_options(ap, 0, "timed runs per engine (default: 300 at batch 1, 30 above)")
    ap.add_argument("--calibration-batches", type=int, default=4)
    output_options(ap, "cpu_graph_variants")
    args = parse(ap, argv)
    ov = require_openvino()
    from holoserve.core.artifact import load_artifact
    from holoserve.export.reference import make_tokenizer

    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    art = load_artifact(args.checkpoint)
    src = art.export_path("openvino")
    if src is None or not src.is_file():
        raise SystemExit(f"{art.path} has no OpenVINO export: run `holoserve export {art.path} --target openvino`")
    cfg = json.loads((art.path / "config.json").read_text())
    tok = make_tokenizer(art)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    rng = np.random.default_rng(0)
    cal = [random_rows(rng, cfg["vocab_size"], 8, args.seq, cls, sep) for _ in range(args.calibration_batches)]
    core = ov.Core()
    hint = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": args.threads}
    rows, built = [], {}
    before = load_avg()
    with tempfile.TemporaryDirectory(prefix="holoserve-variants-") as tmp:
        for v in variants:
            built[v] = build(src, v, Path(tmp) / f"{v}.onnx", int(cfg["num_attention_heads"]), cal)
            print(f"{v}: {built[v]}", flush=True)
        for batch in [int(b) for b in args.batches.split(",")]:
            feed = random_rows(rng, cfg["vocab_size"], batch, args.seq, cls, sep)
            runs = args.runs or (300 if batch == 1 else 30)

            def compiled(path):
                m = core.read_model(str(path))
                m.reshape({i.get_any_name(): ov.PartialShape([batch, args.seq]) for i in m.inputs})
                return core.compile_model(m, "CPU", hint).create_infer_request()

            for v in variants:
                reqs = [compiled(src), compiled(Path(tmp) / f"{v}.onnx")]
                outs = [list(r.infer(feed).values())[0] for r in reqs]
                for r in reqs:
                    for _ in range(args.warmup):
                        r.infer(feed)
                times = [[], []]
                for i in range(runs):
                    for k in ((0, 1) if i % 2 else (1, 0)):
                        t0 = time.perf_counter()
                        reqs[k].infer(feed)
                        times[k].append(time.perf_counter() - t0)
                base, new = (float(np.median(t)) * 1e3 for t in times)
                rows.append({"variant": v, "batch": batch, "runs": runs, "unchanged_ms": round(base, 3),
                             "variant_ms": round(new, 3), "unchanged_over_variant": round(base / new, 4),
                             "max_abs_dlogit": float(np.abs(outs[0] - outs[1]).max()),
                             "argmax_agreement": float((outs[0].argmax(1) == outs[1].argmax(1)).mean())})
                print(f"{v} batch {batch}: unchanged {base:.3f} ms, variant {new:.3f} ms, "
                      f"ratio {base / new:.3f}", flush=True)
    report = {"benchmark": "cpu_graph_variants", "date": datetime.now(timezone.utc).date().isoformat(),
              "machine": describe_cpu(), "checkpoint": art.path.name, "seq": args.seq, "threads": args.threads,
              "openvino": ov.__version__,
              "inference_precision": _type_name(core.get_property("CPU", "INFERENCE_PRECISION_HINT")),
              "rewrites": built, "loadavg_before": before, "loadavg_after": load_avg(), "rows": rows}
    save(report, args, markdown)
    return 0


def _type_name(t) -> str:
    return t.get_type_name() if hasattr(t, "get_type_name") else str(t)


def markdown(r: dict) -> str:
    lines = [f"# Graph rewrites on ours-on-OpenVINO ({r['date']}, {r['machine']})", "",
             f"Checkpoint `{r['checkpoint']}`, `model.ov.onnx` and three rewrites of it, each compiled for the one "
             f"shape (seq {r['seq']}), {r['threads']} thread(s), OpenVINO {r['openvino']}, inference precision "
             f"{r['inference_precision']}, timed interleaved with the unchanged export. Ratio above 1: the rewrite "
             f"is faster. Load average before/after: {r['loadavg_before']} / {r['loadavg_after']}.", "",
             *table(["rewrite", "batch", "unchanged ms", "rewritten ms", "unchanged / rewritten", "max abs Δlogit",
                     "argmax agreement"],
                    [[x["variant"], x["batch"], f"{x['unchanged_ms']:.3f}", f"{x['variant_ms']:.3f}",
                      f"{x['unchanged_over_variant']:.3f}", f"{x['max_abs_dlogit']:.3g}",
                      f"{x['argmax_agreement']:.2%}"]
                     for x in r["rows"]])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
