"""The verification step of an export: each built graph against the PyTorch fake-quant model
(export/reference.py) on the same rows, through ONNX Runtime and, for the openvino target, OpenVINO;
plus the checker, ORT's integer-kernel fusion and Polygraphy's 2:4 check (export/checks.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from holoserve.core.artifact import Artifact
from holoserve.core.progress import counted
from holoserve.core.progress import current as current_progress
from holoserve.data.metrics import compare_within_rounding, prediction_check, score

from . import checks, qdq
from .options import ExportOptions
from .reference import BUILTIN_SENTENCES, EVAL_BATCH_SIZE, encode_batches, eval_batches_np, reference_logits

# ONNX Runtime's CPU provider has no float16 kernel for these ops (1.32): it runs them in float32 between Casts
ORT_CPU_FP32_FALLBACK = ("MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Erf", "Tanh", "Softmax")


@dataclass(frozen=True)
class BuiltExport:
    """What the build steps hand to verification."""

    files: Mapping[str, Path]  # target -> the built graph
    float_path: Path  # the fp32 export (float weights) Polygraphy inspects
    sites: Sequence[Any]  # qdq.LinearSite of each quantized Linear
    sparse: frozenset[str]  # the Linears the manifest says are 2:4
    lossy_embeddings: bool = False  # int8 word embeddings the checkpoint itself does not have
    tensorrt_fp32: Path | None = None  # the float32 TensorRT placement the float16 one is checked against
    tensorrt_qat: bool = False  # the TensorRT placement quantizes exactly what the checkpoint's TensorRT QAT did


@dataclass(frozen=True)
class CheckRows:
    """The rows every check runs, batched as `holoserve eval` batches them; no task or labels with the
    built-in sentences."""

    batches: list[dict[str, np.ndarray]]
    order: np.ndarray  # the row index of each logit row (batches are grouped by length)
    source: str  # how the report names the rows
    task: Any = None
    labels: Any = None

    def ordered_labels(self) -> np.ndarray:
        return np.asarray(self.labels)[self.order]


def check_rows(art: Artifact, opts: ExportOptions, tok) -> CheckRows:
    """The dev rows as `holoserve eval` batches them, else the built-in sentences."""
    dev = eval_batches_np(art, "dev", opts.rows(), opts.dev_rows)
    if dev is not None:
        # The very batches `holoserve eval` scores (same tokenizer settings, length order and padding):
        # a quantized network turns float noise from a different padding into a few flipped rows, so
        # only identical batches make "ORT metric vs holoserve eval" a statement about the export.
        task, idx_batches, labels = dev
        source = f"{task.name} dev, {len(labels)} rows, batches of {EVAL_BATCH_SIZE} as in holoserve eval"
    else:
        task, labels = None, None
        texts, pairs = list(BUILTIN_SENTENCES), (list(BUILTIN_SENTENCES[::-1]) if art.is_pair else None)
        idx_batches = list(encode_batches(tok, texts, pairs, batch_size=32))
        source = "builtin sentences (no dev rows given)"
    order = np.concatenate([np.asarray(i) for i, _ in idx_batches])
    return CheckRows([b for _, b in idx_batches], order, source, task, labels)


def _polygraphy(art: Artifact, built: BuiltExport) -> dict | None:
    """Polygraphy on the float-weight export: every sparse encoder weight must be 2:4 along K."""
    if art.nm != (2, 4):
        return None
    expected = [s.weight for s in built.sites if s.layer in built.sparse]
    with current_progress().phase("verify: Polygraphy 2:4 check", None, weight=0.0):
        poly = checks.polygraphy_sparsity(built.float_path, expected)
    if not poly["all_encoder_weights_2of4"]:
        raise checks.ExportVerificationError(
            f"Polygraphy found encoder weights that are not 2:4 although the manifest says so: "
            f"{poly['encoder_weights_not_2of4'] or poly['encoder_weights_not_reported']}"
        )
    return poly


def _verify_openvino(path: Path, rows: CheckRows, ref: np.ndarray, threads: int, precision: str = "auto") -> dict:
    """The openvino target through OpenVINO itself, on the same batches as the ONNX Runtime check."""
    from holoserve.backends.base import BackendUnavailable
    from holoserve.backends.openvino import compile_model, gemm_precisions, inference_precision

    try:
        compiled, sparse = compile_model(path, threads=threads, precision=precision)
    except BackendUnavailable as e:
        return {"openvino": f"not run: {e}"}
    req = compiled.create_infer_request()
    names = [i.get_any_name() for i in compiled.inputs]
    got = np.concatenate([np.asarray(req.infer({n: b[n] for n in names})[compiled.outputs[0]])
                          for b in counted(rows.batches, "verify: openvino through OpenVINO")])
    out = {"parity_openvino_vs_pytorch_fakequant": checks.parity(got, ref) | {"rows_source": rows.source},
           "openvino_gemm_precisions": gemm_precisions(compiled), "openvino_sparse_weights": sparse,
           "openvino_inference_precision": inference_precision(compiled)}
    if rows.labels is not None:
        ordered = rows.ordered_labels()
        out["dev_metric_openvino"] = score(rows.task, got, ordered)
        # borderline rows move both ways under bf16: whether the accuracy differs, not just the rows; the
        # rounding verdict is recorded, not enforced (bf16 changes more rows than rounding does)
        out["openvino_vs_pytorch_fakequant_rows"] = compare_within_rounding(rows.task, got, ref, ordered)
    return out


def _verify_tensorrt_fp16(fp32_path: Path, rows: CheckRows, got: np.ndarray, ref: np.ndarray, ref_metric,
                          opts: ExportOptions) -> dict:
    """The float16 TensorRT graph against the same placement in float32 (the effect of float16 alone).

    Refuses the export when float16 measurably changes the dev accuracy (metrics.prediction_check with
    precision_change, and `max_metric_diff` as a further bound; pass --tensorrt-precision fp32 then)."""
    fp32 = checks.ort_logits(checks.ort_session(fp32_path, threads=opts.threads), rows.batches)
    out: dict[str, Any] = {
        "precision": "float16 outside Q/DQ; LayerNormalization and Softmax in float32",
        "parity_vs_fp32_placement": checks.parity(got, fp32) | {"rows_source": rows.source},
        "parity_fp32_placement_vs_pytorch_fakequant": checks.parity(fp32, ref),
        "ort_float16_note": "ONNX Runtime's CPU provider has no float16 kernel for "
        + ", ".join(ORT_CPU_FP32_FALLBACK) + ": it computes them in float32 between Casts, so this check covers the "
        "float16 weights, scales, constants and Q/DQ, not float16 accumulation (TensorRT's float16 kernels)",
    }
    if rows.labels is not None:
        task, y = rows.task, rows.ordered_labels()
        m16, m32 = score(task, got, y), score(task, fp32, y)
        key = task.primary_metric
        check, why = prediction_check(task, got, fp32, y, opts.max_metric_diff, precision_change=True)
        out["dev_metric_ort_fp32_placement"] = m32
        out["dev_metric_diff_points_vs_fp32_placement"] = check.pop("dev_metric_diff_points")
        out["vs_fp32_placement"] = check
        out["dev_metric_diff_points"] = round(100.0 * abs(m16[key] - ref_metric[key]), 4)
        if opts.check_predictions and why:
            raise checks.ExportVerificationError(
                f"the float16 TensorRT graph through ONNX Runtime (dev {key} {100 * m16[key]:.2f}) against the "
                f"float32 one ({100 * m32[key]:.2f}): {why}; export it with --tensorrt-precision fp32")
    return out


def _verify_onnxruntime(path: Path, rows: CheckRows, got: np.ndarray, ref: np.ndarray, ref_metric,
                        linears: int, opts: ExportOptions, tmp: Path) -> dict:
    """The onnxruntime target: ORT fuses every QDQ MatMul into an integer kernel, and the dev predictions
    differ from the PyTorch fake-quant model's by no more than float rounding explains."""
    v: dict[str, Any] = {}
    fused = checks.fused_matmuls(path, tmp)
    v["ort_fusion"] = fused
    if fused["fused_integer_matmuls"] < linears:
        raise checks.ExportVerificationError(
            f"ONNX Runtime fused only {fused['fused_integer_matmuls']} of {linears} QDQ MatMuls into "
            "integer kernels; the export would run in float"
        )
    if rows.labels is not None:
        key = rows.task.primary_metric
        check, why = prediction_check(rows.task, got, ref, rows.ordered_labels(), opts.max_metric_diff)
        v.update(check)
        if opts.check_predictions and why:
            got_metric = score(rows.task, got, rows.ordered_labels())
            raise checks.ExportVerificationError(
                f"the export does not reproduce the checkpoint: on dev through ONNX Runtime ({key} "
                f"{100 * got_metric[key]:.2f}) against the PyTorch fake-quant model "
                f"({100 * ref_metric[key]:.2f}), {why}. Nothing was written; `holoserve export --no-verify` "
                "writes it unchecked, `holoserve eval CKPT --onnx` then scores it")
    return v


