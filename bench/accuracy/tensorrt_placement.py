"""Which extra Q/DQ pairs of the TensorRT placement cost accuracy.

Takes a checkpoint's `model.trt.onnx`, removes one class of the placement's extra Q/DQ pairs at a
time (softmax output, Q/K/V into the attention MatMuls, residual-Add inputs), and scores every variant
on the task's dev rows through ONNX Runtime, beside the checkpoint's own `holoserve eval` score. Small
dev sets move by whole points when a few predictions flip (CoLA's MCC by ~2 for 2.5 % of rows), so every
variant is also compared with the same graph stripped of all extra pairs (the onnxruntime placement's
numerics): the share of rows whose prediction is unchanged and the mean |logit difference|.

    python -m bench.accuracy.tensorrt_placement runs/minilm-sst2 --data-dir "$GLUE_DIR"
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np

from bench.accuracy.common import dev_set, export_file

VARIANTS = [(), ("softmax",), ("qkv",), ("softmax", "qkv"), ("residual",), ("softmax", "residual"),
            ("softmax", "qkv", "residual")]


def extra_pairs(model) -> dict[str, tuple[str, object, object, str]]:
    """{DequantizeLinear name: (kind, Q node, DQ node, quantized tensor)} for the placement's extra pairs."""
    g = model.graph
    prod = {o: n for n in g.node for o in n.output}
    cons: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            cons.setdefault(i, []).append(n)
    out = {}
    for n in g.node:
        if n.op_type != "DequantizeLinear" or not n.name.endswith(".qdq/DequantizeLinear"):
            continue
        q = prod[n.input[0]]
        src = q.input[0]
        if all(u.op_type == "Add" for u in cons.get(n.output[0], [])):
            kind = "residual"
        else:
            p = prod.get(src)
            while p is not None and p.op_type in ("Reshape", "Transpose", "Cast"):
                p = prod.get(p.input[0])
            kind = "softmax" if p is not None and p.op_type == "Softmax" else "qkv"
        out[n.name] = (kind, q, n, src)
    return out


def without(model, kinds):
    """A copy of `model` with the extra Q/DQ pairs of `kinds` removed (their consumers read the float tensor)."""
    m = copy.deepcopy(model)
    removed = 0
    for kind, q, dq, src in extra_pairs(m).values():
        if kind in kinds:
            for n in m.graph.node:
                for k, i in enumerate(n.input):
                    if i == dq.output[0]:
                        n.input[k] = src
            m.graph.node.remove(q)
            m.graph.node.remove(dq)
            removed += 1
    return m, removed


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.accuracy.tensorrt_placement",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--data-dir", required=True, help="the GLUE folder")
    args = ap.parse_args()
    import tempfile

    import onnx

    from holoserve.compress.evaluate import score
    from holoserve.compress.evaluate import EvalOptions, evaluate_checkpoint
    from holoserve.core.artifact import load_artifact

    art = load_artifact(args.checkpoint)
    path = export_file(art, args.checkpoint, "tensorrt-onnx", "model.trt.onnx", " --target tensorrt")
    dev = dev_set(art, args.data_dir)
    task, labels = dev.task, dev.labels
    base = onnx.load(str(path))
    ref = evaluate_checkpoint(args.checkpoint, EvalOptions(data_dir=args.data_dir))["metrics"][task.primary_metric]
    counts: dict[str, int] = {}
    for kind, *_ in extra_pairs(base).values():
        counts[kind] = counts.get(kind, 0) + 1
    print(f"{args.checkpoint.name}: {task.name} dev {task.primary_metric}, `holoserve eval` {100 * ref:.2f}; "
          f"extra Q/DQ pairs {counts}\n")
    print("| TensorRT placement | pairs removed | dev | vs checkpoint | same prediction | mean \\|Δlogit\\| |\n"
          "| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="holoserve-placement-") as tmp:

        def logits(model) -> np.ndarray:
            path = Path(tmp) / "variant.onnx"
            onnx.save(model, str(path))
            return dev.ort_logits(path)

        everything = ("softmax", "qkv", "residual")  # also the last variant: its logits are computed once
        plain = logits(without(base, everything)[0])
        for kinds in VARIANTS:
            m, n = without(base, kinds)
            out = plain if set(kinds) == set(everything) else logits(m)
            v = score(task, out, labels)[task.primary_metric]
            label = "as exported" if not kinds else "without " + " + ".join(kinds)
            same = "—" if task.is_regression else f"{100 * float((out.argmax(1) == plain.argmax(1)).mean()):.2f} %"
            print(f"| {label} | {n} | {100 * v:.2f} | {100 * (v - ref):+.2f} | {same} | "
                  f"{float(np.abs(out - plain).mean()):.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
