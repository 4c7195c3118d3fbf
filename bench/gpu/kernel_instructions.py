"""Instructions per element of the torch-cuda backend's Triton kernels, compiled for a GPU on any machine.

On an H200, `_gelu_quant` spends most of its time issuing instructions, not moving memory (bench/gpu/
run.py's profile against this script's counts). Triton compiles for a target GPU without one present,
so the counts can be taken here and compared across versions of the kernels. This script compiles each
kernel for the target (sm90 by default), specialized as a launch at these shapes would be (aligned
pointers, sizes divisible by 16). It disassembles the kernel with the cuobjdump that ships with Triton
and counts the SASS instructions of the straight-line path up to the first unconditional EXIT. The
result is divided by the elements each thread handles. Two variants are counted:

- `plain division`: IEEE division per element, as in Triton's CPU interpreter.
- `FMA division`: the compiled GPU path, for an ordinary scale (the all-ones-significand check off).

`_table_quant` (the FFN activation by code table) divides nothing: one count, under both labels. Its
issue time leaves out what its per-element gathers from the 64 KiB table cost in L1 throughput.

With --sms and --clock-ghz it also gives each kernel's issue time per call at BERT-base batch 128,
seq 128 (4 instructions per SM per clock, 32 threads each). With --bandwidth-tbs it gives the memory
floor (the bytes the kernel must move), to set both beside a measured profile.

    python -m bench.gpu.kernel_instructions [--arch 90] [--sms 132 --clock-ghz 1.98] [--kernels OLD.py]

A version without the FMA division (before 2026-11-26) counts the same under both labels.
"""
from __future__ import annotations

import argparse
import glob
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path


QUANT_SIG = {"x_ptr": "*fp16", "out_ptr": "*i8", "scale_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr",
             "FMA_DIV": "constexpr", "SCALE_CHECK": "constexpr"}
TABLE_SIG = {"x_ptr": "*i16", "out_ptr": "*i8", "table_ptr": "*i8", "n": "i32", "BLOCK": "constexpr"}
LN_SIG = {"x_ptr": "*fp16", "r_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "h_ptr": "*fp16", "q_ptr": "*i8",
          "scale_ptr": "*fp32", "H": "i32", "eps": "fp32", "HAS_RES": "constexpr", "HAS_Q": "constexpr",
          "BLOCK": "constexpr", "FMA_DIV": "constexpr", "SCALE_CHECK": "constexpr", "CHUNKS": "constexpr"}