def verify_exports(art: Artifact, model, opts: ExportOptions, built: BuiltExport, tok, tmp: Path) -> dict:
    """{target: verification record} for each of `opts.targets`; raises ExportVerificationError on a
    failed check. `model` is the checkpoint as compress.checkpoint.load_model gives it (what `holoserve
    eval` runs)."""
    out: dict[str, dict] = {}
    poly = _polygraphy(art, built) if opts.polygraphy else None
    rows = check_rows(art, opts, tok)
    batches, labels = rows.batches, rows.labels
    ref = reference_logits(model, art, counted(batches, "verify: PyTorch fake-quant"))
    ref_metric = score(rows.task, ref, rows.ordered_labels()) if labels is not None else None
    ckpt_metric = ref_metric
    if built.lossy_embeddings:
        # int8 embeddings are not part of the checkpoint: check the export against the PyTorch model
        # with the same table (is the graph right?), and report the table's effect on its own.
        emb = model.get_input_embeddings().weight
        saved = emb.data.clone()
        try:
            import torch

            emb.data.copy_(torch.from_numpy(qdq.dequantized_embedding(saved.numpy())))
            ref = reference_logits(model, art, batches)
        finally:
            emb.data.copy_(saved)
        ref_metric = score(rows.task, ref, rows.ordered_labels()) if labels is not None else None
    for t in opts.targets:
        path = built.files[t]
        v: dict[str, Any] = {}
        v.update(checks.check_onnx(path))
        sess = checks.ort_session(path, threads=opts.threads)
        got = checks.ort_logits(sess, counted(batches, f"verify: {t} through ONNX Runtime"))
        v["parity_vs_pytorch_fakequant"] = checks.parity(got, ref) | {"rows_source": rows.source}
        if labels is not None:
            v["dev_metric_ort"] = score(rows.task, got, rows.ordered_labels())
            v["dev_metric_pytorch_fakequant"] = ref_metric
            if built.lossy_embeddings:
                v["dev_metric_checkpoint_numerics"] = ckpt_metric  # what `holoserve eval` computes
                v["reference_note"] = "PyTorch fake-quant reference uses the same int8 word-embedding table"
        # the numerics TensorRT QAT trained: model.trt.onnx must compute them
        if t == "tensorrt" and built.tensorrt_qat:
            ref_trt = reference_logits(model, art, batches, tensorrt=True)
            v["parity_vs_pytorch_tensorrt_qat"] = checks.parity(got, ref_trt) | {"rows_source": rows.source}
            if labels is not None:
                v["dev_metric_pytorch_tensorrt_qat"] = score(rows.task, ref_trt, rows.ordered_labels())
        if t == "tensorrt" and built.tensorrt_fp32 is not None:
            v.update(_verify_tensorrt_fp16(built.tensorrt_fp32, rows, got, ref, ref_metric, opts))
        if t == "openvino":
            v.update(_verify_openvino(path, rows, ref, opts.threads, opts.openvino_precision))
        if t == "onnxruntime":
            v.update(_verify_onnxruntime(path, rows, got, ref, ref_metric, len(built.sites), opts, tmp))
        if poly is not None:
            v["polygraphy_sparsity"] = poly
        out[t] = v
    return out
