#!/usr/bin/env python3
"""All-in-one GPU benchmark of 2:4 sparse INT8 (cuSPARSELt through PyTorch) for HoloServe.

One run on an H100/H200 (< 10 minutes) writes to --out:
  results.json  everything measured, with the GPU, driver, torch / CUDA / cuSPARSELt versions
  latest.json   the encoder timings as flat rows (model, engine, kind dense/ours/peer-2:4, batch, seq,
                median ms, ratio to the best dense peer): every ratio can be recomputed from it
  results.md    the tables (per-GEMM, whole encoder, parity, targets) and the TensorRT check
  gemm.png      2:4 speed-ups per GEMM shape over M
  encoder.png   whole-encoder throughput per variant over batch size

Sections
  env      GPU, driver, versions; `python3 -c "import tensorrt"` and `ldconfig -p | grep nvinfer`
  peak     measured dense peaks: FP16 cuBLAS and INT8 torch._int_mm at 8192^3
  gemm     K, N in {384, 768, 1536, 3072}, M = tokens 128..16384: dense FP16 (cuBLAS), dense INT8
           (torch._int_mm), 2:4 FP16 and 2:4 INT8 (torch._cslt_sparse_mm); TFLOP/s / TOPS counted
           as dense-equivalent 2*M*N*K, against the measured dense peak of the same precision
  encoder  MiniLM (the carried real checkpoint) and a BERT-base-shaped model with RANDOM weights:
           FP16 eager (transformers), FP16 + CUDA graphs, dense INT8 + graphs, ours (2:4 INT8 eager
           and + graphs), torchao int8_dynamic_activation_int8_semi_sparse_weight (eager, + graphs),
           the torch-cuda backend end to end (host arrays in, logits out), and two compiled dense peers
           (bench/gpu/peers.py): FP16 transformers (SDPA) and dense INT8 (_int_mm) through torch.compile
           (--compile-mode, default max-autotune); batch 1/8/32/128, seq 128. Each variant is also
           given against the best dense peer at its batch (the fastest dense variant)
  parity   ours vs the checkpoint's fake-quant model (fp32) on the carried dev split: logit
           differences, argmax agreement, accuracy

Method: CUDA events around each call, warm-up calls first, medians over timed calls, fresh random
inputs every call (token ids drawn away from special tokens; GEMM operands random and non-zero).
Every measurement is guarded: a failure is recorded with its message and the run goes on, and the
JSON is rewritten after each section, so a run cut short still leaves its results.

`--cpu-smoke` runs the same pipeline on tiny shapes on the CPU with no CUDA call at all (reference
INT8 math instead of the GPU kernels; the compiled peers through Inductor's C++ backend, on the
BERT-base stand-in only), to test the argument handling and the report writers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from bench import dated_results
from bench.gpu import peers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

KN_DEFAULT = [384, 768, 1536, 3072]
M_DEFAULT = [128, 512, 1024, 2048, 4096, 8192, 16384]
BATCHES_DEFAULT = [1, 8, 32, 128]
ENCODER_MODELS = ("checkpoint", "bert-base")
GEMM_KERNELS = ("dense_fp16", "dense_int8", "sparse_fp16", "sparse_int8")
KERNEL_TITLES = {
    "dense_fp16": "dense FP16 (cuBLAS)", "dense_int8": "dense INT8 (_int_mm)",
    "sparse_fp16": "2:4 FP16 (cuSPARSELt)", "sparse_int8": "2:4 INT8 (cuSPARSELt, dequant epilogue)",
    "sparse_int8_search": "2:4 INT8, cuSPARSELt alg search",
    "dense_fp32_cpu": "dense FP32 (CPU)", "int8_reference_cpu": "INT8 reference (CPU)",
}


class Stopped(BaseException):
    """Raised by the SIGTERM handler; not an Exception, so the per-measurement guards let it through."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.run", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(dated_results("gpu")),
                    help="output folder (default $OUT, else bench/results/<today>-gpu)")
    ap.add_argument("--carry", default=str(ROOT / ".carry"), help="folder written by prepare.py (default .carry)")
    ap.add_argument("--sections", default="env,peak,gemm,encoder,parity",
                    help="comma-separated subset of env,peak,gemm,encoder,parity,profile (profile: where "
                         "the encoder's time goes, per kernel category; not in the default set)")
    ap.add_argument("--kn", default=",".join(map(str, KN_DEFAULT)), help="GEMM K and N values")
    ap.add_argument("--m", default=",".join(map(str, M_DEFAULT)), help="GEMM M values (tokens)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES_DEFAULT)), help="encoder batch sizes")
    ap.add_argument("--seq", type=int, default=128, help="encoder sequence length")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--gemm-inner", type=int, default=8, help="distinct input buffers per GEMM timing (graph of N calls)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip remaining work after this many seconds")
    ap.add_argument("--no-torchao", action="store_true", help="leave out the torchao variants")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peers")
    ap.add_argument("--compile-mode", choices=peers.COMPILE_MODES, default=peers.DEFAULT_COMPILE_MODE,
                    help=f"torch.compile mode of the compiled peers (default {peers.DEFAULT_COMPILE_MODE}; "
                         "cpu-smoke: default)")
    ap.add_argument("--models", default=",".join(ENCODER_MODELS),
                    help="encoder models: checkpoint (the carried one, MiniLM), bert-base (random weights)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, no CUDA calls (tests the pipeline)")
    args = ap.parse_args(argv)
    args.kn_list = [int(x) for x in args.kn.split(",") if x]
    args.m_list = [int(x) for x in args.m.split(",") if x]
    args.batch_list = [int(x) for x in args.batches.split(",") if x]
    args.section_list = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    if set(args.model_list) - set(ENCODER_MODELS):
        ap.error(f"unknown models: {', '.join(sorted(set(args.model_list) - set(ENCODER_MODELS)))}")
    bad = set(args.section_list) - (set(SECTIONS) - {"encoder_3p"})  # encoder_3p follows encoder on its own
    if bad:
        ap.error(f"unknown sections: {', '.join(sorted(bad))}")
    if args.cpu_smoke:
        if args.kn == ",".join(map(str, KN_DEFAULT)):
            args.kn_list = [32, 64]
        if args.m == ",".join(map(str, M_DEFAULT)):
            args.m_list = [16, 32]
        if args.batches == ",".join(map(str, BATCHES_DEFAULT)):
            args.batch_list = [1, 2]
        args.seq = min(args.seq, 16)
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 3)
        args.gemm_inner = min(args.gemm_inner, 2)
        if args.compile_mode == peers.DEFAULT_COMPILE_MODE:  # autotuning and CUDA graphs are GPU features
            args.compile_mode = "default"
    return args


class Run:
    """Shared state: mode, clock, output, and the report being built."""

    def __init__(self, args):
        self.args = args
        self.smoke = args.cpu_smoke
        self.t0 = time.perf_counter()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.report: dict[str, Any] = {
            "kind": "holoserve-gpu-bench",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "mode": "cpu-smoke" if self.smoke else "gpu",
            "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
            "method": {
                "timer": "perf_counter (cpu-smoke)" if self.smoke else "CUDA events around each call",
                "warmup": args.warmup, "iters": args.iters, "statistic": "median",
                "inputs": "fresh random inputs every call; token ids in [1000, vocab); GEMM operands random, non-zero",
                "ops_convention": "2*M*N*K dense-equivalent operations for dense and 2:4 kernels alike",
            },
            "sections": {},
        }
        self.device = "cpu" if self.smoke else "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.args.budget_s

    def save(self) -> None:
        self.report["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.out / ".results.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "results.json")


# --------------------------------------------------------------------------- timing


