"""Device checks and load-time probes: what this GPU offers, and which kernels agree with the reference.

`require_cuda` refuses machines that cannot run the backend, with the reason. `choose_epilogue`
tries each cuSPARSELt epilogue (layers.EPILOGUES) on a small 2:4 INT8 GEMM against the exact
reference; `choose_quantizer` compares the fused Triton kernels (kernels.py) with the torch ops.
Only what agrees on the device is used.
"""
from __future__ import annotations

from typing import Any

from holoserve.backends.base import BackendUnavailable
from holoserve.core.numerics import ACT_SCALE_DIV, WEIGHT_QMAX

from ._torch import F, torch, torch_or_raise
from .kernels import activation_code_table, add_layer_norm_quant, quantize_activation_triton, quantize_by_table
from .layers import EPILOGUES, Epilogue, QuantLinear, Tuning
from .numerics import int8_linear_reference, quantize_activation


def cuda_report() -> dict[str, Any]:
    """What this machine offers for the backend (no exceptions; strings where something is missing)."""
    if torch is None:
        return {"torch": None, "cuda": False, "reason": "PyTorch is not installed"}
    out: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda}
    try:
        import torch.backends.cusparselt as cslt

        out["cusparselt"] = cslt.version() if cslt.is_available() else None
    except Exception as e:  # noqa: BLE001 - report, never fail
        out["cusparselt"] = None
        out["cusparselt_error"] = str(e)
    out["cuda"] = bool(torch.cuda.is_available())
    if out["cuda"]:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
    return out


def require_cuda() -> dict[str, Any]:
    torch_or_raise()
    rep = cuda_report()
    if not rep["cuda"]:
        build = "a CPU-only build" if not torch.version.cuda else f"a CUDA {torch.version.cuda} build"
        raise BackendUnavailable(
            f"backend 'torch-cuda' needs an NVIDIA GPU, but torch {torch.__version__} ({build}) sees no CUDA device "
            "here; use --backend onnxruntime (CPU) or run on a GPU machine"
        )
    major = int(rep["capability"].split(".")[0])
    if major < 8:
        raise BackendUnavailable(
            f"backend 'torch-cuda' needs sparse tensor cores (compute capability 8.0+, Ampere or newer); "
            f"{rep['gpu']} is {rep['capability']}"
        )
    if not rep.get("cusparselt"):
        raise BackendUnavailable(
            f"backend 'torch-cuda' needs cuSPARSELt, which torch {torch.__version__} does not provide here "
            "(torch.backends.cusparselt.is_available() is False); install a torch build with cuSPARSELt"
        )
    return rep


