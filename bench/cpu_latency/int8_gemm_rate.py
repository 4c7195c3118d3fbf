"""How fast OpenVINO's INT8 GEMM runs on this CPU: at MiniLM's shapes, and at large shapes (its best here).

    python -m bench.cpu_latency.int8_gemm_rate [--threads 1] [--name cpu_int8_gemm_rate]

Ours on OpenVINO spends most of its time in int8 GEMMs (the FullyConnected nodes OpenVINO makes of the
export's QuantizeLinear -> DequantizeLinear -> MatMul), the same kernel NNCF's model runs. This builds
one such GEMM per shape (activations per tensor, weights int8 per output channel, as the export writes
them), compiles it for its static shape with the LATENCY hint, records the precision OpenVINO ran it in,
and times one inference: multiply-adds per second per shape, MiniLM's shapes at seq 128 (batch 1 and
32) beside large ones. The wall time includes an inference's fixed cost (tens of microseconds), so the
small shapes are understated; the large ones give the best rate the kernel reaches on this CPU, to set
beside the whole model's GEMM time from `profile_openvino.py`. Writes bench/results/<today>-NAME/NAME.{json,md} (--out).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench.cpu_latency.common import output_options, parse, require_openvino, save
from bench.lib.report import table
from holoserve.backends.openvino import gemm_precisions
from holoserve.core.machine import describe_cpu

# (label, M tokens, K in, N out)
SHAPES = (
    ("MiniLM Q/K/V/O, batch 1", 128, 384, 384),
    ("MiniLM Q, K, V as one GEMM, batch 1", 128, 384, 1152),
    ("MiniLM FFN in, batch 1", 128, 384, 1536),
    ("MiniLM FFN out, batch 1", 128, 1536, 384),
    ("MiniLM Q/K/V/O, batch 32", 4096, 384, 384),
    ("MiniLM Q, K, V as one GEMM, batch 32", 4096, 384, 1152),
    ("MiniLM FFN in, batch 32", 4096, 384, 1536),
    ("MiniLM FFN out, batch 32", 4096, 1536, 384),
    ("large, 2048 cubed", 2048, 2048, 2048),
    ("large, 4096 x 4096 x 1024", 4096, 4096, 1024),
)


def gemm_model(path: Path, m: int, k: int, n: int, seed: int = 0) -> None:
    """x [m, k] float -> QuantizeLinear/DequantizeLinear (per tensor) -> MatMul with an int8 weight through
    DequantizeLinear (per output channel) -> y [m, n], as the export writes a Linear: one int8
    FullyConnected in OpenVINO."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.asarray(0.05, np.float32), "xs"),
             numpy_helper.from_array(np.asarray(0, np.int8), "xz"),
             numpy_helper.from_array(rng.integers(-127, 128, (k, n), dtype=np.int8), "w"),
             numpy_helper.from_array((rng.random(n, dtype=np.float32) + 0.5) * 1e-2, "ws"),
             numpy_helper.from_array(np.zeros(n, np.int8), "wz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    g = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.int8_gemm_rate", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=2.0, help="timing per shape (after a warm-up)")
    output_options(ap, "cpu_int8_gemm_rate")
    args = parse(ap, argv)
    ov = require_openvino()
    core = ov.Core()
    rows = []
    with tempfile.TemporaryDirectory(prefix="holoserve-gemm-") as tmp:
        for label, m, k, n in SHAPES:
            path = Path(tmp) / f"{m}x{k}x{n}.onnx"
            gemm_model(path, m, k, n)
            compiled = core.compile_model(str(path), "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                             "INFERENCE_NUM_THREADS": args.threads})
            req = compiled.create_infer_request()
            x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
            for _ in range(3):
                req.infer({0: x})
            times, t_end = [], time.perf_counter() + args.seconds
            while time.perf_counter() < t_end or len(times) < 5:
                t0 = time.perf_counter()
                req.infer({0: x})
                times.append(time.perf_counter() - t0)
            med = float(np.median(times))
            rows.append({"shape": label, "M": m, "K": k, "N": n, "runs": len(times), "median_ms": round(med * 1e3, 4),
                         "gmacs_per_s": round(m * k * n / med / 1e9, 1), "gemm_precision": gemm_precisions(compiled)})
            print(f"{label}: {rows[-1]['median_ms']} ms, {rows[-1]['gmacs_per_s']} G multiply-adds/s, "
                  f"{rows[-1]['gemm_precision']}", flush=True)
    peak = max(r["gmacs_per_s"] for r in rows)
    for r in rows:
        r["share_of_best"] = round(r["gmacs_per_s"] / peak, 3)
    report = {"benchmark": "cpu_int8_gemm_rate", "date": datetime.now(timezone.utc).date().isoformat(),
              "machine": describe_cpu(), "threads": args.threads, "openvino": ov.__version__, "rows": rows}
    save(report, args, markdown)
    return 0


def markdown(r: dict) -> str:
    lines = [f"# OpenVINO INT8 GEMM rate ({r['date']}, {r['machine']}, {r['threads']} thread(s), "
             f"OpenVINO {r['openvino']})",
             "", "One QuantizeLinear/DequantizeLinear -> MatMul (int8 weights per output channel) per shape, static, "
             "LATENCY hint; median wall time of one inference, which includes the call's fixed cost (tens of "
             "microseconds: it understates the small shapes) and the input's quantization.", "",
             *table(["shape", "M x K x N", "ms", "G multiply-adds/s", "share of the best", "GEMM precision"],
                    [[x["shape"], f"{x['M']} x {x['K']} x {x['N']}", x["median_ms"], x["gmacs_per_s"],
                      f"{x['share_of_best']:.0%}", x["gemm_precision"]] for x in r["rows"]])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
