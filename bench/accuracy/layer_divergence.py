"""Where OpenVINO's numerics part from the export's, layer by layer.

Runs a checkpoint's `openvino` export (`model.ov.onnx`) on OpenVINO and on ONNX Runtime with graph
optimizations off (the ONNX operators as specified, which reproduce `holoserve eval`'s predictions), on the
same dev rows, with every activation quantizer's output and every LayerNorm output exposed. Per tensor, in
graph order: the share of INT8 codes that differ and the largest code difference (quantizers), or the mean
|difference| against the mean |value| (LayerNorms), over the real (unpadded) tokens. It shows how a float
difference of about 1e-6 in the first LayerNorm turns into whole-step code changes that grow layer by layer
(bench/accuracy/rounding_noise.py measures what that does to the dev score). With --perturb EPS the second
run is ONNX Runtime again, on the same graph with the position-embedding table × (1 + EPS · N(0, 1)) (as
rounding_noise.py does): the same cascade from one rounding-sized change, for scale. Writes a table and a plot.

    python -m bench.accuracy.layer_divergence runs/minilm-sst2 --data-dir "$GLUE_DIR" \\
        --results bench/results/<today>-layer-divergence-sst2-s0
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from bench.accuracy.common import command, dev_set, export_file, position_table, save
from bench.lib.report import figure, table


def probes(model) -> list[tuple[str, str]]:
    """(kind, tensor) in graph order: each activation QuantizeLinear output (weights are constants) and each
    LayerNormalization output."""
    consts = {t.name for t in model.graph.initializer} | {o for n in model.graph.node if n.op_type == "Constant"
                                                          for o in n.output}
    out = []
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in consts:
            out.append(("codes", n.output[0]))
        elif n.op_type == "LayerNormalization":
            out.append(("layernorm", n.output[0]))
    return out


def compare(kind: str, a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> dict:
    """The two runtimes' values of one tensor over the real tokens ([batch, seq, ...] tensors are masked)."""
    if a.ndim >= 2 and a.shape[:2] == mask.shape:
        a, b = a[mask], b[mask]
    if kind == "codes":
        d = np.abs(a.astype(np.int32) - b.astype(np.int32))
        return {"values": int(d.size), "changed_share": float((d > 0).mean()), "max_step": int(d.max(initial=0))}
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"values": int(d.size), "mean_abs_diff": float(d.mean()), "max_abs_diff": float(d.max(initial=0.0)),
            "relative": float(d.mean() / max(np.abs(a).mean(), 1e-30))}


def short(name: str) -> str:
    """A readable tensor name: the layer and the Linear or LayerNorm it feeds."""
    return name.replace("/m/bert/", "").replace("bert.", "").replace("/LayerNormalization_output_0", "").strip("/")


