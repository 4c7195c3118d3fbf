"""Sections env, peak and gemm of bench/gpu/run.py: the machine and its versions, the measured dense peaks, and
the per-GEMM sweep of dense and 2:4 kernels."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from bench.gpu.harness import Run, graph_of, guarded, log, measure

GEMM_KERNELS = ("dense_fp16", "dense_int8", "sparse_fp16", "sparse_int8")
KERNEL_TITLES = {
    "dense_fp16": "dense FP16 (cuBLAS)", "dense_int8": "dense INT8 (_int_mm)",
    "sparse_fp16": "2:4 FP16 (cuSPARSELt)", "sparse_int8": "2:4 INT8 (cuSPARSELt, dequant epilogue)",
    "sparse_int8_search": "2:4 INT8, cuSPARSELt alg search",
    "dense_fp32_cpu": "dense FP32 (CPU)", "int8_reference_cpu": "INT8 reference (CPU)",
}


def sh(cmd: str, timeout: float = 30) -> dict[str, Any]:
    try:
        p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
        return {"cmd": cmd, "rc": p.returncode, "out": (p.stdout + p.stderr).strip()[-2000:]}
    except (OSError, subprocess.SubprocessError) as e:
        return {"cmd": cmd, "rc": None, "out": str(e)}


def section_env(run: Run) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(),
                           "cpu": f"{os.cpu_count()}-core {platform.machine()} CPU",
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
    log(f"peak: fp16 {out.get('fp16_tflops', float('nan')):.0f} TFLOP/s, "
        f"int8 {out.get('int8_tops', float('nan')):.0f} TOPS "
        f"(row-major B: {out.get('int8_row_major_b_tops', float('nan')):.0f})")
    return out


# (K, N) of BERT-base, MiniLM
MODEL_SHAPES = [(768, 768), (768, 3072), (3072, 768), (384, 384), (384, 1536), (1536, 384)]


def shape_rank(kn: tuple[int, int]) -> int:
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
    pairs.sort(key=shape_rank)
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
                "fp16": None if run.smoke else [torch.randn(M, K, device="cuda", generator=gen).half()
                                                for _ in range(inner)],
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

    for a, b in (("sparse_int8", "dense_int8"), ("sparse_int8_search", "dense_int8"),
                 ("sparse_fp16", "dense_fp16"), ("sparse_int8", "dense_fp16"),
                 ("dense_int8", "dense_fp16"), ("int8_reference_cpu", "dense_fp32_cpu")):
        if t(a) and t(b):
            row[f"{a}_over_{b}"] = t(b) / t(a)