def choose_epilogue(device="cuda", dtype=None) -> tuple[Epilogue, list[dict[str, Any]]]:
    """Try each epilogue on a small 2:4 INT8 GEMM against the exact reference; first that matches wins."""
    dtype = dtype or torch.float16
    g = torch.Generator(device="cpu").manual_seed(0)
    n, k, m = 64, 128, 48
    codes = torch.randint(-WEIGHT_QMAX, WEIGHT_QMAX + 1, (n, k), generator=g, dtype=torch.int32)
    mask = torch.zeros(n, k // 4, 4, dtype=torch.bool)
    idx = torch.rand(n, k // 4, 4, generator=g).topk(2, dim=-1).indices
    mask.scatter_(-1, idx, True)
    codes = (codes * mask.reshape(n, k)).to(torch.int8)
    scales = torch.rand(n, generator=g) * 0.01 + 1e-3
    bias = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g) * 2
    act = torch.tensor(4.0 / ACT_SCALE_DIV)  # an activation range of amax = 4
    want = int8_linear_reference(x, codes, scales, act, bias)
    tried = []
    # FP32 output is not on cuSPARSELt's INT8 menu: that precision takes INT32 and dequantizes after
    for e in (EPILOGUES if dtype != torch.float32 else [e for e in EPILOGUES if not e.alpha]):
        try:
            lin = QuantLinear(codes.to(device), scales.to(device), act, bias, kernel="cslt", dtype=dtype,
                              tuning=Tuning(epilogue=e))
            got = lin(x.to(device, dtype)).float().cpu()
            torch.cuda.synchronize()
            err = float((got - want).abs().max() / want.abs().max())
            ok = bool(torch.isfinite(got).all()) and err < 2e-2
            tried.append({"epilogue": e.name, "ok": ok, "rel_err": err})
            if ok:
                return e, tried
        except Exception as exc:  # noqa: BLE001 - an unsupported combination raises; try the next
            tried.append({"epilogue": e.name, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    raise BackendUnavailable(f"no cuSPARSELt INT8 epilogue worked on this GPU: {tried}")


def choose_quantizer(device="cuda") -> tuple[str, dict[str, Any]]:
    """'triton' when its codes equal the torch reference on the device (ties included), else 'torch'."""
    g = torch.Generator(device="cpu").manual_seed(1)
    s = torch.tensor(0.05)
    ties = (torch.arange(-300, 300, dtype=torch.float32) + 0.5) * s  # exact .5 quotients and saturation
    x = torch.cat([ties, torch.randn(12296, generator=g) * 3]).reshape(-1, 32).to(device, torch.float16)
    want = quantize_activation(x, s.to(device))
    try:
        got = quantize_activation_triton(x, s.to(device))
        mism = int((got != want).sum())
        if mism:
            return "torch", {"quantizer": "torch", "triton_mismatches": mism}
        probe: dict[str, Any] = {"quantizer": "triton", "mismatches": 0}
    except Exception as e:  # noqa: BLE001
        return "torch", {"quantizer": "torch", "triton_error": f"{type(e).__name__}: {str(e)[:300]}"}
    # GELU + quantize: erf implementations may differ in the last bit, so allow rare +-1 codes
    try:
        want_g = quantize_activation(F.gelu(x.float()), s.to(device))
        got_g = quantize_activation_triton(x, s.to(device), gelu=True)
        diff = (got_g.int() - want_g.int()).abs()
        probe["gelu_mismatches"] = int((diff > 0).sum())
        probe["gelu_fused"] = bool(int(diff.max()) <= 1 and probe["gelu_mismatches"] <= max(1, diff.numel() // 1000))
    except Exception as e:  # noqa: BLE001
        probe["gelu_fused"] = False
        probe["gelu_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    # the FFN activation by code table: a gather, so the reference's codes exactly or not at all
    try:
        table = activation_code_table(F.gelu, s.to(device))
        probe["table_mismatches"] = int((quantize_by_table(x, table) != want_g).sum())
        probe["table_fused"] = probe["table_mismatches"] == 0
    except Exception as e:  # noqa: BLE001
        probe["table_fused"] = False
        probe["table_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    # residual add + LayerNorm + quantize: FP16 output within a few FP16 ulps, codes within +-1, rarely
    try:
        hdim = 384
        xa = torch.randn(96, hdim, generator=g).to(device, torch.float16)
        xr = torch.randn(96, hdim, generator=g).to(device, torch.float16)
        w = (torch.rand(hdim, generator=g) + 0.5).to(device, torch.float16)
        bb = (torch.randn(hdim, generator=g) * 0.1).to(device, torch.float16)
        want_h = F.layer_norm(xa + xr, (hdim,), w, bb, 1e-12)
        want_q = quantize_activation(want_h, s.to(device))
        got_h, got_q = add_layer_norm_quant(xa, xr, w, bb, 1e-12, scale=s.to(device), rows=100)
        herr = float((got_h.float() - want_h.float()).abs().max())
        diff = (got_q[:96].int() - want_q.int()).abs()
        probe["ln_max_abs_err"] = herr
        probe["ln_code_mismatches"] = int((diff > 0).sum())
        probe["ln_fused"] = bool(herr <= 1e-2 and int(diff.max()) <= 1
                                 and probe["ln_code_mismatches"] <= diff.numel() // 500
                                 and not got_q[96:].any())
    except Exception as e:  # noqa: BLE001
        probe["ln_fused"] = False
        probe["ln_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return "triton", probe
