"""Checks of an exported model with tools nobody here wrote: onnx.checker, ONNX Runtime, Polygraphy.

Everything here works on files and numpy arrays; the PyTorch fake-quant reference is in
export/reference.py (it needs torch), and the export's verification step that runs these checks in
export/verify.py.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from holoserve import HoloServeError
from holoserve.core.ort import session

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT_NAME = "logits"
# ORT ops a QDQ MatMul becomes once fused (CPU execution provider)
FUSED_MATMUL_OPS = ("QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")


class ExportVerificationError(HoloServeError):
    """An export that failed one of its checks (checker, parity, fusion, sparsity)."""


def check_onnx(path: str | os.PathLike) -> dict:
    """onnx.checker full check (includes strict shape inference)."""
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:  # onnx raises ValidationError / InferenceError
        raise ExportVerificationError(f"onnx.checker rejected {Path(path).name}: {e}") from None
    return {"onnx_checker_full": "passed"}


def ort_session(path: str | os.PathLike, threads: int = 1, optimized_path: str | os.PathLike | None = None):
    return session(path, threads=threads, optimized_path=optimized_path)


# what the export's check records where ONNX Runtime's int8 GEMM is not exact on this CPU
INT8_GEMM_SATURATES = (
    "ONNX Runtime's uint8 x int8 GEMM saturates on this CPU (x86-64 without VNNI: VPMADDUBSW clamps the sum of "
    "two products to int16), so its numbers here include that error besides the export's; ONNX Runtime's "
    "session option session.x64quantprecision=1 computes these GEMMs exactly (uint8 x uint8)")


@functools.lru_cache(maxsize=1)
def int8_gemm_saturates() -> bool:
    """Whether a quantized MatMul, in a session as `holoserve.core.ort.session` opens it, comes out wrong on
    this CPU. ORT runs the uint8 x int8 GEMM of its fused QDQ MatMuls with VPMADDUBSW on x86-64 CPUs without
    VNNI, which saturates the int16 sum of each pair of products, unless the session asks for its exact path
    (holoserve.core.ort does). Measured rather than read from CPU flags, with holoserve.core.int8_probe."""
    from holoserve.core import int8_probe

    y = session(int8_probe.probe_onnx(), threads=1, quiet=True).run(None, int8_probe.FEED)[0]
    return not int8_probe.exact(y)


def ort_logits(sess, batches: Iterable[Mapping[str, np.ndarray]]) -> np.ndarray:
    names = {i.name for i in sess.get_inputs()}
    outs = [sess.run([OUTPUT_NAME], {k: v for k, v in b.items() if k in names})[0] for b in batches]
    return np.concatenate(outs, axis=0)


def fused_matmuls(path: str | os.PathLike, tmpdir: str | os.PathLike) -> dict:
    """Optimize with ORT (CPU, all levels) and count QDQ MatMuls that became integer kernels."""
    import onnx

    opt = Path(tmpdir) / (Path(path).stem + ".ort-optimized.onnx")
    ort_session(path, optimized_path=opt)
    m = onnx.load(str(opt), load_external_data=False)
    counts: dict[str, int] = {}
    for n in m.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    fused = sum(counts.get(op, 0) for op in FUSED_MATMUL_OPS)
    opt.unlink(missing_ok=True)
    return {
        "fused_integer_matmuls": fused,
        "fused_by_op": {op: counts[op] for op in FUSED_MATMUL_OPS if op in counts},
        "float_matmuls_left": counts.get("MatMul", 0) + counts.get("FusedMatMul", 0) + counts.get("Gemm", 0),
        "dequantize_left": counts.get("DequantizeLinear", 0),
    }


def parity(ort: np.ndarray, ref: np.ndarray) -> dict:
    """Max abs logit difference and argmax agreement between two [n, labels] arrays."""
    if ort.shape != ref.shape:
        raise ExportVerificationError(f"logits shape {ort.shape} from ONNX Runtime != reference {ref.shape}")
    out = {"rows": int(ort.shape[0]), "max_abs_diff": float(np.abs(ort - ref).max()) if ort.size else 0.0}
    if ort.shape[1] > 1:
        out["argmax_agreement"] = float((ort.argmax(1) == ref.argmax(1)).mean())
    return out


# ------------------------------------------------------------------------------------------ Polygraphy

_SPARSE_RE = re.compile(r"Found sparse tensor:\s*(\S+)")
_NONSPARSE_RE = re.compile(r"Found non-sparse tensor:\s*(\S+)")
_ELIGIBLE_RE = re.compile(r"Found:\s*(\d+)\s+weight tensor")


def parse_polygraphy_sparsity(text: str) -> dict:
    """Parse `polygraphy inspect sparsity` output (it exits 0 whether or not tensors are sparse)."""
    sparse = _SPARSE_RE.findall(text)
    non_sparse = _NONSPARSE_RE.findall(text)
    m = _ELIGIBLE_RE.search(text)
    return {
        "eligible": int(m.group(1)) if m else None,
        "sparse": sparse,
        "non_sparse": non_sparse,
    }


def polygraphy_executable() -> list[str]:
    exe = Path(sys.executable).parent / "polygraphy"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("polygraphy")
    if found:
        return [found]
    raise ExportVerificationError("polygraphy is not installed: pip install 'holoserve[export]'")


def polygraphy_sparsity(float_onnx: str | os.PathLike, expected: Sequence[str]) -> dict:
    """Run Polygraphy on a float-weight export and require every `expected` initializer to be 2:4."""
    cmd = polygraphy_executable() + ["inspect", "sparsity", str(float_onnx)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0:
        raise ExportVerificationError(f"polygraphy inspect sparsity failed (exit {proc.returncode}): {text[-2000:]}")
    parsed = parse_polygraphy_sparsity(text)
    return summarize_sparsity(parsed, expected)


def summarize_sparsity(parsed: Mapping, expected: Sequence[str]) -> dict:
    sparse, non_sparse = set(parsed["sparse"]), set(parsed["non_sparse"])
    expected = list(expected)
    ok = [t for t in expected if t in sparse]
    bad = [t for t in expected if t in non_sparse]
    unseen = [t for t in expected if t not in sparse and t not in non_sparse]
    return {
        "tool": "polygraphy inspect sparsity",
        "tensors_checked": parsed.get("eligible"),
        "encoder_weights": len(expected),
        "encoder_weights_2of4": len(ok),
        "encoder_weights_not_2of4": bad,
        "encoder_weights_not_reported": unseen,
        "other_non_sparse": sorted(non_sparse - set(expected)),
        "all_encoder_weights_2of4": len(ok) == len(expected),
    }
