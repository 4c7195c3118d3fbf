"""Would a 2:4 INT8 kernel pay on x86-64 CPUs with AVX2 but no AVX-512 VNNI? A probe against ONNX Runtime.

    python -m bench.cpu_kernels.avx2_probe [--seconds 0.5] [--rounds 3] [--name cpu_avx2_24_probe]

HoloServe's 2:4 kernels (holoserve/kernels) need AVX-512 VNNI and VBMI. On a CPU with AVX2 alone, ONNX
Runtime serves, with its exact u8 x u8 GEMM (`session.x64quantprecision`: its default adds pairs of products
in 16 bits and saturates there). `avx2_24.cpp` is a 2:4 GEMM for such CPUs, exact the same way (int16 pairs,
VPMADDWD); this times it against ONNX Runtime's MatMulInteger, exact and default, in this process, on the
same codes and 2:4 weights at MiniLM's GEMM shapes, one thread each, in alternating rounds (the fastest run
of each), and checks every output against an int64 reference. It times the GEMM alone: quantizing the input,
the epilogue and the float ops around it are not in either. Needs g++. Writes bench/results/<today>-NAME/
NAME.{json,md} (--out).
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench.cpu_latency.common import output_options, parse, save
from bench.lib.report import table
from holoserve.core.machine import cpu_flags, describe_cpu

SOURCE = Path(__file__).with_name("avx2_24.cpp")
# (label, M tokens, K in, N out): a sentence of ~32 tokens and a batch of 8 such, MiniLM's Linears
SHAPES = (
    ("Q, K, V as one GEMM, 32 tokens", 32, 384, 1152),
    ("FFN in, 32 tokens", 32, 384, 1536),
    ("FFN out, 32 tokens", 32, 1536, 384),
    ("Q, K, V as one GEMM, 256 tokens", 256, 384, 1152),
    ("FFN in, 256 tokens", 256, 384, 1536),
    ("FFN out, 256 tokens", 256, 1536, 384),
)


def build(out_dir: Path) -> ctypes.CDLL:
    """Compile avx2_24.cpp for AVX2 (x86-64-v3) and load it."""
    cxx = shutil.which("g++")
    if cxx is None:
        raise SystemExit("no g++ on PATH: the probe compiles bench/cpu_kernels/avx2_24.cpp")
    lib = out_dir / "libavx2_24.so"
    subprocess.run([cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-march=x86-64-v3", str(SOURCE), "-o", str(lib)],
                   check=True)
    dll = ctypes.CDLL(str(lib))
    dll.sparse24_avx2.restype = ctypes.c_double
    dll.sparse24_avx2.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_int]
    return dll


def weights_24(k: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Full-range int8 weights [k, n] with two non-zeros in each aligned group of four along k."""
    w = rng.integers(-127, 128, (k // 4, 4, n)).astype(np.int8)
    w[w == 0] = 1
    drop = np.argsort(rng.random((k // 4, 4, n)), axis=1)[:, :2, :]
    np.put_along_axis(w, drop, 0, axis=1)
    return w.reshape(k, n)


def ours(dll: ctypes.CDLL, x: np.ndarray, w: np.ndarray, seconds: float) -> tuple[float, np.ndarray]:
    m, k = x.shape
    y = np.empty((m, w.shape[1]), np.int32)
    once = dll.sparse24_avx2(x.ctypes.data, m, k, w.ctypes.data, w.shape[1], y.ctypes.data, 1)
    if once < 0:
        raise ValueError("the weights are not 2:4")
    reps = max(3, int(seconds / max(once, 1e-6)))
    return dll.sparse24_avx2(x.ctypes.data, m, k, w.ctypes.data, w.shape[1], y.ctypes.data, reps), y


def ort_session(w: np.ndarray, exact: bool):
    """ONNX Runtime's MatMulInteger on uint8 codes (zero point 128) and these int8 weights, one thread."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = w.shape
    g = helper.make_graph([helper.make_node("MatMulInteger", ["x", "w", "xz"], ["y"])], "mm",
                          [helper.make_tensor_value_info("x", TensorProto.UINT8, ["m", k])],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, ["m", n])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(128, np.uint8), "xz")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if exact:
        so.add_session_config_entry("session.x64quantprecision", "1")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def timed_ort(session, x: np.ndarray, seconds: float) -> tuple[float, np.ndarray]:
    y = session.run(None, {"x": x})[0]
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        session.run(None, {"x": x})
        best = min(best, time.perf_counter() - t0)
    return best, y


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_kernels.avx2_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=0.5, help="timing per engine, shape and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (the fastest run of each engine)")
    output_options(ap, "cpu_avx2_24_probe")
    args = parse(ap, argv)
    if not {"avx2", "fma"} <= cpu_flags():
        raise SystemExit("this CPU has no AVX2: nothing to probe")
    import onnxruntime

    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="holoserve-avx2-") as tmp:
        dll = build(Path(tmp))
        for label, m, k, n in SHAPES:
            x = rng.integers(0, 256, (m, k)).astype(np.uint8)
            w = weights_24(k, n, rng)
            ref = (x.astype(np.int64) - 128) @ w.astype(np.int64)
            exact, default = ort_session(w, True), ort_session(w, False)
            best = {"ours": float("inf"), "ort_exact": float("inf"), "ort_default": float("inf")}
            outs = {}
            for _ in range(args.rounds):
                for name, run in (("ours", lambda: ours(dll, x, w, args.seconds)),
                                  ("ort_exact", lambda: timed_ort(exact, x, args.seconds)),
                                  ("ort_default", lambda: timed_ort(default, x, args.seconds))):
                    t, outs[name] = run()
                    best[name] = min(best[name], t)
            macs = m * k * n  # dense-equivalent: what a dense GEMM of the same shape multiplies
            row = {"shape": label, "M": m, "K": k, "N": n,
                   **{f"{e}_ms": round(t * 1e3, 4) for e, t in best.items()},
                   **{f"{e}_gmacs": round(macs / t / 1e9, 1) for e, t in best.items()},
                   "ours_vs_ort_exact": round(best["ort_exact"] / best["ours"], 3),
                   "ours_vs_ort_default": round(best["ort_default"] / best["ours"], 3),
                   **{f"{e}_exact_share": round(float((outs[e] == ref).mean()), 4) for e in outs}}
            rows.append(row)
            print(f"{label}: ours {row['ours_ms']} ms, ONNX Runtime exact {row['ort_exact_ms']} ms "
                  f"({row['ours_vs_ort_exact']}x), default {row['ort_default_ms']} ms ({row['ours_vs_ort_default']}x); "
                  f"exact outputs: ours {row['ours_exact_share']:.0%}, ONNX Runtime exact "
                  f"{row['ort_exact_exact_share']:.0%}, default {row['ort_default_exact_share']:.0%}", flush=True)
    report = {"benchmark": "cpu_avx2_24_probe", "date": datetime.now(timezone.utc).date().isoformat(),
              "machine": describe_cpu(), "avx512": sorted(f for f in cpu_flags() if f.startswith("avx512")),
              "onnxruntime": onnxruntime.__version__, "rounds": args.rounds, "seconds": args.seconds, "rows": rows}
    save(report, args, markdown)
    return 0


def markdown(r: dict) -> str:
    lines = [f"# A 2:4 INT8 GEMM for AVX2 against ONNX Runtime ({r['date']}, {r['machine']}, ONNX Runtime "
             f"{r['onnxruntime']}, AVX-512: {', '.join(r['avx512']) or 'none'})", "",
             f"One thread each, the same uint8 codes and 2:4 int8 weights, the fastest run of {r['rounds']} "
             "alternating rounds; G multiply-adds/s counts a dense GEMM's (M x K x N). \"exact\": the share of "
             "outputs equal to an int64 reference.", "",
             *table(["shape", "M x K x N", "ours ms", "ORT exact ms", "ORT default ms", "ours vs ORT exact",
                     "ours vs ORT default", "G MACs/s ours / exact / default", "exact: ours / ORT exact / default"],
                    [[x["shape"], f"{x['M']} x {x['K']} x {x['N']}", x["ours_ms"], x["ort_exact_ms"],
                      x["ort_default_ms"],
                      f"{x['ours_vs_ort_exact']}x", f"{x['ours_vs_ort_default']}x",
                      f"{x['ours_gmacs']} / {x['ort_exact_gmacs']} / {x['ort_default_gmacs']}",
                      f"{x['ours_exact_share']:.0%} / {x['ort_exact_exact_share']:.0%} / "
                      f"{x['ort_default_exact_share']:.0%}"] for x in r["rows"]])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
