"""Where the time goes: ours on OpenVINO against OpenVINO's NNCF INT8 of the dense model, per operation.

    python -m bench.cpu_latency.profile_openvino CHECKPOINT --dense HF_FOLDER --data-dir GLUE_DIR \
        [--batch 1] [--seq 128] [--threads 1] [--static]

Both engines are built as `bench/cpu_latency/run.py` builds them (ours: the checkpoint's `openvino`
export; the peer: `nncf.quantize`, transformer preset, on the first --calibration-rows training rows
of the dense model's plain fp32 ONNX export) and compiled with PERF_COUNT on; with --static both are
compiled for the one [batch, seq] shape, as `--openvino-shapes` and run.py's static rows do. The two run
interleaved, one run of each per round; each timed run reads OpenVINO's per-node profiling counters;
the report sums them per operation class (quantized GEMMs,
fused attention, everything else) and per (node type, kernel), beside the wall-clock median of the
same runs. Writes bench/results/<today>-NAME/NAME.{json,md} (--out).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench.cpu_latency.common import (kernels_missing, load_avg, nncf_int8, openvino_modules, output_options, parse,
                                      random_rows, require_openvino, save, shape_options, timing_options, train_samples)
from bench.lib.report import table
from holoserve.core.machine import describe_cpu

ENGINES = {"openvino_nncf_int8": "OpenVINO INT8 (NNCF PTQ, dense weights)", "ours_openvino": "ours on OpenVINO",
           "ours_openvino_kernels": "ours on OpenVINO + 2:4 kernels"}


def op_class(node_type: str, name: str = "") -> str:
    """GEMMs (OpenVINO's FullyConnected family, int8 or float; HoloServe's 2:4 kernels, which run as
    `Reference` nodes and include their input's quantization and, in the FFN, the activation), the fused
    attention block (the CPU plugin's `Subgraph`: QK^T, softmax, xV; or HoloServe's `Attention`, a `Reference`
    node named `...attention`), or other (LayerNorm, adds, quantize, reorders, ...)."""
    if node_type == "Reference" and name.endswith(".attention"):
        return "attention"
    if node_type.startswith("FullyConnected") or node_type in ("MatMul", "Reference"):
        return "gemm"
    if node_type == "Subgraph":
        return "attention"
    return "other"


def profile(compiled: dict, feed: dict, runs: int, warmup: int) -> dict:
    """{engine: its wall-clock median and node times} for compiled models run interleaved, one run of
    each per round, so that background load hits them alike."""
    engines = {}
    for key, c in compiled.items():
        request = c.create_infer_request()
        engines[key] = (request, {n: feed[n] for n in (i.get_any_name() for i in c.inputs)})
        for _ in range(warmup):
            request.infer(engines[key][1])
    wall = {k: [] for k in engines}
    per_kind = {k: defaultdict(float) for k in engines}
    per_class = {k: defaultdict(float) for k in engines}
    count = {k: defaultdict(int) for k in engines}
    for _ in range(runs):
        for key, (request, f) in engines.items():
            t0 = time.perf_counter()
            request.infer(f)
            wall[key].append((time.perf_counter() - t0) * 1000.0)
            for p in request.profiling_info:
                ms = p.real_time.total_seconds() * 1000.0 / runs
                per_kind[key][f"{p.node_type} / {p.exec_type}"] += ms
                per_class[key][op_class(p.node_type, p.node_name)] += ms
                count[key][f"{p.node_type} / {p.exec_type}"] += 1
    out = {}
    for key in engines:
        kinds, classes = per_kind[key], per_class[key]
        out[key] = {"wall_median_ms": round(float(np.median(wall[key])), 3),
                    "node_sum_ms": round(sum(classes.values()), 3),
                    "per_class_ms": {k: round(v, 3) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])},
                    "per_kind": [{"kind": k, "ms": round(v, 3), "nodes": count[key][k] // runs}
                                 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]) if v >= 0.005]}
    return out


def markdown(r: dict) -> str:
    e = r["engines"]
    peer = e["openvino_nncf_int8"]
    keys = [k for k in ENGINES if k in e]
    ours = [k for k in keys if k != "openvino_nncf_int8"]
    rows = [[label, *(f"{e[k][key]:.2f}" for k in keys), *(f"{e[k][key] / peer[key]:.2f}" for k in ours)]
            for label, key in (("wall clock, median (ms)", "wall_median_ms"),
                               ("sum of node times (ms)", "node_sum_ms"))]
    for c in ("gemm", "attention", "other"):
        ms = {k: e[k]["per_class_ms"].get(c, 0.0) for k in keys}
        rows.append([f"{c} (ms, share)", *(f"{ms[k]:.2f} ({100 * ms[k] / e[k]['node_sum_ms']:.0f} %)" for k in keys),
                     *(f"{ms[k] / ms['openvino_nncf_int8'] if ms['openvino_nncf_int8'] else float('nan'):.2f}"
                       for k in ours)])
    lines = [f"# Per-operation profile on OpenVINO ({r['date']}, {r['machine']})", "",
             f"Batch {r['batch']}, sequence {r['seq']}"
             f"{' (all compiled for that static shape)' if r.get('static') else ''}, {r['threads']} thread(s), "
             f"{r['runs']} timed runs per engine, "
             "interleaved; "
             f"checkpoint `{r['checkpoint']}`, dense model `{r['dense']}`; OpenVINO {r['versions']['openvino']}, "
             f"NNCF {r['versions']['nncf']}. Load average before/after: {r['loadavg_before']} / {r['loadavg_after']}.",
             "", *table(["", *(ENGINES[k] for k in keys), *(f"{ENGINES[k]} / NNCF" for k in ours)], rows)]
    lines += [f"\nNot run: {ENGINES[k]} — {why}." for k, why in (r.get("skipped_engines") or {}).items()]
    for k in keys:
        lines += ["", f"## {ENGINES[k]}: node type / kernel", "",
                  *table(["ms", "nodes", "node type / kernel"],
                         [[f"{x['ms']:.3f}", x["nodes"], x["kind"]] for x in e[k]["per_kind"][:15]])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.profile_openvino",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--dense", type=Path, required=True, help="the dense fine-tuned HF folder NNCF quantizes")
    ap.add_argument("--data-dir", default=None, help="GLUE data dir for the NNCF calibration rows")
    shape_options(ap, batch=1)
    timing_options(ap, 30)
    ap.add_argument("--calibration-rows", type=int, default=64)
    ap.add_argument("--static", action="store_true", help="compile both models for the one [batch, seq] shape")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile ours with HoloServe's 2:4 kernels (--openvino-kernels on)")
    output_options(ap, "cpu_profile_openvino")
    args = parse(ap, argv)
    require_openvino()
    ov, nncf, why = openvino_modules()
    if nncf is None:
        raise SystemExit(why)
    from transformers import AutoModelForSequenceClassification

    from holoserve.core.artifact import load_artifact
    from holoserve.export.onnx_export import torch_export_fp32
    from holoserve.export.reference import make_tokenizer

    art = load_artifact(args.checkpoint)
    ours = art.export_path("openvino")
    if ours is None or not ours.is_file():
        raise SystemExit(f"{art.path} has no OpenVINO export: run `holoserve export {art.path} --target openvino`")
    tok = make_tokenizer(art)
    with tempfile.TemporaryDirectory(prefix="holoserve-profile-") as tmp:
        work = Path(tmp)
        dense = AutoModelForSequenceClassification.from_pretrained(str(args.dense), local_files_only=True,
                                                                   attn_implementation="eager").eval()
        torch_export_fp32(dense, work / "dense.fp32.onnx")
        samples, _ = train_samples(art, tok, args.data_dir, args.calibration_rows)
        print(f"NNCF post-training quantization on {len(samples)} training rows ...", flush=True)
        nncf_ir = nncf_int8(ov, nncf, work / "dense.fp32.onnx", samples, work / "dense.nncf-int8.xml")
        feed = random_rows(np.random.default_rng(0), dense.config.vocab_size, args.batch, args.seq,
                           tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]"))
        core = ov.Core()
        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": args.threads, "PERF_COUNT": True}
        before = load_avg()
        compiled = {}
        models = [("openvino_nncf_int8", nncf_ir), ("ours_openvino", ours)]
        why = kernels_missing() if args.kernels else ""
        skipped = {"ours_openvino_kernels": why} if why else {}  # a CPU the kernels refuse: said, not profiled
        if args.kernels and not why:
            models.append(("ours_openvino_kernels", ours))
        for key, why in skipped.items():
            print(f"skipping {ENGINES[key]}: {why}", flush=True)
        for key, path in models:
            if key == "ours_openvino_kernels":
                from holoserve.backends.openvino import kernels_plan, read_model

                library, bf16, _ = kernels_plan("on", "auto")
                model, _ = read_model(core, path, library, bf16)
            else:
                model = core.read_model(str(path))
            if args.static:
                model.reshape({i.get_any_name(): ov.PartialShape([args.batch, args.seq]) for i in model.inputs})
            compiled[key] = core.compile_model(model, "CPU", config)
        engines = profile(compiled, feed, args.runs, args.warmup)
        for key, e in engines.items():
            print(f"{ENGINES[key]}: wall {e['wall_median_ms']:.2f} ms, nodes {e['node_sum_ms']:.2f} ms "
                  f"{e['per_class_ms']}", flush=True)
    report = {"benchmark": "cpu_profile_openvino", "date": datetime.now(timezone.utc).date().isoformat(),
              "machine": describe_cpu(), "checkpoint": art.path.name, "dense": args.dense.name,
              "batch": args.batch, "seq": args.seq, "static": args.static, "threads": args.threads,
              "runs": args.runs,
              "versions": {"openvino": ov.__version__, "nncf": nncf.__version__},
              "loadavg_before": before, "loadavg_after": load_avg(), "engines": engines, "skipped_engines": skipped}
    save(report, args, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
