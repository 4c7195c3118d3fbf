"""Export a HoloServe checkpoint to ONNX with QDQ nodes, verify it, and record it in the manifest.

Route: torch.onnx.export of the fp32 Hugging Face model (eager attention, so the attention
MatMuls are explicit nodes) -> locate the encoder Linears' weights by value -> rewrite with the
onnx library (export/qdq.py): int8 weight initializers + per-channel DequantizeLinear, Q/DQ on
activations with the manifest's calibrated ranges -> for the onnxruntime target, rewrite into
ONNX Runtime contrib ops (export/fusion.py): each QDQ Linear into MatMulIntegerToFloat with its
bias, a tanh GELU into FastGelu, each attention block into MultiHeadAttention; and the last layer
cut down to the [CLS] row the classifier reads (export/standard_rewrites.py) -> verify
(export/verify.py).

Ranges of the tensors only the TensorRT placement quantizes (attention MatMul inputs, residual
Add inputs) are not in the manifest: they are calibrated here by running the ONNX Runtime
placement — which reproduces the checkpoint's fake-quant numerics — on rows of the task's
training split (max |x| over `calib_rows` rows), or on built-in sentences when no data dir is
given; the source is recorded in the manifest's export entry. The same rows measure each residual
input's INT8 SQNR, which decides whether it is quantized (`tensorrt_residuals="auto"`).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from holoserve import HoloServeError
from holoserve.core.artifact import Artifact, add_files, load_artifact
from holoserve.core.files import atomic_copy, atomic_write_json, sweep_stale, temp_sibling
from holoserve.core.manifest import ONNXRUNTIME, OPENVINO, TENSORRT_ONNX
from holoserve.core.numerics import SQNR_CAP_DB, sqnr_db
from holoserve.core.ort import session as ort_session
from holoserve.core.progress import Progress, StepBar

from . import checks, float16, fusion, qdq, standard_rewrites
from .options import ExportOptions
from .reference import BUILTIN_SENTENCES, encode_batches, load_torch_model, make_tokenizer, quantized_layers, task_rows
from .verify import BuiltExport, verify_exports

OPSET = 17
TARGET_FILES = {"onnxruntime": "model.onnx", "tensorrt": "model.trt.onnx", "openvino": "model.ov.onnx"}
MANIFEST_KEYS = {"onnxruntime": ONNXRUNTIME, "tensorrt": TENSORRT_ONNX, "openvino": OPENVINO}
# the QDQ placement each target uses: OpenVINO's INT8 transformations take ONNX Runtime's (standard ops only)
PLACEMENT = {"onnxruntime": "onnxruntime", "tensorrt": "tensorrt", "openvino": "onnxruntime"}
FLOAT_FILE = "model.float.onnx"  # optional, with keep_float: fp32 export Polygraphy checks
CALIB_FILE = "model.calib.onnx"  # temporary: the onnxruntime placement before the contrib-op rewrites
TRT_FP32_FILE = "model.trt.fp32.onnx"  # temporary: the float32 TensorRT placement the float16 one is checked against

log = logging.getLogger("holoserve.export")


@dataclass
class ExportResult:
    checkpoint: Path
    out_dir: Path
    files: dict[str, Path] = field(default_factory=dict)  # target -> written file
    entries: dict[str, dict] = field(default_factory=dict)  # manifest key -> export entry
    report: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- torch side


def torch_export_fp32(model, path: Path, opset: int = OPSET) -> None:
    """fp32 ONNX with dynamic batch/sequence axes (TorchScript-based exporter: fast and name-stable)."""
    import torch

    class _Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.m(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, return_dict=False
            )[0]

    ids = torch.ones(2, 16, dtype=torch.long)
    names = list(checks.INPUT_NAMES)
    axes = {k: {0: "batch", 1: "sequence"} for k in names} | {checks.OUTPUT_NAME: {0: "batch"}}
    import warnings

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _Logits(model), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(path),
            input_names=names, output_names=[checks.OUTPUT_NAME], dynamic_axes=axes,
            opset_version=opset, do_constant_folding=True, dynamo=False,
        )
    model.eval()  # the TorchScript exporter leaves the module in training mode (dropout on)
    _keep_all_inputs(path, names)


def _keep_all_inputs(path: Path, names: Sequence[str]) -> None:
    """Give the graph every input of the artifact contract, in order, even one the family never reads.

    The exporter drops an input nothing uses (DistilBERT and MPNet have no segment embeddings, so
    `token_type_ids` goes); putting it back as an unused [batch, sequence] int64 input keeps one
    input signature for every family (manifest, calibration feeds, serving backends, Triton)."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load(str(path))
    have = {i.name: i for i in m.graph.input}
    if all(n in have for n in names):
        return
    inputs = [have.get(n) or helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"]) for n in names]
    inputs += [i for i in m.graph.input if i.name not in names]
    del m.graph.input[:]
    m.graph.input.extend(inputs)
    onnx.save(m, str(path))


# ------------------------------------------------------------------------------------------- pipeline


def _extra_ranges(ort_onnx: Path, tensors: list[str], batches, trained: Mapping[str, float],
                  sqnr_of: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """Ranges for the TensorRT placement's extra `tensors` and the INT8 SQNR (dB) of those in `sqnr_of`,
    from the ORT-placement model (exact checkpoint numerics) over `batches`.

    A range is `trained` (TensorRT QAT) where the checkpoint has one, else max |x| over the batches.
    The SQNR, of the per-tensor int8 Q/DQ pair with that range over the batches' non-padding tokens,
    needs the final range, so it takes a second pass over the same session.
    """
    import onnx

    amax = {t: float(trained[t]) for t in tensors if t in trained}
    todo = [t for t in tensors if t not in amax]
    if not (todo or sqnr_of):
        return amax, {}
    m = onnx.load(str(ort_onnx))
    have = {o.name for o in m.graph.output}
    taps = list(dict.fromkeys(todo + list(sqnr_of)))
    for t in taps:
        if t not in have:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
    tmp = ort_onnx.with_suffix(".calib.onnx")
    onnx.save(m, str(tmp))
    try:
        sess = ort_session(tmp, threads=max(1, min(2, os.cpu_count() or 1)), optimize=False)
        if todo:
            found = {t: 0.0 for t in todo}
            for b in batches:
                for t, v in zip(todo, sess.run(todo, b)):
                    found[t] = max(found[t], float(np.abs(v).max()))
            amax.update({t: max(v, 1e-6) for t, v in found.items()})
        sums = {t: [0.0, 0.0] for t in sqnr_of}
        if sqnr_of:
            for b in batches:
                real = np.asarray(b["attention_mask"]).astype(bool)
                for t, v in zip(sqnr_of, sess.run(list(sqnr_of), b)):
                    signal, noise = qdq.int8_error(v[real] if v.shape[:2] == real.shape else v, amax[t])
                    sums[t][0] += signal
                    sums[t][1] += noise
    finally:
        tmp.unlink(missing_ok=True)
    sqnr = {t: sqnr_db(sg, n) for t, (sg, n) in sums.items()}
    return amax, sqnr


def export_checkpoint(checkpoint: str | os.PathLike, targets: Sequence[str] | None = None, *,
                      options: ExportOptions | None = None, **fields: Any) -> ExportResult:
    """Export, verify, and record the exports in the checkpoint (or write them to `out_dir`).

    `options` is the whole ExportOptions (what `holoserve export` builds); without it, the options are
    ExportOptions(targets=targets or ("onnxruntime",), **fields) (out_dir, data_dir, embeddings, ...).
    """
    if options is None:
        options = ExportOptions(targets=tuple(targets or ("onnxruntime",)), **fields)
    elif targets is not None or fields:
        raise TypeError("export_checkpoint: pass either options or targets and fields, not both")
    opts = options.validate()
    # load_artifact proves the weights are N:M and on the INT8 grid the manifest claims (ArtifactError)
    art = load_artifact(checkpoint)
    # Work beside the checkpoint (same filesystem: the files are renamed into place), in a folder named
    # for this process, so a killed export's leftovers are recognised and removed by the next writer.
    sweep_stale(art.path)
    try:
        tmp = temp_sibling(art.path, "export")
    except OSError:  # the checkpoint's parent is read-only (a mounted volume): work inside it
        tmp = Path(tempfile.mkdtemp(prefix=".holoserve-export-", dir=art.path))
    try:
        job = _job(art, opts, tmp)
        steps = ["export fp32"] + [f"build {t}" for t in opts.targets] + (["verify"] if opts.verify_exports else [])
        # an overall bar over the steps; each step (and the verification's passes over the rows) a phase
        with Progress(len(steps), enabled=opts.progress, desc="export") as progress:
            return _run(job, StepBar(progress))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# One export is a sequence of steps, each a function of what the earlier ones returned (frozen records):
# fp32 graph -> calibration rows -> one QDQ graph per placement (+ ONNX Runtime rewrites) -> verification
# -> files into place. A step takes what it reads as arguments, so it cannot run before that exists.


@dataclass(frozen=True)
class _Job:
    """What an export starts from: the checkpoint, the options, the work folder, and what they fix."""

    art: Artifact
    opts: ExportOptions
    tmp: Path
    layers: Sequence[str]  # the quantized encoder Linears
    weight_scales: Mapping[str, Any]  # layer -> per-output-channel weight scales
    act_amax: Mapping[str, float]  # the checkpoint's calibrated activation ranges
    data: Any  # the rows (holoserve.data.sources.DataOptions)

    @property
    def trt_fp16(self) -> bool:
        return "tensorrt" in self.opts.targets and self.opts.tensorrt_precision == "fp16"


def _job(art: Artifact, opts: ExportOptions, tmp: Path) -> _Job:
    layers = quantized_layers(art)
    return _Job(art, opts, tmp, layers, {k: art.weight_scales(k) for k in layers}, art.activation_amax(),
                opts.rows())


@dataclass(frozen=True)
class _Float:
    """The fp32 export and what the QDQ rewrites read from the PyTorch model."""

    path: Path  # the fp32 graph, weights renamed "<layer>.weight_t"
    weights: Mapping[str, np.ndarray]  # layer -> float weight, by which each Linear is found
    sites: Sequence[Any]  # qdq.LinearSite of each quantized Linear
    table: np.ndarray  # the word-embedding table
    emb_scales: Any  # its per-row scales, None unless the checkpoint quantized the table itself
    lossless: bool  # the table already sits on a per-row int8 grid
    emb_int8: bool  # the exports store the table as int8
    num_heads: int  # attention heads, for the fused attention op
    report: Mapping[str, Any]  # the export report's entries about the fp32 graph


@dataclass(frozen=True)
class _Rows:
    """The calibration rows, tokenized as the checks tokenize them."""

    tok: Any
    source: str  # how the manifest names the rows
    batches: list


@dataclass(frozen=True)
class _TensorRTRanges:
    """What the TensorRT placement quantizes beyond the Linear inputs, and with which ranges."""

    extra: Mapping[str, float]  # tensor -> range, for each extra tensor quantized
    float_residuals: list[str]  # residual-Add inputs left in float
    residuals: Mapping[str, Any]  # the manifest's residual_adds record
    as_trained: bool  # the placement quantizes exactly what the checkpoint's TensorRT QAT did
    report: Mapping[str, int]  # the export report's tensorrt_extra_ranges
    source: str  # the calibration rows the ranges not trained were measured on


@dataclass(frozen=True)
class _Placed:
    """One target's graph with its Q/DQ nodes and rewrites in, and what they did."""

    target: str
    model: Any  # the onnx ModelProto
    placement: Any  # qdq.apply_placement's report
    embeddings: Mapping[str, Any] | None  # qdq.quantize_embedding's record; None where the table stays float
    attention: Any = None  # how attention is computed, where the target's record says
    fused_ops: Mapping[str, Any] | None = None  # the rewrites applied, where the target's record says


@dataclass(frozen=True)
class _Built:
    """One built graph in the work folder."""

    path: Path
    entry: Mapping[str, Any] | None  # the manifest's record when the target was asked for, before verification
    calib_model: Path | None = None  # onnxruntime, where tensorrt is a target: the placement before its rewrites
    tensorrt: _TensorRTRanges | None = None
    tensorrt_fp32: Path | None = None  # tensorrt in float16, verified: the float32 graph it is checked against


def _run(job: _Job, bar: StepBar) -> ExportResult:
    opts = job.opts
    t0 = time.time()
    graph = _export_fp32(job, bar)
    bar.update(1)
    rows = _calibration_rows(job)
    built = _build_targets(job, graph, rows, bar)
    verification = None
    if opts.verify_exports:
        verification = _verify(job, graph, rows, built, bar)
        bar.update(1)
    bar.close()
    entries = {MANIFEST_KEYS[t]: dict(built[t].entry) | ({"verification": verification[t]} if verification else {})
               for t in ("onnxruntime", "tensorrt", "openvino") if t in opts.targets}
    report: dict[str, Any] = {"checkpoint": job.art.path.name, "targets": list(opts.targets), "opset": OPSET,
                              **graph.report}
    if "tensorrt" in built:
        report["tensorrt_extra_ranges"] = dict(built["tensorrt"].tensorrt.report)
    if verification is not None:
        report["verification"] = verification
    report["seconds"] = round(time.time() - t0, 1)
    report["exports"] = entries
    files = {TARGET_FILES[t]: built[t].path for t in opts.targets}
    if opts.keep_float:
        files[FLOAT_FILE] = graph.path
    result = ExportResult(Path(job.art.path), Path(opts.out_dir) if opts.out_dir else Path(job.art.path),
                          entries=entries, report=report)
    result.files = _install(job, files, entries, report)
    return result


def _export_fp32(job: _Job, bar: StepBar) -> _Float:
    import onnx

    bar.set_postfix_str("torch.onnx.export")
    path = job.tmp / FLOAT_FILE
    model = load_torch_model(job.art)
    torch_export_fp32(model, path)
    fp32 = onnx.load(str(path))
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    weights = {k: state[f"{k}.weight"] for k in job.layers}
    try:
        sites = qdq.find_linears(fp32, weights)
    except ValueError as e:
        raise HoloServeError(f"cannot export {job.art.path}: {e}") from None
    onnx.save(fp32, str(path))  # renamed weights: "<layer>.weight_t"
    table = model.get_input_embeddings().weight.detach().numpy()
    emb_scales = job.art.embedding_scales()  # None unless the checkpoint quantized the table itself
    lossless = qdq.embedding_is_int8_exact(table, emb_scales)
    emb = job.opts.embeddings
    emb_int8 = emb == "int8" or (emb == "auto" and lossless)
    report = {"word_embeddings": {"requested": emb, "int8": emb_int8, "int8_lossless": lossless},
              "fp32_bytes": path.stat().st_size, "linears": len(sites)}
    return _Float(path, weights, sites, table, emb_scales, lossless, emb_int8,
                  int(model.config.num_attention_heads), report)


def _calibration_rows(job: _Job) -> _Rows:
    art = job.art
    tok = make_tokenizer(art)
    found = split = None
    for split in ("train", "dev"):
        found = task_rows(art, split, job.data, job.opts.calib_rows)
        if found is not None:
            break
    if found is not None:
        _, texts, pairs, _ = found
        source = f"{art.task_name} {split} split, first {len(texts)} rows"
    else:
        texts, pairs = list(BUILTIN_SENTENCES), (list(BUILTIN_SENTENCES[::-1]) if art.is_pair else None)
        source = "builtin sentences"
    return _Rows(tok, source, [b for _, b in encode_batches(tok, texts, pairs, batch_size=32)])


def _build_targets(job: _Job, graph: _Float, rows: _Rows, bar: StepBar) -> dict[str, _Built]:
    """Each target's graph, in the order the steps need: the TensorRT placement is calibrated through the
    ONNX Runtime placement, which is built first (also when onnxruntime itself is not a target)."""
    targets = job.opts.targets
    built: dict[str, _Built] = {}
    if "onnxruntime" in targets or "tensorrt" in targets:
        built["onnxruntime"] = _build_onnxruntime(job, graph, bar)
        if "onnxruntime" in targets:
            bar.update(1)
    if "tensorrt" in targets:
        built["tensorrt"] = _build_tensorrt(job, graph, built["onnxruntime"].calib_model, rows, bar)
        bar.update(1)
    if "openvino" in targets:
        built["openvino"] = _build_openvino(job, graph, bar)
        bar.update(1)
    return built


def _float_graph(graph: _Float, target: str, bar: StepBar):
    """A fresh copy of the fp32 graph to place one target's Q/DQ nodes in, and its Linears."""
    import onnx

    bar.set_postfix_str(f"QDQ {target}")
    m = onnx.load(str(graph.path))
    return m, qdq.find_linears(m, graph.weights, rename=False)


def _quantize(job: _Job, graph: _Float, m, sites, target: str, ranges: _TensorRTRanges | None = None):
    """Place the target's Q/DQ nodes (and the int8 word embeddings where asked) in `m`: (placement report,
    embeddings record or None)."""
    placement = PLACEMENT[target]
    rep = qdq.apply_placement(m, sites, job.weight_scales, job.act_amax, placement,
                              ranges.extra if ranges else None,
                              float_tensors=ranges.float_residuals if ranges else [])
    emb = None
    if graph.emb_int8:
        emb = qdq.quantize_embedding(m, graph.table, lookup_first=placement == "onnxruntime",
                                     scales=graph.emb_scales)
    m.producer_name, m.producer_version = "holoserve", _version()
    return rep, emb


def _build_onnxruntime(job: _Job, graph: _Float, bar: StepBar) -> _Built:
    import onnx

    m, sites = _float_graph(graph, "onnxruntime", bar)
    rep, emb = _quantize(job, graph, m, sites, "onnxruntime")
    calib_model = None
    if "tensorrt" in job.opts.targets:
        # the TensorRT placement's extra tensors (attention MatMul inputs) exist only before the
        # contrib-op rewrites, so they are calibrated on this graph
        calib_model = job.tmp / CALIB_FILE
        onnx.save(m, str(calib_model))
    attention, fused_ops = _rewrite_for_onnxruntime(job, graph, m, len(rep.linears))
    return _save(job, graph, _Placed("onnxruntime", m, rep, emb, attention, fused_ops), calib_model=calib_model)


def _build_tensorrt(job: _Job, graph: _Float, calib_model: Path, rows: _Rows, bar: StepBar) -> _Built:
    import onnx

    m, sites = _float_graph(graph, "tensorrt", bar)
    ranges = _tensorrt_ranges(job, m, sites, calib_model, rows)
    rep, emb = _quantize(job, graph, m, sites, "tensorrt", ranges)
    fused_ops, fp32_path = None, None
    if job.trt_fp16:
        if job.opts.verify_exports:  # what the float16 graph is checked against
            fp32_path = job.tmp / TRT_FP32_FILE
            onnx.save(m, str(fp32_path))
        fused_ops = {"float16": float16.to_float16(m)}
    return _save(job, graph, _Placed("tensorrt", m, rep, emb, None, fused_ops), tensorrt=ranges,
                 tensorrt_fp32=fp32_path)


def _build_openvino(job: _Job, graph: _Float, bar: StepBar) -> _Built:
    m, sites = _float_graph(graph, "openvino", bar)
    rep, emb = _quantize(job, graph, m, sites, "openvino")
    # standard ops only; the exact [CLS]-row rewrite still applies
    attention = "standard ONNX ops (MatMul, Softmax)"
    fused_ops = {"classifier_row": standard_rewrites.keep_classifier_row(m, fusion.tensor_ranks(m))} \
        if job.opts.classifier_row else {}
    fused_ops["key_transposes_split"] = standard_rewrites.split_key_transposes(m)  # for OpenVINO's MatMul
    return _save(job, graph, _Placed("openvino", m, rep, emb, attention, fused_ops))


def _tensorrt_ranges(job: _Job, m, sites, calib_model: Path, rows: _Rows) -> _TensorRTRanges:
    """Which extra tensors the TensorRT placement quantizes (attention MatMul inputs, residual-Add inputs as
    `tensorrt_residuals` says) and their ranges: trained by the checkpoint's TensorRT QAT, else measured on
    the ONNX Runtime placement `calib_model` over the calibration rows."""
    mode = job.opts.tensorrt_residuals
    residual = qdq.residual_tensors(m, sites)
    wanted = sorted({p[0] for p in qdq.tensorrt_extra_tensors(m, sites, residual if mode == "float" else ())})
    trained = {t: v for t, v in qdq.trained_ranges(m, sites, job.act_amax).items()  # from TensorRT QAT
               if t in wanted}
    extra, sqnr = _extra_ranges(calib_model, wanted, rows.batches, trained, residual if mode == "auto" else [])
    qat = any(t not in residual for t in trained)  # a TensorRT-QAT checkpoint (Q/K/V ranges trained)
    if mode == "float":
        float_res = residual
    elif mode == "auto" and qat:  # what QAT trained: it left the inputs it stored no range for in float
        float_res = [t for t in residual if t not in trained]
    else:
        float_res = [t for t in residual
                     if mode == "auto" and sqnr.get(t, SQNR_CAP_DB) < qdq.RESIDUAL_MIN_SQNR_DB]
    extra = {t: v for t, v in extra.items() if t not in float_res}
    residuals: dict[str, Any] = {"mode": mode, "int8": len(residual) - len(float_res), "float": float_res}
    if mode == "auto":
        residuals.update(min_sqnr_db=qdq.RESIDUAL_MIN_SQNR_DB, sqnr_db=sqnr,
                         chosen_by="checkpoint's TensorRT QAT" if qat else "SQNR here")
    return _TensorRTRanges(
        extra=extra, float_residuals=float_res, residuals=residuals,
        # the placement is exactly what QAT trained: the export can check it against those numerics
        as_trained=qat and mode == "auto" and all(t in trained for t in extra),
        report={"from_checkpoint_qat": len(trained), "calibrated_here": sum(t not in trained for t in extra)},
        source=rows.source)


def _rewrite_for_onnxruntime(job: _Job, graph: _Float, m, quantized_linears: int) -> tuple[Any, dict[str, Any]]:
    """The onnxruntime placement's rewrites, as the options ask: contrib ops (export/fusion.py), then
    the [CLS] row only (export/standard_rewrites.py)."""
    opts, path = job.opts, job.art.path
    fused_ops: dict[str, Any] = {}
    ranks = fusion.tensor_ranks(m) if opts.classifier_row else {}  # before contrib ops hide shapes
    if opts.fuse_matmul:
        fused_ops["integer_matmuls"] = fusion.fuse_integer_matmuls(m)
        if fused_ops["integer_matmuls"]["matmuls"] != quantized_linears:
            raise HoloServeError(
                f"cannot write {path}'s quantized Linears as integer MatMuls: matched "
                f"{fused_ops['integer_matmuls']['matmuls']} of {quantized_linears} (pass --no-fuse-matmul "
                "to keep the QDQ form, which ONNX Runtime fuses itself)")
    if opts.fuse_gelu:
        fused_ops["fast_gelu"] = fusion.fuse_gelu_tanh(m)
    if opts.fuse_attention:
        heads = graph.num_heads
        try:
            fused = fusion.fuse_attention(m, heads)
        except ValueError as e:
            raise HoloServeError(f"cannot fuse attention in {path} (pass --no-fuse-attention "
                                 f"to keep standard ONNX ops): {e}") from None
        attention = {"op": f"{fusion.CONTRIB}.{fusion.FUSED_OP}", "blocks": fused, "num_heads": heads,
                     "key_padding_mask": "always: a row scores the same alone or padded in any batch"}
    else:
        attention = "standard ONNX ops (MatMul, Softmax)"
    if opts.classifier_row:
        fused_ops["classifier_row"] = standard_rewrites.keep_classifier_row(m, ranks)
    return attention, fused_ops


def _save(job: _Job, graph: _Float, placed: _Placed, **built: Any) -> _Built:
    """Write the target's graph into the work folder, with its manifest record where it is a target."""
    import onnx

    path = job.tmp / TARGET_FILES[placed.target]
    onnx.save(placed.model, str(path))
    entry = None
    if placed.target in job.opts.targets:
        entry = _entry(job, graph, placed, path, built.get("tensorrt"))
    return _Built(path, entry, **built)


def _entry(job: _Job, graph: _Float, placed: _Placed, path: Path, ranges: _TensorRTRanges | None) -> dict[str, Any]:
    """The manifest's record of one ONNX file (holoserve.core.manifest.OnnxExport)."""
    opts, target, rep = job.opts, placed.target, placed.placement
    fp16 = target == "tensorrt" and job.trt_fp16
    entry = {
        "file": TARGET_FILES[target],
        "format": "onnx",
        "opset": float16.FP16_OPSET if fp16 else OPSET,
        "placement": PLACEMENT[target],
        "inputs": {n: {"dtype": "int64", "shape": ["batch", "sequence"]} for n in checks.INPUT_NAMES},
        "outputs": {checks.OUTPUT_NAME: {"dtype": "float32", "shape": ["batch", job.art.num_labels]}},
        "weights": "int8 initializers, per-output-channel scales, zero-point 0, read by "
        + ("MatMulIntegerToFloat" if target == "onnxruntime" and opts.fuse_matmul else "DequantizeLinear"),
        "activations": "uint8 zero-point 128 (MatMul inputs only)" if PLACEMENT[target] == "onnxruntime"
        else "int8 zero-point 0 (Linear inputs, attention MatMul inputs"
        + (f", {ranges.residuals['int8']} of {ranges.residuals['int8'] + len(ranges.residuals['float'])} "
           "residual Add inputs)" if target == "tensorrt" else ")")
        + ("; float16 outside Q/DQ (float16 scales), LayerNormalization and Softmax in float32" if fp16 else ""),
        "quantized_linears": len(rep.linears),
        "activation_qdq_pairs": rep.activation_qdq,
        "weight_dequantize": rep.weight_dq,
        "bytes": path.stat().st_size,
        "size_ratio_vs_fp32": round(graph.report["fp32_bytes"] / path.stat().st_size, 3),
        "ops": qdq.count_ops(placed.model),
        "word_embeddings": placed.embeddings or "float32 (as in the checkpoint)",
    }
    if placed.attention is not None:
        entry["attention"] = placed.attention
    if placed.fused_ops is not None:
        entry["fused_ops"] = placed.fused_ops
    if ranges is not None:
        entry["extra_ranges"] = {
            "source": f"max |x| from the onnxruntime placement (checkpoint numerics) on {ranges.source}",
            "amax": {k: round(v, 6) for k, v in ranges.extra.items()},
        }
        entry["residual_adds"] = ranges.residuals
    return entry


def _verify(job: _Job, graph: _Float, rows: _Rows, built: Mapping[str, _Built], bar: StepBar) -> dict[str, Any]:
    """Each built graph against the PyTorch fake-quant model (export/verify.py): target -> record."""
    bar.set_postfix_str("verify")
    # the reference is exactly what `holoserve eval` runs: compress.checkpoint.load_model
    # (default attention kernel) + compress.quant.input_quantizers
    from holoserve.compress.checkpoint import load_model

    ref_model, _ = load_model(job.art, verify=False)
    trt = built.get("tensorrt")
    checked = BuiltExport(files={t: b.path for t, b in built.items()}, float_path=graph.path, sites=graph.sites,
                          sparse=frozenset(job.art.sparse_layers),
                          lossy_embeddings=graph.emb_int8 and not graph.lossless,
                          tensorrt_fp32=trt.tensorrt_fp32 if trt else None,
                          tensorrt_qat=trt.tensorrt.as_trained if trt else False)
    # every target is checked through ONNX Runtime's int8 GEMMs: where they are not exact on this CPU, say so
    # before the checks (which may refuse the export over that error) and in each record
    saturates = checks.int8_gemm_saturates()
    if saturates:
        log.warning("export verification: %s", checks.INT8_GEMM_SATURATES)
    records = verify_exports(job.art, ref_model, job.opts, checked, rows.tok, job.tmp)
    if saturates:
        for v in records.values():
            v["onnxruntime_int8_gemm"] = checks.INT8_GEMM_SATURATES
    return records


def _install(job: _Job, files: Mapping[str, Path], entries: Mapping[str, dict], report: Mapping[str, Any]
             ) -> dict[str, Path]:
    """Move the files into place: into out_dir with a report, or into the checkpoint and its manifest."""
    opts = job.opts
    if opts.out_dir:
        od = Path(opts.out_dir)
        od.mkdir(parents=True, exist_ok=True)
        for name, src in files.items():
            atomic_copy(src, od / name)
        atomic_write_json(od / "export_report.json", report)
        return {name: od / name for name in files}
    add_files(job.art, files, exports=entries)
    return {name: job.art.path / name for name in files}


def _version() -> str:
    from holoserve import __version__

    return __version__