def main_path(sass: str) -> list[str]:
    """SASS instructions up to and including the first unconditional EXIT."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line)
        if not m:
            continue
        out.append(m.group(1))
        if m.group(1) == "EXIT":
            break
    return out


def load_kernels(path: str | None):
    """The kernels module, or another version of it from a file (e.g. `git show REV:holoserve/backends/
    torch_cuda/kernels.py > old.py`), loaded inside the same package so its imports resolve."""
    if path is None:
        from holoserve.backends.torch_cuda import kernels
        return kernels
    import importlib.util

    spec = importlib.util.spec_from_file_location("holoserve.backends.torch_cuda._kernels_under_count", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def count(fn, signature: dict, constexprs: dict, arch: int, num_warps: int = 4) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = set(fn.arg_names)  # an older version may lack some parameters (e.g. FMA_DIV)
    signature = {k: v for k, v in signature.items() if k in names}
    constexprs = {k: v for k, v in constexprs.items() if k in names}
    # as a launch specializes them at these shapes: pointers 16-byte aligned, sizes divisible by 16
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items()
             if v.startswith("*") or (v == "i32" and k in ("n", "H"))}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    tools = glob.glob(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"))
    if not tools:
        sys.exit("this Triton has no cuobjdump (backends/nvidia/bin): install the Linux x86-64 wheel")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([tools[0], "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return len(main_path(sass))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.kernel_instructions", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="memory bandwidth, TB/s (H200: 4.8)")
    ap.add_argument("--tokens", type=int, default=128 * 128, help="tokens per call (BERT-base batch 128 x seq 128)")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--kernels", help="count another version of kernels.py (a file) instead of this tree's")
    args = ap.parse_args()
    K = load_kernels(args.kernels)

    try:
        T = K.triton_kernels()
    except AttributeError:  # a kernels.py from before triton_kernels(): its kernels sit in _TRITON
        if K._triton_quant_kernel() is None:
            sys.exit(f"triton is unavailable: {K._TRITON.get('error')}")
        T = K._TRITON
    except RuntimeError as e:
        sys.exit(str(e))
    threads = 4 * 32  # num_warps=4, Triton's default, as the wrappers launch
    per_thread = K.QUANT_BLOCK / threads
    ln = K.ln_blocks(args.hidden) if hasattr(K, "ln_blocks") else {"BLOCK": T["next_pow2"](args.hidden)}
    ln_warps = ln.pop("num_warps", 4)
    ln_lanes = ln["BLOCK"] * ln.get("CHUNKS", 1)  # lanes per row
    rate = args.sms * 4 * 32 * args.clock_ghz * 1e9  # thread-instructions per second
    rows = []
    # (name, kernel, signature, constexprs, warps, lanes per call, lanes per thread, bytes moved per call)
    for name, fn, sig, extra, warps, elements, per, nbytes in (
            ("_quant", T["kernel"], QUANT_SIG, {"BLOCK": K.QUANT_BLOCK}, 4, args.tokens * args.hidden,
             per_thread, 3 * args.tokens * args.hidden),  # FP16 in, int8 out
            ("_gelu_quant", T["gelu_kernel"], QUANT_SIG, {"BLOCK": K.QUANT_BLOCK}, 4,
             args.tokens * args.intermediate, per_thread, 3 * args.tokens * args.intermediate),
            ("_add_ln_quant", T["ln_kernel"], LN_SIG, {"HAS_RES": True, "HAS_Q": True, **ln}, ln_warps,
             args.tokens * ln_lanes, ln_lanes / (32 * ln_warps), 7 * args.tokens * args.hidden)):  # x, r, h; codes
        row = {"kernel": name, "elements_per_thread": per, "num_warps": warps,
               "memory_floor_us": round(nbytes / (args.bandwidth_tbs * 1e12) * 1e6, 1)}
        for label, flags in (("plain division", {"FMA_DIV": False, "SCALE_CHECK": True}),
                             ("FMA division", {"FMA_DIV": True, "SCALE_CHECK": False})):
            n = count(fn, sig, {**extra, **flags}, args.arch, num_warps=warps)
            row[label] = {"instructions": n, "per_element": round(n / per, 1),
                          "predicted_us_per_call": round(elements * n / per / rate * 1e6, 1)}
        rows.append(row)
    if "table_kernel" in T:  # the FFN activation by code table: no division, one gather per element
        n = count(T["table_kernel"], TABLE_SIG, {"BLOCK": K.QUANT_BLOCK}, args.arch)
        elements = args.tokens * args.intermediate
        same = {"instructions": n, "per_element": round(n / per_thread, 1),
                "predicted_us_per_call": round(elements * n / per_thread / rate * 1e6, 1)}
        rows.append({"kernel": "_table_quant", "elements_per_thread": per_thread, "num_warps": 4,
                     "memory_floor_us": round(3 * elements / (args.bandwidth_tbs * 1e12) * 1e6, 1),
                     "plain division": same, "FMA division": same,
                     "note": "the issue time leaves out the gathers' L1 throughput (64 KiB table), which may bound it"})
    print(json.dumps({"arch": args.arch, "tokens": args.tokens, "rows": rows}, indent=1))
    print(f"\n| kernel (sm{args.arch}) | plain division: instr/element | FMA division: instr/element | "
          f"issue time µs per call, {args.tokens} tokens ({args.sms} SMs at {args.clock_ghz} GHz): plain → FMA | "
          f"memory floor µs ({args.bandwidth_tbs} TB/s) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        a, b = r["plain division"], r["FMA division"]
        print(f"| {r['kernel']} | {a['per_element']} | {b['per_element']} | "
              f"{a['predicted_us_per_call']} → {b['predicted_us_per_call']} | {r['memory_floor_us']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