def markdown(r: dict) -> str:
    m = r["meta"]
    lines = [f"# {m['against']} against the ONNX operators, layer by layer ({m['date']}, {m['machine']})", "",
             f"Checkpoint `{m['checkpoint']}`, `model.ov.onnx`, the first {m['rows']} {m['task']} dev rows "
             f"({m['tokens']} real tokens): {m['against']} against ONNX Runtime with graph optimizations "
             "off. Logits: median |Δ| "
             f"{m['logits_median_abs_diff']:.3g}, largest {m['logits_max_abs_diff']:.3g}, {m['changed_predictions']} "
             "predictions changed.", "",
             *table(["tensor", "INT8 codes changed", "largest step", "LayerNorm mean \\|Δ\\| (of mean \\|x\\|)"],
                    [[short(t["tensor"]), f"{100 * t['changed_share']:.3g} %", t["max_step"], ""]
                     if t["kind"] == "codes"
                     else [short(t["tensor"]), "", "", f"{t['mean_abs_diff']:.2g} ({100 * t['relative']:.2g} %)"]
                     for t in r["tensors"]]),
             "", f"Command: `{m['command']}` ({m['seconds']:.0f} s)."]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    codes = [(i, t) for i, t in enumerate(r["tensors"]) if t["kind"] == "codes"]
    norms = [(i, t) for i, t in enumerate(r["tensors"]) if t["kind"] == "layernorm"]
    m = r["meta"]
    with figure(path, figsize=(8, 4)) as (fig, ax):
        ax.plot([i for i, _ in codes], [max(100 * t["changed_share"], 1e-7) for _, t in codes], "o-", ms=4,
                label="INT8 codes changed (%)")
        ax.plot([i for i, _ in norms], [max(100 * t["relative"], 1e-7) for _, t in norms], "s--", ms=4,
                label="LayerNorm mean |Δ| (% of mean |x|)")
        ax.set_yscale("log")
        ax.set_xlabel("tensor, in graph order (embeddings → last layer)")
        ax.set_ylabel("% (log scale)")
        ax.set_title(f"{m['checkpoint']}, {m['rows']} {m['task']} dev rows: {m['against']}\nagainst the ONNX operators",
                     fontsize=9)
        ax.legend(fontsize=8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.accuracy.layer_divergence", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--data-dir", required=True, help="the GLUE folder")
    ap.add_argument("--rows", type=int, default=64, help="dev rows, one batch (default 64)")
    ap.add_argument("--precision", default="f32", help="OpenVINO's inference precision (f32, default: auto)")
    ap.add_argument("--perturb", type=float, default=None, metavar="EPS",
                    help="compare with ONNX Runtime on a perturbed position table instead of OpenVINO")
    ap.add_argument("--results", type=Path, help="folder for layer_divergence.{json,md,png}; default: print only")
    args = ap.parse_args(argv)
    import onnx
    import onnxruntime as ort

    from holoserve.backends.openvino import compile_model
    from holoserve.core.artifact import load_artifact
    from holoserve.core.machine import describe_cpu
    from holoserve.core.manifest import OPENVINO

    t0 = time.time()
    art = load_artifact(args.checkpoint)
    path = export_file(art, args.checkpoint, OPENVINO, "model.ov.onnx", " --target openvino")
    dev = dev_set(art, args.data_dir, batch_size=None, first=args.rows)
    task, rows = dev.task, dev.rows
    (_, feed), = dev.batches
    model = onnx.load(str(path))
    tensors = probes(model)
    output = model.graph.output[0].name
    for _, name in tensors:
        model.graph.output.append(onnx.ValueInfoProto(name=name))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1

    def run_ort(m) -> dict:
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: feed[k] for k in names})))

    ref = run_ort(model)
    if args.perturb is not None:
        from onnx import numpy_helper

        k = position_table(model)
        t = model.graph.initializer[k]
        positions = numpy_helper.to_array(t)
        noise = np.random.default_rng(0).standard_normal(positions.shape)
        t.CopyFrom(numpy_helper.from_array((positions * (1 + args.perturb * noise)).astype(np.float32), t.name))
        got, against = run_ort(model), f"ONNX Runtime, position table × (1 + {args.perturb:g} · N(0, 1))"
    else:
        import openvino as ov

        compiled, _ = compile_model(path, threads=1, precision=args.precision, extra_outputs=[n for _, n in tensors])
        res = compiled.create_infer_request().infer({i.get_any_name(): feed[i.get_any_name()] for i in compiled.inputs})
        got = {n: res[o] for o in compiled.outputs for n in o.get_names()}
        against = f"OpenVINO {ov.__version__} ({args.precision})"
    mask = feed["attention_mask"].astype(bool)
    rows_out = [{"kind": kind, "tensor": name} | compare(kind, ref[name], got[name], mask) for kind, name in tensors]
    a, b = ref[output], got[output]
    meta = {"checkpoint": args.checkpoint.name, "task": task.name, "rows": len(rows), "tokens": int(mask.sum()),
            "against": against, "machine": describe_cpu(),
            "date": time.strftime("%Y-%m-%d"), "seconds": time.time() - t0,
            "logits_median_abs_diff": float(np.median(np.abs(a - b))),
            "logits_max_abs_diff": float(np.abs(a - b).max()),
            "changed_predictions": int((a.argmax(1) != b.argmax(1)).sum()) if a.shape[1] > 1 else None,
            "command": command(sys.argv[1:] if argv is None else argv, "bench.accuracy.layer_divergence")}
    report = {"meta": meta, "tensors": rows_out}
    save(args.results, "layer_divergence", report, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