def measure(run: Run, fn: Callable[[int], Any], *, warmup: int | None = None, iters: int | None = None,
            per_call: int = 1, host_timer: bool = False) -> dict[str, Any]:
    """Median time of fn(i) (i = call index, for picking fresh inputs); per_call divides the result."""
    warmup = run.args.warmup if warmup is None else warmup
    iters = run.args.iters if iters is None else iters
    for i in range(warmup):
        fn(i)
    times: list[float] = []
    if run.smoke or host_timer:
        if not run.smoke:
            import torch

            torch.cuda.synchronize()
        for i in range(iters):
            t = time.perf_counter()
            fn(warmup + i)
            if not run.smoke:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    else:
        import torch

        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        torch.cuda.synchronize()
        for i, (s, e) in enumerate(events):
            s.record()
            fn(warmup + i)
            e.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in events]
    times = [t / per_call for t in times]
    q = sorted(times)
    return {"median_ms": statistics.median(times), "p10_ms": q[len(q) // 10], "p90_ms": q[min(len(q) - 1, (9 * len(q)) // 10)],
            "n": len(times)}


def only_failure(sec: dict[str, Any]) -> bool:
    """A section result that holds nothing but its failure (as guarded() returns it, timed or not)."""
    return "error" in sec and set(sec) <= {"error", "trace", "seconds"}


def guarded(label: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - every measurement is optional; record why it failed
        log(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "trace": traceback.format_exc(limit=3)[-1500:]}


def graph_of(fn: Callable[[], Any]):
    """Capture fn() (a fixed sequence of GPU work) in a CUDA graph after warm-up; returns replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


# --------------------------------------------------------------------------- env


def sh(cmd: str, timeout: float = 30) -> dict[str, Any]:
    try:
        p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
        return {"cmd": cmd, "rc": p.returncode, "out": (p.stdout + p.stderr).strip()[-2000:]}
    except (OSError, subprocess.SubprocessError) as e:
        return {"cmd": cmd, "rc": None, "out": str(e)}


def section_env(run: Run) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "cpu": f"{os.cpu_count()}-core {platform.machine()} CPU",
                           "platform": platform.platform()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
    except ImportError as e:
        env["torch"] = f"missing: {e}"
    for mod in ("transformers", "torchao", "triton", "onnxruntime", "safetensors", "tokenizers"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            env[mod] = f"missing: {type(e).__name__}: {str(e)[:120]}"
    # TensorRT: the export path needs it; record whether it is here after all
    env["tensorrt_import"] = sh(f'{sys.executable} -c "import tensorrt; print(tensorrt.__version__)"')
    env["nvinfer_libs"] = sh("ldconfig -p | grep nvinfer")
    env["trtexec"] = shutil.which("trtexec")
    env["tensorrt_present"] = env["tensorrt_import"]["rc"] == 0 or bool(env["nvinfer_libs"]["out"])
    if run.smoke:
        env["gpu"] = None
        env["note"] = "cpu-smoke: no CUDA calls"
        env["machine"] = env["cpu"]
        return env
    import torch

    from holoserve.backends.torch_cuda import cuda_report

    env.update({f"cuda_{k}" if k in ("torch",) else k: v for k, v in cuda_report().items() if k != "torch"})
    env["cudnn"] = torch.backends.cudnn.version()
    env["nvidia_smi"] = sh("nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,"
                           "power.limit,pstate --format=csv")
    env["nvidia_smi_version"] = sh("nvidia-smi | head -4")
    q = sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    env["driver"] = q["out"].splitlines()[0] if q["rc"] == 0 and q["out"] else None
    env["machine"] = f"{env.get('gpu')} + {env['cpu']}"
    if env["tensorrt_present"]:
        env["tensorrt_engine"] = ("TensorRT found: build and time the engine with `holoserve build-engine` on the "
                                  "checkpoint's model.trt.onnx, with and without sparsity (not run by this script)")
    return env


# --------------------------------------------------------------------------- peak + GEMM


def _rand_nonzero_int8(shape, device, gen=None):
    import torch

    x = torch.randint(1, 128, shape, device=device, dtype=torch.int16, generator=gen)
    sign = torch.randint(0, 2, shape, device=device, dtype=torch.int16, generator=gen) * 2 - 1
    return (x * sign).clamp_(-128, 127).to(torch.int8)


def _prune_24(w):
    """Keep the 2 largest |w| of every 4 along the input dimension (same rule as compress.project)."""
    from holoserve.compress.project import nm_mask

    return w * nm_mask(w.float(), 2, 4).to(w.dtype)


def section_peak(run: Run) -> dict[str, Any]:
    import torch

    if run.smoke:
        n = 64
        a, b = torch.randn(n, n), torch.randn(n, n)
        t = measure(run, lambda i: a @ b)
        return {"size": n, "fp32_cpu_tflops": 2 * n**3 / (t["median_ms"] * 1e-3) / 1e12}
    n = 8192
    a16 = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b16 = torch.randn(n, n, device="cuda", dtype=torch.float16)
    a8 = _rand_nonzero_int8((n, n), "cuda")
    b8 = _rand_nonzero_int8((n, n), "cuda").t()  # column-major B: the layout cuBLASLt's INT8 kernels take
    b8_rows = b8.contiguous()  # row-major B, for comparison
    out: dict[str, Any] = {"size": n}
    r = guarded("peak fp16", lambda: measure(run, lambda i: a16 @ b16, warmup=5, iters=20))
    out["fp16"] = r
    if "median_ms" in r:
        out["fp16_tflops"] = 2 * n**3 / (r["median_ms"] * 1e-3) / 1e12
    for key, b in (("int8", b8), ("int8_row_major_b", b8_rows)):
        r = guarded(f"peak {key}", lambda b=b: measure(run, lambda i: torch._int_mm(a8, b), warmup=5, iters=20))
        out[key] = r
        if "median_ms" in r:
            out[f"{key}_tops"] = 2 * n**3 / (r["median_ms"] * 1e-3) / 1e12
    a16 = b16 = a8 = b8 = b8_rows = None  # free the GPU memory before the next section
    torch.cuda.empty_cache()
    log(f"peak: fp16 {out.get('fp16_tflops', float('nan')):.0f} TFLOP/s, int8 {out.get('int8_tops', float('nan')):.0f} TOPS "
        f"(row-major B: {out.get('int8_row_major_b_tops', float('nan')):.0f})")
    return out


MODEL_SHAPES = [(768, 768), (768, 3072), (3072, 768), (384, 384), (384, 1536), (1536, 384)]  # (K, N) of BERT-base, MiniLM


def _shape_rank(kn: tuple[int, int]) -> int:
    """Sort key for GEMM shapes: the model Linears' (K, N) in MODEL_SHAPES order, then the rest."""
    return MODEL_SHAPES.index(kn) if kn in MODEL_SHAPES else len(MODEL_SHAPES)


def section_gemm(run: Run) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from holoserve.backends import torch_cuda as tc

    args = run.args
    inner = max(1, args.gemm_inner)
    rows: list[dict[str, Any]] = []
    res: dict[str, Any] = {"rows": rows, "inner_calls": inner}
    epilogue = None
    if not run.smoke:
        try:
            epilogue, tried = tc.choose_epilogue("cuda")
            res["epilogue"] = epilogue.name
            res["epilogue_probe"] = tried
        except Exception as e:  # noqa: BLE001 - measure the rest; say why 2:4 INT8 is missing
            res["epilogue_error"] = str(e)[:1000]
            log(f"no working 2:4 INT8 epilogue: {e}")
    gen = torch.Generator(device=run.device).manual_seed(0)
    # the Linear shapes of BERT-base and MiniLM first, so a run cut short by the budget keeps them
    pairs = [(k, n) for k in args.kn_list for n in args.kn_list]
    pairs.sort(key=_shape_rank)
    for K, N in pairs:
        if run.over_budget():
            res["truncated"] = f"time budget reached at K={K}, N={N}"
            return res
        w = torch.randn(N, K, device=run.device, generator=gen) * 0.05
        w24 = _prune_24(w)
        scales = w24.abs().amax(1).float() / 127
        codes = tc.weight_codes(w24, scales).to(w24.device)  # computed on the CPU by contract
        alpha = (scales * 0.01).float().contiguous()
        kern: dict[str, Any] = {}
        if run.smoke:
            kern["dense_fp32_cpu"] = ("fp32", lambda x, w=w: F.linear(x, w))
            kern["int8_reference_cpu"] = ("int8", lambda x, c=codes, s=scales: tc.int8_linear_reference(
                x, c, s, torch.tensor(0.01)))
        else:
            w16 = w.half().contiguous()
            w8t = _rand_nonzero_int8((N, K), "cuda", gen).t()  # column-major [K, N], as the backend holds it
            p16 = torch._cslt_compress(w24.half().contiguous())
            p8 = torch._cslt_compress(codes.contiguous())
            kern["dense_fp16"] = ("fp16", lambda x, w16=w16: F.linear(x, w16))
            kern["dense_int8"] = ("int8", lambda x, w8t=w8t: torch._int_mm(x, w8t))
            kern["sparse_fp16"] = ("fp16", lambda x, p=p16: torch._cslt_sparse_mm(p, x.t(), transpose_result=True))
            if epilogue is None:
                pass
            elif epilogue.alpha:
                kern["sparse_int8"] = ("int8", lambda x, p=p8, a=alpha, e=epilogue: torch._cslt_sparse_mm(
                    p, x.t(), alpha=a, out_dtype=torch.float16, transpose_result=e.transpose))
            else:
                kern["sparse_int8"] = ("int8", lambda x, p=p8, e=epilogue: torch._cslt_sparse_mm(
                    p, x.t(), out_dtype=torch.int32, transpose_result=e.transpose))
        if not run.smoke:  # cuSPARSELt called directly, epilogue fused (built guarded: nvmath-python may be missing)
            res.setdefault("fused_build", {})[f"K={K} N={N}"] = guarded(
                f"cslt_fused build K={K} N={N}", lambda: _fused_kernels(kern, codes, scales * 0.01))
        for M in args.m_list:
            row: dict[str, Any] = {"K": K, "N": N, "M": M}
            xs = {
                "fp16": None if run.smoke else [torch.randn(M, K, device="cuda", generator=gen).half() for _ in range(inner)],
                "int8": None if run.smoke else [_rand_nonzero_int8((M, K), "cuda", gen) for _ in range(inner)],
                "fp32": [torch.randn(M, K, generator=gen) for _ in range(inner)] if run.smoke else None,
            }
            if run.smoke:
                xs["int8"] = xs["fp32"]  # the reference quantizes float input itself
            for name, (kind, op) in kern.items():
                row[name] = guarded(f"gemm {name} K={K} N={N} M={M}",
                                    lambda op=op, kind=kind: _time_gemm(run, op, xs[kind], inner, M, N, K))
            if "sparse_int8" in kern and epilogue is not None and epilogue.alpha and not run.smoke:
                # cuSPARSELt's own algorithm search for this shape (alg 0 is what the backend uses)
                row["sparse_int8_search"] = guarded(f"alg search K={K} N={N} M={M}", lambda: _searched(
                    run, p8, alpha, epilogue, xs["int8"], inner, M, N, K))
            if not run.smoke and not any(r["K"] == K and r["M"] == M and "quantize" in r for r in rows):
                row["quantize"] = _time_quantizers(run, xs["fp16"], inner, M, K)
            _gemm_ratios(row)
            rows.append(row)
            log(f"gemm K={K:5d} N={N:5d} M={M:6d}: " + ", ".join(
                f"{n} {row[n]['tflops']:.3g}" for n in kern if "tflops" in row.get(n, {}))
                + (f" | 2:4 INT8 / dense INT8 = {row['sparse_int8_over_dense_int8']:.2f}x"
                   if row.get("sparse_int8_over_dense_int8") else ""))
        kern = None  # free the GPU memory before the next shape
        if not run.smoke:
            torch.cuda.empty_cache()
        run.save()
    return res


def _fused_kernels(kern: dict[str, Any], codes, alpha) -> dict[str, Any]:
    """Add the directly called cuSPARSELt GEMMs to kern: FP16 out with alpha + bias in the epilogue (as `cslt`),
    and INT8 out with GELU and the next quantizer (the FFN's first GEMM of kernel `cslt_fused`)."""
    import torch

    from holoserve.backends.torch_cuda import cslt_epilogue as ce

    bias = torch.randn(codes.shape[0], device="cuda") * 0.1
    fp16 = ce.FusedGemm(codes.cuda(), alpha.cuda(), bias, ce.spec_for("attn_out"))
    gelu = ce.FusedGemm(codes.cuda(), alpha.cuda(), bias, ce.spec_for("ffn_in", next_scale=0.02))
    kern["sparse_int8_fused_fp16"] = ("int8", fp16)
    kern["sparse_int8_fused_gelu_int8"] = ("int8", gelu)
    return {"ok": True}


def _time_gemm(run: Run, op, xs, inner: int, M: int, N: int, K: int) -> dict[str, Any]:
    if run.smoke:
        r = measure(run, lambda i: op(xs[i % inner]))
    else:
        def body():
            for x in xs:
                op(x)

        try:
            graph, _ = graph_of(body)
            r = measure(run, lambda i: graph.replay(), per_call=inner, warmup=3, iters=max(10, run.args.iters // 3))
            r["graph"] = True
        except Exception as e:  # noqa: BLE001 - fall back to eager timing, and say so
            r = measure(run, lambda i: op(xs[i % inner]))
            r["graph"] = False
            r["graph_error"] = str(e)[:200]
    r["tflops"] = 2 * M * N * K / (r["median_ms"] * 1e-3) / 1e12
    return r


def _searched(run: Run, packed, alpha, epilogue, xs, inner: int, M: int, N: int, K: int) -> dict[str, Any]:
    import torch

    alg = int(torch._cslt_sparse_mm_search(packed, xs[0].t(), alpha=alpha, out_dtype=torch.float16,
                                           transpose_result=epilogue.transpose))
    r = _time_gemm(run, lambda x: torch._cslt_sparse_mm(packed, x.t(), alpha=alpha, out_dtype=torch.float16,
                                                         transpose_result=epilogue.transpose, alg_id=alg),
                   xs, inner, M, N, K)
    r["alg_id"] = alg
    return r


def _time_quantizers(run: Run, xs, inner: int, M: int, K: int) -> dict[str, Any]:
    """The activation quantizer alone (FP16 [M, K] -> int8 codes): torch ops vs the fused kernel."""
    import torch

    from holoserve.backends import torch_cuda as tc

    scale = torch.tensor(0.02, device="cuda")
    out: dict[str, Any] = {}
    for name, fn in (("torch_ops", lambda x: tc.quantize_activation(x, scale)),
                     ("triton", lambda x: tc.quantize_activation_triton(x, scale))):
        r = guarded(f"quantize {name} M={M} K={K}", lambda fn=fn: _time_gemm(run, fn, xs, inner, M, 1, K))
        if "median_ms" in r:
            r["gb_per_s_min_traffic"] = 3 * M * K / (r["median_ms"] * 1e-3) / 1e9  # 2 bytes in, 1 out
            r.pop("tflops", None)
        out[name] = r
    return out


def _gemm_ratios(row: dict[str, Any]) -> None:
    def t(name):
        return row.get(name, {}).get("median_ms")

    for a, b in (("sparse_int8", "dense_int8"), ("sparse_int8_search", "dense_int8"), ("sparse_fp16", "dense_fp16"), ("sparse_int8", "dense_fp16"),
                 ("dense_int8", "dense_fp16"), ("int8_reference_cpu", "dense_fp32_cpu")):
        if t(a) and t(b):
            row[f"{a}_over_{b}"] = t(b) / t(a)


# --------------------------------------------------------------------------- encoder models


def _load_carried_checkpoint(run: Run):
    """The carried checkpoint unpacked into a temp folder (cpu-smoke: a tiny one built here)."""
    from bench.gpu import carry
    from holoserve.core.artifact import load_artifact

    tmp = Path(tempfile.mkdtemp(prefix="holoserve-gpu-bench-"))
    if run.smoke:
        packed = tmp / "packed"
        carry.pack(_tiny_checkpoint(tmp), packed)
    else:
        packed = Path(run.args.carry) / "checkpoint"
        if not (packed / carry.WEIGHTS).is_file():
            raise FileNotFoundError(f"{packed} has no packed checkpoint: run python -m bench.gpu.prepare CHECKPOINT first "
                                    "and carry .carry")
    art = carry.unpack(packed, tmp / "ckpt")
    return load_artifact(art.path), packed


def _tiny_checkpoint(tmp: Path) -> Path:
    """cpu-smoke: a tiny BERT projected to 2:4 INT8, calibrated and saved like a real checkpoint."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from holoserve.compress.checkpoint import CheckpointContents, save_checkpoint
    from holoserve.compress.layers import encoder_linear_names
    from holoserve.compress.sparsify import project_layers
    from holoserve.compress.quant import calibrate_amax
    from holoserve.data.tasks import get_task
    from tests.helpers.tiny import make_tiny_bert

    src = make_tiny_bert(tmp / "base", hidden=64, layers=2, heads=2, intermediate=128)
    model = AutoModelForSequenceClassification.from_pretrained(str(src)).eval()
    layers = encoder_linear_names(model)
    scales = project_layers(model, layers)
    vocab = model.config.vocab_size
    batches = [_token_batch(torch, 4, 16, vocab, "cpu", seed=s) for s in range(2)]
    amax = calibrate_amax(model, layers, batches)
    save_checkpoint(model, src, tmp / "tiny", CheckpointContents(
        task=get_task("sst2"), base_model="tiny-random-bert", max_seq_length=64, sparse_layers=layers,
        weight_scales=scales, act_amax=amax))
    return tmp / "tiny"


def _token_batch(torch, b: int, n: int, vocab: int, device, seed: int | None = None, gen=None):
    if gen is None:
        gen = torch.Generator(device=device).manual_seed(seed or 0)
    lo = min(1000, max(5, vocab // 2))
    ids = torch.randint(lo, vocab, (b, n), device=device, generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}


def _bert_base_random(run: Run):
    """BERT-base shapes (12 x 768, FFN 3072) with random weights: dense state, and a 2:4 INT8 version.
    Built (and calibrated) once per run: the encoder and profile sections share it."""
    if getattr(run, "bert_base", None) is None:
        run.bert_base = _build_bert_base_random(run)
    return run.bert_base


def _build_bert_base_random(run: Run):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from holoserve.compress.layers import encoder_linear_names
    from holoserve.compress.sparsify import project_layers
    from holoserve.compress.quant import calibrate_amax

    if run.smoke:
        cfg = BertConfig(vocab_size=2000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=128, max_position_embeddings=128, num_labels=2)
    else:
        cfg = BertConfig(num_labels=2)  # bert-base-uncased shapes
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg).eval()
    dense_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layers = encoder_linear_names(model)
    scales = project_layers(model, layers)
    model.to(run.device)
    batches = [_token_batch(torch, 8, run.args.seq, cfg.vocab_size, run.device, seed=s) for s in range(4)]
    amax = calibrate_amax(model, layers, batches)
    sparse_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    del model
    return cfg.to_dict(), dense_state, sparse_state, {"scales": scales, "amax": amax, "layers": layers}


def _hf_model(config: dict, state: dict, dtype, device):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(**{k: v for k, v in config.items() if k not in ("architectures", "transformers_version")})
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 - older/newer transformers choose their own default
        pass
    with torch.device(device):  # random init on the device is quick; every weight is overwritten below
        model = BertForSequenceClassification(cfg)
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"state dict does not fit BertForSequenceClassification: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return model.to(device=device, dtype=dtype).eval()


def plain_division(build):
    """The same encoder with the quantizer kernels dividing by the scale plainly (IEEE division, as
    before the FMA division): an A/B of that change in one run. Graph capture records the kernels as
    launched, so the switch only needs to hold while the encoder runs."""
    from holoserve.backends.torch_cuda import kernels

    def wrapped():
        call = build()

        def run_plain(inp):
            kernels.FMA_DIVISION = False
            try:
                return call(inp)
            finally:
                kernels.FMA_DIVISION = True
        return run_plain
    return wrapped


def _encoder_variants(run: Run, config: dict, dense_state: dict, sparse_state: dict, quant: dict,
                      compile_peers: bool = True):
    """(name, builder, graphs, risky) tuples; each builder returns call(inputs) -> logits. compile_peers=False
    lists the torch.compile peers as skipped."""
    import torch

    from holoserve.backends import torch_cuda as tc

    dt = torch.float32 if run.smoke else torch.float16
    dev = run.device
    epilogue = epilogue32 = None
    quantizer = "torch"
    gelu_fused = ln_fused = False
    if not run.smoke:
        try:
            epilogue = tc.choose_epilogue("cuda")[0]
        except Exception as e:  # noqa: BLE001 - the 2:4 variants then fail one by one, with this reason
            log(f"no working 2:4 INT8 epilogue: {e}")
        try:
            epilogue32 = tc.choose_epilogue("cuda", torch.float32)[0]
        except Exception as e:  # noqa: BLE001
            log(f"no working INT32-output epilogue for precision=fp32: {e}")
        quantizer, qprobe = tc.choose_quantizer("cuda")
        gelu_fused = bool(qprobe.get("gelu_fused"))
        ln_fused = bool(qprobe.get("ln_fused"))
        log(f"quantizer: {qprobe}")

    def hf_dense():
        m = _hf_model(config, dense_state, dt, dev)
        return lambda inp: m(**inp).logits

    def hf_int8_dense():  # the 2:4 model's weights in dense INT8, with our activation scales
        return peers.int8_dense(_hf_model(config, sparse_state, dt, dev), quant["layers"], quant["amax"])

    def ours(kernel, state, sparse=True, quantizer=quantizer, alg_search=False, fuse=True, dtype=None,
             tables=False):
        def build(dt=dtype or dt):
            dense = kernel == "dense"  # the FP16 baseline keeps the state's own (dense) weights
            cq = tc.CheckpointQuant(weight_scales=None if dense else quant["scales"],
                                    act_amax=None if dense else quant["amax"],
                                    sparse_layers=quant["layers"] if sparse else ())
            tuning = tc.Tuning(epilogue=epilogue32 if dt == torch.float32 and not run.smoke else epilogue,
                               quantizer=quantizer, alg_search=alg_search)
            enc = tc.build_encoder(config, state, cq,
                                   linear=tc.LinearOptions(kernel=kernel, dtype=dt, device=dev, tuning=tuning),
                                   fusion=tc.Fusion(gelu_quant=gelu_fused and fuse, ln_quant=ln_fused and fuse))
            if tables:
                enc.use_code_tables()
            return lambda inp: enc(**inp)
        return build

    def torchao_semi_sparse():
        from torchao.quantization import quantize_
        from torchao.sparsity import int8_dynamic_activation_int8_semi_sparse_weight

        m = _hf_model(config, sparse_state, dt, dev)
        layers = set(quant["layers"])
        quantize_(m, int8_dynamic_activation_int8_semi_sparse_weight(),
                  filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and fqn in layers)
        return lambda inp: m(**inp).logits

    # risky=True: capturing third-party code whose forward may synchronize with the host; a failed
    # capture can leave the CUDA context unusable, so these run after everything else.
    prefix = "FP32" if run.smoke else "FP16"
    v: list[tuple[str, Callable, bool, bool]] = [
        (f"{prefix} eager (transformers)", hf_dense, False, False),
        (f"{prefix} + CUDA graphs (holoserve encoder)", ours("dense", dense_state), True, False),
    ]
    if run.smoke:
        v += [("INT8 reference (ours, CPU)", ours("reference", sparse_state), False, False),
              ("INT8 fake-quant (ours, CPU)", ours("fakequant", sparse_state), False, False)]
    else:
        v += [("dense INT8 + CUDA graphs (_int_mm)", ours("cslt", sparse_state, sparse=False), True, False),
              ("2:4 INT8 eager (ours)", ours("cslt", sparse_state), False, False),
              ("2:4 INT8 + CUDA graphs (ours)", ours("cslt", sparse_state), True, False)]
        # cuSPARSELt called directly (nvmath-python): the FFN's first GEMM writes the second's codes (GELU and
        # quantizer in its epilogue), the other GEMMs as `cslt`
        v += [(f"2:4 INT8{mode} (ours, cslt_fused epilogues)", ours("cslt_fused", sparse_state), graphs, False)
              for mode, graphs in ((" eager", False), (" + CUDA graphs", True))]
        v.append(("2:4 INT8 + CUDA graphs (ours, cuSPARSELt alg search)",
                  ours("cslt", sparse_state, alg_search=True), True, False))
        v.append(("2:4 INT8 + CUDA graphs (ours, precision=fp32: INT32 GEMM out, FP32 elsewhere)",
                  ours("cslt", sparse_state, fuse=False, dtype=torch.float32), True, False))
        if gelu_fused or ln_fused:  # evidence for what the LayerNorm / GELU fusions buy
            v.append(("2:4 INT8 + CUDA graphs (ours, no LayerNorm/GELU fusion)",
                      ours("cslt", sparse_state, fuse=False), True, False))
        if quantizer == "triton":  # the FMA division in the quantizer kernels, A/B
            v.append(("2:4 INT8 + CUDA graphs (ours, plain division in the quantizers)",
                      plain_division(ours("cslt", sparse_state)), True, False))
            # the FFN activation + quantize as one gather from a table of every FP16 value's code, A/B with
            # the erf kernel (eager too, so that the profile section times its kernel)
            v += [(f"2:4 INT8{mode} (ours, FFN activation by code table)", ours("cslt", sparse_state, tables=True),
                   graphs, False) for mode, graphs in ((" eager", False), (" + CUDA graphs", True))]
        if quantizer != "torch":  # evidence for what the fused quantizer buys
            v.append(("2:4 INT8 + CUDA graphs (ours, unfused torch-op quantizer)",
                      ours("cslt", sparse_state, quantizer="torch"), True, False))
        if not run.args.no_torchao:
            v += [("torchao 2:4 INT8 eager", torchao_semi_sparse, False, False),
                  ("torchao 2:4 INT8 + CUDA graphs", torchao_semi_sparse, True, True)]
    v.append((f"{prefix} + CUDA graphs (transformers)", hf_dense, True, True))
    if not run.args.no_compile:  # Inductor's CUDA-graph trees: third-party captures, after our own
        mode = run.args.compile_mode
        skip = None if compile_peers else "cpu-smoke: compiled on the BERT-base stand-in only, to save time"
        v += [(f"{prefix} torch.compile {mode} (transformers, SDPA)",
               peers.compiled(lambda: _hf_model(config, dense_state, dt, dev), mode, skip), False, True),
              (f"dense INT8 torch.compile {mode} (transformers, _int_mm, per-channel weights)",
               peers.compiled(hf_int8_dense, mode, skip), False, True)]
    return v


def _bench_variant(run: Run, build, graphs: bool, vocab: int) -> dict[str, Any]:
    import torch

    if graphs and run.smoke:
        return {"skipped": "cpu-smoke: CUDA graphs need a GPU"}
    if getattr(build, "skipped", None):
        return {"skipped": build.skipped}
    call = build()
    compile_mode = getattr(call, "compile_mode", None)
    sync = (lambda: None) if run.smoke else torch.cuda.synchronize
    out: dict[str, Any] = {"compile_mode": compile_mode} if compile_mode else {}
    pool_n = 4
    for b in run.args.batch_list:
        if run.over_budget():
            out[str(b)] = {"error": "skipped: time budget reached"}
            continue

        def one(b=b):
            gen = torch.Generator(device=run.device).manual_seed(1000 + b)
            pool = [_token_batch(torch, b, run.args.seq, vocab, run.device, gen=gen) for _ in range(pool_n)]
            if graphs:
                static = {k: v.clone() for k, v in pool[0].items()}
                graph, _ = graph_of(lambda: call(static))

                def fn(i):
                    for k, v in pool[i % pool_n].items():
                        static[k].copy_(v)
                    graph.replay()
            else:
                def fn(i):
                    with torch.inference_mode():
                        call(pool[i % pool_n])
            first = peers.first_calls(fn, sync) if compile_mode else {}  # compiling, apart from the timed calls
            before = peers.dynamo_counts()
            r = measure(run, fn)
            r["seq_per_s"] = b / (r["median_ms"] * 1e-3)
            if compile_mode:
                r.update(first, recompiled_while_timed=peers.dynamo_counts()["graphs"] - before["graphs"])
                log(f"    batch {b}: compiled in {first['compile_s']:.1f} s, {first['graphs']} graphs, "
                    f"{first['graph_breaks']} graph breaks, {first['cudagraph_skips']} CUDA-graph skips")
            return r

        out[str(b)] = guarded(f"batch {b}", one)
    call = None  # free the model before the next section
    if compile_mode:
        peers.reset()
    if not run.smoke:
        torch.cuda.empty_cache()
    return out


def _bench_backend_end_to_end(run: Run, art, vocab: int) -> dict[str, Any]:
    """The torch-cuda backend as the server calls it: numpy in, numpy logits out (host timer)."""
    import numpy as np

    from holoserve.backends import load_backend

    backend = load_backend("torch-cuda", art, max_batch=max(run.args.batch_list))
    rng = np.random.default_rng(0)
    seq = min(run.args.seq, art.max_seq_length)  # the backend serves up to the checkpoint's max_seq_length
    out: dict[str, Any] = {"info": backend.info(), "seq": seq}
    lo = min(1000, vocab // 2)
    for b in run.args.batch_list:
        pool = [rng.integers(lo, vocab, size=(b, seq), dtype=np.int64) for _ in range(4)]

        def fn(i, pool=pool):
            ids = pool[i % len(pool)]
            backend.infer(ids, np.ones_like(ids), np.zeros_like(ids))

        r = guarded(f"backend batch {b}", lambda fn=fn: measure(run, fn, host_timer=True))
        if "median_ms" in r:
            r["seq_per_s"] = b / (r["median_ms"] * 1e-3)
        out[str(b)] = r
    out["info"] = backend.info()
    return out


def section_encoder(run: Run) -> dict[str, Any]:
    res: dict[str, Any] = {"seq": run.args.seq, "batches": run.args.batch_list, "models": {}}
    models = []
    # 1) the carried real checkpoint (MiniLM SST-2)
    if "checkpoint" in run.args.model_list:
        try:
            art, packed = _load_carried_checkpoint(run)
            from holoserve.backends.torch_cuda import checkpoint_tensors

            config, state = checkpoint_tensors(art)
            quant = {"scales": art.all_weight_scales(), "amax": art.activation_amax(), "layers": art.sparse_layers}
            label = f"{art.base_model} · {art.task_name} checkpoint (carried, " + (
                "tiny random stand-in)" if run.smoke else "real weights)")
            models.append((label, config, state, state, quant, art))
        except Exception as e:  # noqa: BLE001
            log(f"carried checkpoint unavailable: {e}")
            res["models"]["checkpoint"] = {"error": str(e)}
    # 2) BERT-base shapes, random weights
    if "bert-base" in run.args.model_list:
        try:
            cfg, dense, sparse, quant_b = _bert_base_random(run)
            models.append(("BERT-base shapes (RANDOM weights, 2:4-projected for the sparse variants)", cfg, dense,
                           sparse, quant_b, None))
        except Exception as e:  # noqa: BLE001
            log(f"BERT-base model failed: {e}")
            res["models"]["bert-base"] = {"error": str(e)}
    plan = []
    for label, config, dense_state, sparse_state, quant, art in models:
        entry: dict[str, Any] = {"config": {k: config.get(k) for k in ("hidden_size", "num_hidden_layers",
                                                                       "intermediate_size", "num_attention_heads")},
                                 "variants": {}}
        res["models"][label] = entry
        # cpu-smoke compiles (Inductor, C++) for one model only: the second would add as much again
        variants = _encoder_variants(run, config, dense_state, sparse_state, quant,
                                     compile_peers=not run.smoke or art is None)
        plan.append((label, entry, int(config["vocab_size"]), art, variants))
    run.encoder_plan = plan
    _encoder_pass(run, plan, risky_pass=False)
    return res


# Kernel (GPU) or operator (CPU smoke) names to categories; the first category with a matching
# substring wins. The run also keeps the top kernels by name, so a misfiled one can be seen.
PROFILE_CATEGORIES = (
    ("2:4 GEMM (cuSPARSELt)", ("sparse", "cusparselt", "cslt")),
    ("attention", ("flash", "fmha", "attention", "softmax", "sdpa", "bmm", "baddbmm")),
    ("dense GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "addmm", "aten::mm", "matmul", "linear", "int_mm")),
    # our Triton kernels are named for what they fuse (_gelu_quant, _add_ln_quant, _quant); _table_quant is
    # the FFN activation + quantize by code table (Encoder.use_code_tables), GELU's place in the forward
    ("GELU (+ quantize, fused)", ("gelu", "_table_quant")),
    ("LayerNorm (+ residual add, quantize, fused)", ("layer_norm", "layernorm", "add_ln")),
    ("activation quantizer", ("_quant", "triton", "quantize", "round", "clamp")),
)


def _profile_categories(events: list[tuple[str, float, int]], iters: int) -> dict[str, Any]:
    """(name, total ms, calls) per kernel -> ms per forward in each category, and the top kernels."""
    cats: dict[str, float] = {}
    for name, ms, _ in events:
        low = name.lower()
        cat = next((c for c, keys in PROFILE_CATEGORIES if any(k in low for k in keys)), "element-wise and other")
        cats[cat] = cats.get(cat, 0.0) + ms / iters
    total = sum(cats.values())
    top = sorted(events, key=lambda e: -e[1])[:15]
    return {"ms_per_forward": round(total, 4),
            "categories": {c: {"ms": round(v, 4), "share": round(v / total, 4) if total else None}
                           for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:160], "ms_per_forward": round(ms / iters, 4), "calls_per_forward": c / iters}
                            for n, ms, c in top]}


def section_profile(run: Run) -> dict[str, Any]:
    """Where a whole encoder's time goes: torch.profiler over eager forwards of the BERT-base-shaped model
    (random weights) at the largest batch, per kernel category, FP16 (transformers) and ours (2:4 INT8).
    Kernel times are the same eager or in a graph; eager only adds the launch gaps between them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg, dense, sparse, quant = _bert_base_random(run)
    variants = dict((name, build) for name, build, graphs, _ in _encoder_variants(run, cfg, dense, sparse, quant)
                    if not graphs)
    b, iters = max(run.args.batch_list), 5
    inp = _token_batch(torch, b, run.args.seq, int(cfg["vocab_size"]), run.device, seed=7)
    acts = [ProfilerActivity.CPU] if run.smoke else [ProfilerActivity.CUDA]
    res: dict[str, Any] = {"batch": b, "seq": run.args.seq, "iters": iters, "model": "BERT-base shapes (random weights)",
                           "timer": "operator self time on the CPU" if run.smoke else "CUDA kernel time (CUPTI)",
                           "variants": {}}
    for name in (n for n in variants if "eager" in n or "ours, CPU" in n):
        def one(name=name):
            call = variants[name]()
            with torch.inference_mode():
                for _ in range(2):
                    call(inp)
                if not run.smoke:
                    torch.cuda.synchronize()
                with profile(activities=acts) as prof:
                    for _ in range(iters):
                        call(inp)
                    if not run.smoke:
                        torch.cuda.synchronize()
            events = []
            for e in prof.key_averages():
                on_gpu = str(getattr(e, "device_type", "")).endswith("CUDA")
                if run.smoke:
                    us = getattr(e, "self_cpu_time_total", 0.0)
                elif on_gpu:
                    us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
                else:
                    continue
                if us > 0:
                    events.append((e.key, us / 1000, e.count))
            return _profile_categories(events, iters)

        res["variants"][name] = guarded(f"profile {name}", one)
        log(f"profile {name}: " + ", ".join(f"{c} {v['ms']:.3g} ms" for c, v in
                                            res["variants"][name].get("categories", {}).items()))
    return res


def section_encoder_3p(run: Run) -> dict[str, Any]:
    """The third-party CUDA-graph captures, last of all (a failed capture can spoil the context)."""
    plan = getattr(run, "encoder_plan", None)
    if not plan:
        return {"skipped": "no encoder models were built"}
    _encoder_pass(run, plan, risky_pass=True)
    for _, entry, _, _, _ in plan:
        _encoder_ratios(entry, run.args.batch_list, run.args.seq)
    return {"variants_added_to": [label for label, *_ in plan]}


def _encoder_pass(run: Run, plan, *, risky_pass: bool) -> None:
    for risky_pass in (risky_pass,):
        for label, entry, vocab, art, variants in plan:
            log(f"encoder: {label}" + (" (third-party graph captures)" if risky_pass else ""))
            for name, build, graphs, risky in variants:
                if risky != risky_pass:
                    continue
                if run.over_budget():
                    entry["variants"][name] = {"error": "skipped: time budget reached"}
                    continue
                r = guarded(name, lambda build=build, graphs=graphs, vocab=vocab: _bench_variant(run, build, graphs, vocab))
                entry["variants"][name] = r
                log(f"  {name}: " + ", ".join(
                    f"b{b} {r[b]['median_ms']:.3f} ms" for b in map(str, run.args.batch_list)
                    if isinstance(r.get(b), dict) and "median_ms" in r[b]))
                run.save()
            if not risky_pass and art is not None and not run.smoke:
                name = "torch-cuda backend end to end (host arrays, perf_counter" + (
                    f", seq {art.max_seq_length} = the checkpoint's max)" if art.max_seq_length < run.args.seq else ")")
                entry["variants"][name] = guarded(
                    "backend", lambda art=art, vocab=vocab: _bench_backend_end_to_end(run, art, vocab))
        for _, entry, _, _, _ in plan:
            _encoder_ratios(entry, run.args.batch_list, run.args.seq)


def _cell_ms(r: Any, b: str) -> float | None:
    c = r.get(b) if isinstance(r, dict) else None
    return c["median_ms"] if isinstance(c, dict) and "median_ms" in c else None


def _encoder_ratios(entry: dict[str, Any], batches, seq: int) -> None:
    """Per cell: speedup_vs_eager (over FP eager, transformers) and vs_best_dense (the fastest dense peer at
    that batch, over this variant: above 1 is faster); entry["best_dense"] names that peer per batch.
    Only cells at the section's seq are compared (the backend end to end may run at a shorter one)."""
    variants = entry["variants"]
    base_name = next((n for n in variants if "eager (transformers)" in n), None)
    same_seq = {n: r for n, r in variants.items() if isinstance(r, dict) and r.get("seq", seq) == seq}
    entry["best_dense"] = {}
    for b in map(str, batches):
        dense = [(ms, n) for n, r in same_seq.items() if peers.engine_kind(n) == "dense" and (ms := _cell_ms(r, b))]
        best = min(dense) if dense else None
        if best:
            entry["best_dense"][b] = {"engine": best[1], "median_ms": best[0]}
        base = _cell_ms(variants.get(base_name), b) if base_name else None
        for name, r in variants.items():
            ms = _cell_ms(r, b)
            if ms is None:
                continue
            if base:
                r[b]["speedup_vs_eager"] = base / ms
            if best and name in same_seq:
                r[b]["vs_best_dense"] = best[0] / ms


# --------------------------------------------------------------------------- parity


def section_parity(run: Run) -> dict[str, Any]:
    """Ours (the torch-cuda path; CPU reference kernel in cpu-smoke) vs the fake-quant model in fp32."""
    import numpy as np
    import torch
    from holoserve.core.tokenizer import load_tokenizer

    from holoserve.compress.checkpoint import load_model
    from holoserve.compress.quant import input_quantizers
    from holoserve.backends import torch_cuda as tc
    from holoserve.data.glue import read_split
    from holoserve.data.metrics import prediction_check
    from holoserve.data.tasks import get_task

    art, _ = _load_carried_checkpoint(run)
    task = get_task(art.task_name)
    glue = Path(run.args.carry) / "glue"
    if (glue / task.folder / "dev.tsv").is_file():
        examples = read_split(task, "dev", glue)
        source = f"{task.folder} dev ({len(examples)} rows)"
    elif run.smoke:
        from tests.helpers.tiny import WORDS

        rng = np.random.default_rng(0)
        examples = [type("E", (), {"text": " ".join(rng.choice(WORDS, 8)), "text_pair": None, "label": int(i % 2)})()
                    for i in range(24)]
        source = "24 synthetic sentences (cpu-smoke)"
    else:
        return {"error": f"no dev split carried under {glue}: run prepare.py with --data-dir"}
    tok = load_tokenizer(art.path, art.max_seq_length)  # batches are padded to their longest row here
    ref, _ = load_model(art.path)
    ref.to(run.device)
    def encoder_infer(enc):
        def infer(ids, mask, tt):
            with torch.no_grad():
                t = [torch.from_numpy(v).to(run.device) for v in (ids, mask, tt)]
                return enc(*t).float().cpu().numpy()
        return infer

    # (name, infer): the first is the headline (the backend as served)
    candidates: list[tuple[str, Any]] = []
    if run.smoke:
        candidates.append(("INT8 reference kernel (CPU), FP32",
                           encoder_infer(tc.encoder_from_artifact(
                               art, linear=tc.LinearOptions(kernel="reference", dtype=torch.float32)))))
    else:
        from holoserve.backends import load_backend

        for precision in ("fp16", "fp32"):
            try:
                backend = load_backend("torch-cuda", art, precision=precision)
                candidates.append((f"torch-cuda backend, precision={precision} (2:4 INT8 cuSPARSELt + CUDA graphs)",
                                   backend.infer))
            except Exception as e:  # noqa: BLE001
                log(f"parity: backend precision={precision} failed to load: {e}")
        try:  # cuSPARSELt called directly: dequant, bias, GELU and the FFN's second quantizer in the GEMM epilogues
            fused = tc.encoder_from_artifact(art, linear=tc.LinearOptions(
                kernel="cslt_fused", device=run.device, tuning=tc.Tuning(quantizer=tc.choose_quantizer("cuda")[0])),
                fusion=tc.Fusion(gelu_quant=True, ln_quant=True))
            candidates.append(("2:4 INT8 cslt_fused (cuSPARSELt epilogues: INT8 GELU codes from the FFN's first GEMM), "
                               "FP16, eager", encoder_infer(fused)))
        except Exception as e:  # noqa: BLE001 - nvmath-python missing, or the library refused the epilogue
            log(f"parity: cslt_fused failed to build: {e}")
        # how sensitive the checkpoint is: exact integer GEMMs, FP32 elsewhere, a different summation order
        candidates.append(("exact INT8 reference (float64 accumulation), FP32, on the GPU",
                           encoder_infer(tc.encoder_from_artifact(art, linear=tc.LinearOptions(
                               kernel="reference", dtype=torch.float32, device=run.device)))))
    got: dict[str, list] = {name: [] for name, _ in candidates}
    want, labels = [], []
    bs = 64
    for i in range(0, len(examples), bs):
        chunk = examples[i:i + bs]
        enc = tok.encode_batch([(e.text, e.text_pair) if e.text_pair is not None else e.text for e in chunk])
        n = max(len(e.ids) for e in enc)
        ids = np.zeros((len(enc), n), dtype=np.int64)
        mask = np.zeros_like(ids)
        tt = np.zeros_like(ids)
        for j, e in enumerate(enc):
            ids[j, :len(e.ids)] = e.ids
            mask[j, :len(e.ids)] = e.attention_mask
            tt[j, :len(e.ids)] = e.type_ids
        for name, infer in candidates:
            try:
                got[name].append(np.asarray(infer(ids, mask, tt), dtype=np.float32))
            except Exception as e:  # noqa: BLE001 - keep the others
                got[name] = None
                candidates = [c for c in candidates if c[0] != name]
                log(f"parity: {name} failed: {e}")
        t = {k: torch.from_numpy(v).to(run.device) for k, v in
             (("input_ids", ids), ("attention_mask", mask), ("token_type_ids", tt))}
        with torch.no_grad(), input_quantizers(ref, art.activation_amax(), art.sparse_layers, exact=True):
            want.append(ref(**t).logits.float().cpu().numpy())
        labels += [e.label for e in chunk]
    w, y = np.concatenate(want), np.asarray(labels)
    variants = {}
    for name, parts in got.items():
        if not parts:
            variants[name] = {"error": "failed (see log)"}
            continue
        g = np.concatenate(parts)
        diff = np.abs(g - w)
        variants[name] = {"max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
                          "argmax_agreement": float((g.argmax(-1) == w.argmax(-1)).mean()),
                          "accuracy": float((g.argmax(-1) == y).mean())}
        # the export's rule for the same question: FP32 may change what rounding explains (1 % of the rows),
        # FP16 (a precision change on purpose) may change more rows but not the accuracy (McNemar)
        rec, why = prediction_check(task, g, w, y, precision_change="precision=fp16" in name)
        variants[name]["check"] = rec | {"passes": why is None} | ({"fails": why} if why else {})
        log(f"parity: {name}: agreement {variants[name]['argmax_agreement']:.4f}, "
            f"max |Δlogit| {variants[name]['max_abs_logit_diff']:.4f}, acc {variants[name]['accuracy']:.4f}")
    head_name = next((n for n in got if "error" not in variants[n]), None)
    if head_name is None:
        return {"error": "no implementation produced logits", "variants": variants}
    head = variants[head_name]
    res = {
        "data": source, "ours": head_name, "reference": "checkpoint fake-quant model, integer-exact GEMMs (compress.quant.input_quantizers, exact=True)",
        "rows": int(len(y)), "max_abs_logit_diff": head["max_abs_logit_diff"],
        "mean_abs_logit_diff": head["mean_abs_logit_diff"], "argmax_agreement": head["argmax_agreement"],
        "accuracy_ours": head["accuracy"], "accuracy_reference": float((w.argmax(-1) == y).mean()),
        "manifest_metrics": art.manifest.metrics.compressed,
        "target_argmax_agreement": 0.995, "variants": variants,
    }
    res["meets_target"] = res["argmax_agreement"] >= 0.995
    return res


# --------------------------------------------------------------------------- report


def _check_cell(rec: dict[str, Any] | None) -> str:
    if not rec:
        return "—"
    if "changed_predictions" not in rec:
        return "passes" if rec["passes"] else "fails"
    return (f"{'passes' if rec['passes'] else 'fails'}: {rec['changed_predictions']} changed "
            f"({rec['right_here_only']} right only here, {rec['right_in_reference_only']} only in the reference), "
            f"McNemar p = {rec['mcnemar_exact_p']:.2g}")


HOST_BOUND = 1.25  # eager slower than its CUDA-graph twin by this factor: the host, not the GPU, set its pace


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, evaluated on what was measured (None where not measured)."""
    out = []
    enc = report["sections"].get("encoder", {}).get("models", {})
    bert = next((v for k, v in enc.items() if k.startswith("BERT-base") and isinstance(v, dict) and "variants" in v), None)

    def cell(variant, b="128"):
        if not bert:
            return None
        r = bert["variants"].get(variant, {})
        c = r.get(b) if isinstance(r, dict) else None
        return c.get("median_ms") if isinstance(c, dict) else None

    ours, eager, ao = (cell("2:4 INT8 + CUDA graphs (ours)"), cell("FP16 eager (transformers)"),
                       cell("torchao 2:4 INT8 + CUDA graphs") or cell("torchao 2:4 INT8 eager"))
    ao_best = min([x for x in (cell("torchao 2:4 INT8 + CUDA graphs"), cell("torchao 2:4 INT8 eager")) if x],
                  default=None)
    # eager PyTorch at batch 128 is bound by the GPU, so it runs about as fast as the same model with
    # CUDA graphs; where it measures much slower, the host stalled the launches in that run (seen on an
    # H200: 14.2 ms eager against 8.0 ms with graphs, and 7.8 ms eager two minutes later). The target
    # is then judged against the faster FP16 measurement, never against a stalled one.
    graphs = cell("FP16 + CUDA graphs (transformers)")
    base, label = eager, "FP16 eager"
    if eager and graphs and graphs < eager:
        base = graphs
        label = (f"FP16, the faster of eager {eager:.2f} ms and CUDA graphs {graphs:.2f} ms"
                 + (": eager host-bound in this run" if eager > HOST_BOUND * graphs else ""))
    out.append({"target": f"ours >= 2.5x {label}, BERT-base batch 128 seq 128",
                "value": base / ours if ours and base else None, "threshold": 2.5})
    out.append({"target": "ours >= 1.3x torchao 2:4 INT8 (its best of eager / graphs), BERT-base batch 128",
                "value": ao_best / ours if ours and ao_best else None, "threshold": 1.3})
    del ao
    gemm = report["sections"].get("gemm", {}).get("rows", [])
    if gemm:
        big = max(r["M"] for r in gemm)
        ratios = [r.get("sparse_int8_over_dense_int8") for r in gemm if r["M"] == big and r.get("sparse_int8_over_dense_int8")]
        out.append({"target": f"per-GEMM 2:4 INT8 >= 1.5x dense INT8 at M={big} (median over K,N)",
                    "value": statistics.median(ratios) if ratios else None, "threshold": 1.5})
        searched = [r.get("sparse_int8_search_over_dense_int8") for r in gemm
                    if r["M"] == big and r.get("sparse_int8_search_over_dense_int8")]
        if searched:
            out.append({"target": f"same, with cuSPARSELt's algorithm search (M={big})",
                        "value": statistics.median(searched), "threshold": 1.5})
    par = report["sections"].get("parity", {})
    out.append({"target": "argmax agreement with the fake-quant model >= 99.5%"
                + (f" ({par['ours']})" if par.get("ours") else ""),
                "value": par.get("argmax_agreement"), "threshold": 0.995})
    for name, v in (par.get("variants") or {}).items():
        if "precision=fp32" in name and "argmax_agreement" in v:
            out.append({"target": f"same, {name}", "value": v["argmax_agreement"], "threshold": 0.995})
    acc, ref = par.get("accuracy_ours"), par.get("accuracy_reference")
    out.append({"target": "accuracy within 0.5 points of the fake-quant model (points, ours - reference)"
                + (f" ({par['ours']})" if par.get("ours") else ""),
                "value": 100 * (acc - ref) if acc is not None and ref is not None else None, "threshold": -0.5})
    for t in out:
        t["met"] = None if t["value"] is None else bool(t["value"] >= t["threshold"])
    return out


def fmt(v, digits=3):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _last_line(text) -> str:
    lines = [x for x in str(text or "").splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


def _encoder_cells(r: Any, b: str) -> str:
    """The two cells of one variant at one batch: latency / throughput / speed-up over eager, and vs best dense."""
    c = r.get(b, {}) if isinstance(r, dict) else {}
    if isinstance(c, dict) and "median_ms" in c:
        best = c.get("vs_best_dense")
        return (f"{c['median_ms']:.3f} ms / {c['seq_per_s']:.0f} / {fmt(c.get('speedup_vs_eager'))}× | "
                + (f"{best:.2f}×" if best is not None else "—"))
    err = (c or {}).get("error") if isinstance(c, dict) else None
    err = err or (r.get("error") if isinstance(r, dict) else None)
    skipped = r.get("skipped") if isinstance(r, dict) else None
    return (f"err: {str(err)[:60]}" if err else (f"skipped ({skipped})" if skipped else "—")) + " | —"


def _encoder_notes(m: dict[str, Any], bs: list[str]) -> list[str]:
    """Below an encoder table: the best dense peer per batch, and each compiled peer's compile times."""
    best = m.get("best_dense") or {}
    out = []
    if best:
        out.append("Best dense: " + "; ".join(f"batch {b}: {best[b]['engine']} ({best[b]['median_ms']:.3f} ms)"
                                               for b in bs if b in best) + ".")
    for name, r in m["variants"].items():
        cells = {b: r[b] for b in bs if isinstance(r, dict) and isinstance(r.get(b), dict) and "compile_s" in r[b]}
        if cells:
            out.append(f"{name}: compiled (first call, not timed) in " + ", ".join(
                f"{c['compile_s']:.1f} s at batch {b} ({c['graphs']} graphs, {c['graph_breaks']} graph breaks"
                + (f", {c['cudagraph_skips']} left out of CUDA graphs" if c.get("cudagraph_skips") else "")
                + (f", {c['recompiled_while_timed']} recompiled while timed" if c.get("recompiled_while_timed") else "")
                + ")" for b, c in cells.items()) + ".")
    return [x + "\n" for x in out[:-1]] + out[-1:]


def render_markdown(report: dict[str, Any]) -> str:
    s = report["sections"]
    env = s.get("env", {})
    L = [f"# HoloServe 2:4 sparse INT8 on GPU — {report['date'][:10]}", "",
         f"Machine: {env.get('machine', '?')} · driver {env.get('driver', '—')} · torch {env.get('torch', '?')} "
         f"(CUDA {env.get('torch_cuda', '—')}) · cuSPARSELt {env.get('cusparselt', '—')} · "
         f"transformers {env.get('transformers', '—')} · torchao {env.get('torchao', '—')}", "",
         f"Mode: {report['mode']}. Method: {report['method']['timer']}; {report['method']['warmup']} warm-up, "
         f"{report['method']['iters']} timed calls, median; {report['method']['inputs']}.", ""]
    if report.get("merged_from"):
        L += [f"Merged from {len(report['merged_from'])} runs on the same machine kind, started at "
              + ", ".join(f"{str(d)[11:16]}" for d in report["merged_from"])
              + " UTC (`python -m bench.gpu.run --merge`): sections and GEMM rows each come whole from one run; an encoder "
              "variant marked with a run's time was measured in that run, not beside the rest of its table.", ""]
    if report.get("rerendered"):
        L += ["Rendered again from this run's results.json by a later `python -m bench.gpu.run --merge`: the measurements are the "
              "run's own; the targets are judged as that version of the script judges them.", ""]
    if "targets" in report:
        L += ["## Targets", "", "| target | measured | threshold | met |", "| --- | --- | --- | --- |"]
        for t in report["targets"]:
            L.append(f"| {t['target']} | {fmt(t['value'])} | {t['threshold']} | "
                     f"{'—' if t['met'] is None else ('yes' if t['met'] else 'NO')} |")
        L.append("")
    pk = s.get("peak", {})
    if pk:
        L += ["## Measured dense peak", "",
              f"FP16 cuBLAS {fmt(pk.get('fp16_tflops'))} TFLOP/s, INT8 _int_mm {fmt(pk.get('int8_tops'))} TOPS "
              f"with a column-major B ({fmt(pk.get('int8_row_major_b_tops'))} with a row-major B) "
              f"({pk.get('size')}³)" if not report["mode"] == "cpu-smoke" else
              f"FP32 CPU {fmt(pk.get('fp32_cpu_tflops'))} TFLOP/s ({pk.get('size')}³)", ""]
    gm = s.get("gemm", {})
    if gm.get("rows"):
        names = [n for n in (*GEMM_KERNELS, "sparse_int8_search", "dense_fp32_cpu", "int8_reference_cpu")
                 if any(n in r for r in gm["rows"])]
        L += ["## Per-GEMM (TFLOP/s or TOPS, dense-equivalent 2·M·N·K)", "",
              f"2:4 INT8 epilogue: {gm.get('epilogue', '—')}. Percent of the measured dense peak of the same precision "
              "in parentheses.", "",
              "| K | N | M | " + " | ".join(KERNEL_TITLES.get(n, n) for n in names)
              + " | 2:4 INT8 / dense INT8 | 2:4 FP16 / dense FP16 | 2:4 INT8 / dense FP16 |",
              "| " + " | ".join("---" for _ in range(3 + len(names) + 3)) + " |"]
        for r in gm["rows"]:
            cells = []
            for n in names:
                c = r.get(n, {})
                if "tflops" in c:
                    peak = pk.get("int8_tops") if "int8" in n else pk.get("fp16_tflops")
                    pct = f" ({100 * c['tflops'] / peak:.0f}%)" if peak and not report["mode"] == "cpu-smoke" else ""
                    cells.append(f"{fmt(c['tflops'])}{pct}")
                else:
                    cells.append("err" if "error" in c else "—")
            L.append(f"| {r['K']} | {r['N']} | {r['M']} | " + " | ".join(cells) + " | "
                     + " | ".join(fmt(r.get(k)) for k in ("sparse_int8_over_dense_int8", "sparse_fp16_over_dense_fp16",
                                                           "sparse_int8_over_dense_fp16")) + " |")
        L.append("")
    qrows = [r for r in gm.get("rows", []) if isinstance(r.get("quantize"), dict)]
    if qrows:
        L += ["## Activation quantizer alone (FP16 [M, K] → int8 codes), next to the 2:4 INT8 GEMM it feeds", "",
              "| K | M | torch ops ms | fused Triton ms | Triton GB/s (3 B/elem) | 2:4 INT8 GEMM ms (N = K) |",
              "| --- | --- | --- | --- | --- | --- |"]
        for r in qrows:
            q = r["quantize"]
            same = next((x for x in gm["rows"] if x["K"] == r["K"] and x["N"] == r["K"] and x["M"] == r["M"]), {})
            L.append(f"| {r['K']} | {r['M']} | {fmt(q.get('torch_ops', {}).get('median_ms'))} | "
                     f"{fmt(q.get('triton', {}).get('median_ms'))} | {fmt(q.get('triton', {}).get('gb_per_s_min_traffic'))} | "
                     f"{fmt(same.get('sparse_int8', {}).get('median_ms'))} |")
        L.append("")
    en = s.get("encoder", {})
    for label, m in (en.get("models") or {}).items():
        if not isinstance(m, dict) or "variants" not in m:
            L += [f"## Encoder: {label}", "", f"not measured: {m.get('error') if isinstance(m, dict) else m}", ""]
            continue
        bs = [str(b) for b in en.get("batches", [])]
        L += [f"## Whole encoder: {label}, seq {en.get('seq')}", "",
              f"Shape: {m['config']}. Cells: median latency ms / sequences per s / speed-up over FP eager (transformers); "
              "vs best dense: the fastest dense peer's median at that batch over this one's (above 1: faster than "
              "every dense peer).",
              "", "| variant | kind | " + " | ".join(f"batch {b} | vs best dense" for b in bs) + " |",
              "| --- | --- |" + " --- | --- |" * len(bs)]
        for name, r in m["variants"].items():
            L.append(f"| {name} | {peers.engine_kind(name)} | " + " | ".join(_encoder_cells(r, b) for b in bs) + " |")
        L += [""] + _encoder_notes(m, bs) + [""]
    prof = s.get("profile")
    if prof and prof.get("variants"):
        L += [f"## Where the encoder's time goes: {prof['model']}, batch {prof['batch']}, seq {prof['seq']}", "",
              f"{prof['timer']}, mean over {prof['iters']} eager forwards, ms per forward (share).", ""]
        names = [n for n, v in prof["variants"].items() if "categories" in v]
        cats = list(dict.fromkeys(c for n in names for c in prof["variants"][n]["categories"]))
        L += ["| category | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for c in cats:
            cells = []
            for n in names:
                v = prof["variants"][n]["categories"].get(c)
                cells.append(f"{v['ms']:.3f} ({100 * v['share']:.0f} %)" if v else "—")
            L.append(f"| {c} | " + " | ".join(cells) + " |")
        L.append("| **total** | " + " | ".join(f"{prof['variants'][n]['ms_per_forward']:.3f}" for n in names) + " |")
        for n, v in prof["variants"].items():
            if "error" in v:
                L.append(f"\n{n}: not measured: {_last_line(v['error'])}")
        L.append("")
    par = s.get("parity")
    if par:
        L += ["## Parity with the checkpoint's fake-quant model", ""]
        if "error" in par:
            L.append(f"not measured: {par['error']}")
        else:
            L += [f"Reference: {par['reference']}, on {par['data']}: accuracy {100 * par['accuracy_reference']:.2f}%.", "",
                  "| implementation | argmax agreement | max abs Δlogit | mean abs Δlogit | accuracy | export check |",
                  "| --- | --- | --- | --- | --- | --- |"]
            for name, v in (par.get("variants") or {par["ours"]: {
                    "argmax_agreement": par["argmax_agreement"], "max_abs_logit_diff": par["max_abs_logit_diff"],
                    "mean_abs_logit_diff": par["mean_abs_logit_diff"], "accuracy": par["accuracy_ours"]}}).items():
                if "error" in v:
                    L.append(f"| {name} | {v['error']} | | | | |")
                    continue
                L.append(f"| {name} | {100 * v['argmax_agreement']:.2f}% | {v['max_abs_logit_diff']:.4f} | "
                         f"{v['mean_abs_logit_diff']:.5f} | {100 * v['accuracy']:.2f}% | {_check_cell(v.get('check'))} |")
            L += ["", "Target: argmax agreement ≥ 99.5% for the served configuration (the first row). Export check: "
                  "the rule `holoserve export` applies (FP32: at most 1 % of the predictions change; FP16, a precision "
                  "change on purpose: the changed rows may not change the accuracy, McNemar p ≥ 0.05)."]
        L.append("")
    L += ["## TensorRT on this machine", "",
          f"- `python3 -c \"import tensorrt\"`: rc {env.get('tensorrt_import', {}).get('rc')} — "
          f"{_last_line(env.get('tensorrt_import', {}).get('out'))}",
          f"- `ldconfig -p | grep nvinfer`: {_last_line(env.get('nvinfer_libs', {}).get('out')) or '(nothing)'}"
          + (f" ({len(env['nvinfer_libs']['out'].splitlines())} lines)" if env.get('nvinfer_libs', {}).get('out') else ""),
          f"- trtexec: {env.get('trtexec') or '(not on PATH)'}", ""]
    if env.get("tensorrt_engine"):
        L.append(env["tensorrt_engine"])
    errors = report.get("errors") or []
    if errors:
        L += ["## Errors", ""] + [f"- {e}" for e in errors]
    return "\n".join(L) + "\n"


def write_plots(report: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    gm = report["sections"].get("gemm", {}).get("rows", [])
    if gm:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        pairs = [("sparse_int8_over_dense_int8", "2:4 INT8 / dense INT8"), ("sparse_fp16_over_dense_fp16", "2:4 FP16 / dense FP16")]
        if report["mode"] == "cpu-smoke":
            pairs = [("int8_reference_cpu_over_dense_fp32_cpu", "INT8 reference / FP32 (CPU)")] * 2
        for ax, (key, title) in zip(axes, pairs):
            for (k, n) in sorted({(r["K"], r["N"]) for r in gm}):
                pts = [(r["M"], r[key]) for r in gm if r["K"] == k and r["N"] == n and r.get(key)]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"K={k} N={n}")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("M (tokens)")
            ax.set_ylabel("speed-up")
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=6, ncol=2)
        fig.suptitle(f"per-GEMM speed-ups · {report['sections'].get('env', {}).get('machine', '')}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "gemm.png", dpi=110)
        plt.close(fig)
        written.append("gemm.png")
    models = {k: v for k, v in (report["sections"].get("encoder", {}).get("models") or {}).items()
              if isinstance(v, dict) and "variants" in v}
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5.2), squeeze=False)
        palette = plt.get_cmap("tab20").colors
        for ax, (label, m) in zip(axes[0], models.items()):
            for i, (name, r) in enumerate(m["variants"].items()):
                if not isinstance(r, dict):
                    continue
                pts = [(int(b), c["seq_per_s"]) for b, c in r.items() if b.isdigit() and isinstance(c, dict) and "seq_per_s" in c]
                if pts:
                    pts.sort()
                    ours = "ours" in name or "backend" in name  # ours solid, the baselines dashed
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^vD<>p"[i % 8],
                            color=palette[(2 * i) % 20 + (i // 10) % 2], linestyle="-" if ours else "--", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_ylabel("sequences / s")
            ax.set_title(label[:70], fontsize=8)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
        fig.tight_layout()
        fig.savefig(out / "encoder.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append("encoder.png")
    return written


def latest_record(report: dict[str, Any]) -> dict[str, Any]:
    """latest.json: the encoder timings as flat rows, one per model × engine × batch × seq, with the engine's
    kind (dense, ours, peer-2:4), so that every ratio can be recomputed from this file alone."""
    env = report["sections"].get("env", {})
    en = report["sections"].get("encoder", {})
    rows = []
    for label, m in (en.get("models") or {}).items():
        for name, r in (m.get("variants") or {}).items() if isinstance(m, dict) else ():
            if not isinstance(r, dict):
                continue
            for b, c in r.items():
                if b.isdigit() and isinstance(c, dict) and "median_ms" in c:
                    rows.append({"model": label, "engine": name, "kind": peers.engine_kind(name), "batch": int(b),
                                 "seq": r.get("seq", en.get("seq")), "median_ms": c["median_ms"],
                                 **{k: c[k] for k in ("vs_best_dense", "compile_s") if k in c}})
    return {"kind": "holoserve-gpu-bench-latest", "gpu": env.get("gpu"), "machine": env.get("machine"),
            "date": report.get("date"), "mode": report.get("mode"), "torch": env.get("torch"),
            "timer": report.get("method", {}).get("timer"), "merged_from": report.get("merged_from"),
            "vs_best_dense": "min(median_ms over the rows of kind 'dense' with the same model, batch and seq) "
                             "/ this row's median_ms: above 1 is faster than every dense peer",
            "rows": rows}


def finish(run: Run) -> None:
    from holoserve.core.files import atomic_write_json

    run.report["targets"] = targets(run.report)
    run.save()
    atomic_write_json(run.out / "latest.json", latest_record(run.report))
    tmp_md = run.out / ".results.md.tmp"
    tmp_md.write_text(render_markdown(run.report))
    os.replace(tmp_md, run.out / "results.md")
    plots = guarded("plots", lambda: {"files": write_plots(run.report, run.out)})
    run.report["plots"] = plots
    run.save()
    log(f"wrote {run.out}/results.json, latest.json, results.md, {', '.join(plots.get('files', []))} "
        f"in {run.elapsed():.0f} s")


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several runs of this script (the sweep split over calls of limited length).

    The first report is the base; a later one adds the sections the base lacks or failed, the GEMM rows
    (K, N, M) it lacks, and the encoder variants it lacks, each such variant named with the time of
    the run that measured it, since ratios across runs are not measured side by side."""
    import copy

    out = copy.deepcopy(reports[0])
    if len(reports) > 1:
        out["merged_from"] = [r.get("date") for r in reports]
    else:  # one report: the tables rendered again, with the targets as this version judges them
        out["rerendered"] = True
    out["errors"] = []
    for r in reports[1:]:
        when = f" (run of {str(r.get('date', '?'))[11:16]} UTC)"
        for name, sec in r["sections"].items():
            mine = out["sections"].get(name)
            if name == "encoder_3p" or only_failure(sec):
                continue
            if mine is None or only_failure(mine):
                out["sections"][name] = copy.deepcopy(sec)
            elif name == "gemm":
                have = {(x["K"], x["N"], x["M"]) for x in mine.get("rows", [])}
                mine.setdefault("rows", []).extend(copy.deepcopy(x) for x in sec.get("rows", [])
                                                   if (x["K"], x["N"], x["M"]) not in have)
                mine.pop("truncated", None)
            elif name == "encoder":
                for model, entry in sec.get("models", {}).items():
                    base = mine.setdefault("models", {}).setdefault(model, copy.deepcopy(entry))
                    for variant, cells in entry.get("variants", {}).items():
                        if variant not in base.get("variants", {}):
                            base["variants"][variant + when] = copy.deepcopy(cells)
    for r in reports:
        out["errors"] += [e for e in r.get("errors", []) if e.split(":")[0] not in out["sections"]
                          or "error" in out["sections"][e.split(":")[0]]]
    enc = out["sections"].get("encoder", {})
    for entry in (enc.get("models") or {}).values():  # best dense over the merged variants (older runs: added)
        if isinstance(entry, dict) and "variants" in entry:
            batches = sorted({int(b) for r in entry["variants"].values() if isinstance(r, dict) for b in r if b.isdigit()})
            _encoder_ratios(entry, batches, enc.get("seq"))
    rows = out["sections"].get("gemm", {}).get("rows", [])
    rows.sort(key=lambda x: (_shape_rank((x["K"], x["N"])), x["K"], x["N"], x["M"]))
    out["targets"] = targets(out)
    return out


def merge_main(paths: list[str], out: Path) -> int:
    reports = [json.loads(Path(p).read_text()) for p in paths]
    report = merge_reports(reports)
    out.mkdir(parents=True, exist_ok=True)
    report["plots"] = {"files": write_plots(report, out)}
    from holoserve.core.files import atomic_write_json, atomic_write_text

    atomic_write_json(out / "results.json", report)
    atomic_write_json(out / "latest.json", latest_record(report))
    atomic_write_text(out / "results.md", render_markdown(report))
    print(f"merged {len(paths)} runs into {out}/results.json, latest.json, results.md, "
          f"{', '.join(report['plots']['files'])}")
    return 0


SECTIONS = {"env": section_env, "peak": section_peak, "gemm": section_gemm, "encoder": section_encoder,
            "parity": section_parity, "encoder_3p": section_encoder_3p, "profile": section_profile}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--merge"]:  # --merge A/results.json [B/results.json ...] --out DIR (one: re-render)
        if "--out" not in argv or argv.index("--out") < 2 or len(argv) != argv.index("--out") + 2:
            print("usage: python -m bench.gpu.run --merge RESULTS.json [RESULTS.json ...] --out DIR", file=sys.stderr)
            return 2
        return merge_main(argv[1:argv.index("--out")], Path(argv[-1]))
    args = parse_args(argv)
    run = Run(args)
    if not run.smoke:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run this on a GPU machine, or use --cpu-smoke", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False
    run.report["errors"] = []

    def _stop(signum, _frame):  # `timeout` sends SIGTERM: still write the tables of what was measured
        raise Stopped(f"stopped by signal {signum} after {run.elapsed():.0f} s")

    import signal

    signal.signal(signal.SIGTERM, _stop)
    # parity first (the check that must not be lost), then the whole-encoder targets, then the GEMM
    # sweep (it stops at the time budget), and third-party graph captures last of all
    order = [s for s in ("env", "peak", "parity", "profile", "encoder", "gemm") if s in args.section_list or s == "env"]
    if "encoder" in args.section_list:
        order.append("encoder_3p")
    try:
        for name in order:
            if run.over_budget() and name != "env":
                run.report["sections"][name] = {"error": "skipped: time budget reached"}
                continue
            log(f"section {name}")
            t = time.perf_counter()
            r = guarded(name, lambda name=name: SECTIONS[name](run))
            if only_failure(r):
                run.report["errors"].append(f"{name}: {r['error']}")
            r["seconds"] = round(time.perf_counter() - t, 1)
            run.report["sections"][name] = r
            run.save()
    except Stopped as e:
        log(str(e))
        run.report["errors"].append(str(e))
    finish(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
