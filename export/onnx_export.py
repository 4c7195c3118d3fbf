"""Export a HoloServe checkpoint to ONNX with QDQ nodes, verify it, and record it in the manifest.

Route: torch.onnx.export of the fp32 Hugging Face model (eager attention, so the attention
MatMuls are explicit nodes) -> locate the encoder Linears' weights by value -> rewrite with the
onnx library (export/qdq.py): int8 weight initializers + per-channel DequantizeLinear, Q/DQ on
activations with the manifest's calibrated ranges -> for the onnxruntime target, rewrite into
ONNX Runtime contrib ops (export/fusion.py): each QDQ Linear into MatMulIntegerToFloat with its
bias, a tanh GELU into FastGelu, each attention block into MultiHeadAttention, and the last layer
cut down to the [CLS] row the classifier reads -> verify (export/verify.py).

Ranges of the tensors only the TensorRT placement quantizes (attention MatMul inputs, residual
Add inputs) are not in the manifest: they are calibrated here by running the ONNX Runtime
placement — which reproduces the checkpoint's fake-quant numerics — on rows of the task's
training split (max |x| over `calib_rows` rows), or on built-in sentences when no data dir is
given; the source is recorded in the manifest's export entry. The same rows measure each residual
input's INT8 SQNR, which decides whether it is quantized (`tensorrt_residuals="auto"`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from holoserve import HoloServeError
from holoserve.core.artifact import Artifact, ArtifactError, add_files, load_artifact
from holoserve.core.files import atomic_copy, atomic_write_json, sweep_stale, temp_sibling
from holoserve.core.manifest import ONNXRUNTIME, OPENVINO, TENSORRT_ONNX
from holoserve.core.numerics import SQNR_CAP_DB, sqnr_db
from holoserve.core.ort import session as ort_session
from holoserve.core.progress import Progress, StepBar, counted
from holoserve.core.progress import current as current_progress
from holoserve.core.tokenizer import load_tokenizer
from holoserve.data.metrics import compare_within_rounding, prediction_check, score
from holoserve.data.sources import DataOptions

from . import fusion, qdq, verify

OPSET = 17
TARGET_FILES = {"onnxruntime": "model.onnx", "tensorrt": "model.trt.onnx", "openvino": "model.ov.onnx"}
MANIFEST_KEYS = {"onnxruntime": ONNXRUNTIME, "tensorrt": TENSORRT_ONNX, "openvino": OPENVINO}
# the QDQ placement each target uses: OpenVINO's INT8 transformations take ONNX Runtime's (standard ops only)
PLACEMENT = {"onnxruntime": "onnxruntime", "tensorrt": "tensorrt", "openvino": "onnxruntime"}
FLOAT_FILE = "model.float.onnx"  # optional, with keep_float: fp32 export Polygraphy checks
CALIB_FILE = "model.calib.onnx"  # temporary: the onnxruntime placement before the contrib-op rewrites
TRT_FP32_FILE = "model.trt.fp32.onnx"  # temporary: the float32 TensorRT placement the float16 one is checked against
TENSORRT_PRECISIONS = ("fp16", "fp32")
# ONNX Runtime's CPU provider has no float16 kernel for these ops (1.32): it runs them in float32 between Casts
ORT_CPU_FP32_FALLBACK = ("MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Erf", "Tanh", "Softmax")

# Used for TensorRT-placement calibration when no GLUE data dir is available (documented fallback).
BUILTIN_SENTENCES = (
    "the movie was a delight from start to finish .",
    "a dull , lifeless and overlong film that never finds its footing .",
    "it 's not a great story , but the actors make it worth watching .",
    "i hated every minute of it .",
    "an honest , funny and surprisingly moving portrait of a family .",
    "the plot is thin and the acting is worse .",
    "one of the best films of the year .",
    "a man is playing a guitar on the street while a dog watches .",
    "the company said its profit rose in the third quarter .",
    "she was not sure whether the plane had taken off .",
    "this is the kind of film that gives the genre a bad name , and it knows it .",
    "great fun .",
    "they said the new car was too expensive for a family of four .",
    "the story is sad but never sentimental , and the ending is earned .",
    "awful .",
    "two children are riding a horse near the river .",
)


@dataclass
class ExportResult:
    checkpoint: Path
    out_dir: Path
    files: dict[str, Path] = field(default_factory=dict)  # target -> written file
    entries: dict[str, dict] = field(default_factory=dict)  # manifest key -> export entry
    report: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- inputs


def make_tokenizer(art: Artifact, max_length: int | None = None):
    """The checkpoint's tokenizer, padding each batch to its longest row (the export's fixed-shape batches)."""
    return load_tokenizer(art.path, max_length or art.max_seq_length, pad=True)


def encode_batches(tok, texts: Sequence[str], pairs: Sequence[str] | None = None, batch_size: int = 32):
    """Yield (indices, {input_ids, attention_mask, token_type_ids} int64) batches, grouped by length."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]) + (len(pairs[i]) if pairs else 0))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        if pairs:
            encs = tok.encode_batch([(texts[i], pairs[i]) for i in idx])
        else:
            encs = tok.encode_batch([texts[i] for i in idx])
        yield idx, {
            "input_ids": np.asarray([e.ids for e in encs], dtype=np.int64),
            "attention_mask": np.asarray([e.attention_mask for e in encs], dtype=np.int64),
            "token_type_ids": np.asarray([e.type_ids for e in encs], dtype=np.int64),
        }


def _rows(art: Artifact, split: str, data, limit: int | None):
    """(task, texts, pairs, labels) of a split for the checkpoint's task, or None when no rows were given."""
    from holoserve.data.sources import rows_for, trained_on_embedded
    from holoserve.data.tasks import task_of

    task = task_of(art)
    ex = rows_for(task, split, data, limit=limit, embedded=trained_on_embedded(art))
    if ex is None:
        return None
    return task, [e.text for e in ex], ([e.text_pair for e in ex] if task.is_pair else None), [e.label for e in ex]


EVAL_BATCH_SIZE = 128  # `holoserve eval`'s default --batch-size


def eval_batches_np(art: Artifact, split: str, data, limit: int | None = None, batch_size: int = EVAL_BATCH_SIZE):
    """(task, [(row indices, numpy batch)], labels) exactly as `holoserve eval` batches the split, or None."""
    from holoserve.compress.data import encode, eval_batches
    from holoserve.data.sources import rows_for, trained_on_embedded
    from holoserve.data.tasks import task_of

    task = task_of(art)
    rows = rows_for(task, split, data, limit=limit, embedded=trained_on_embedded(art))
    if rows is None:
        return None
    data = encode(load_tokenizer(art.path, art.max_seq_length), rows, task.is_regression)
    out = []
    for idx, b in eval_batches(data, batch_size):
        b.pop("labels")
        out.append((idx, {k: v.numpy() for k, v in b.items()}))
    return task, out, data.labels


# ------------------------------------------------------------------------------------------- torch side


def load_torch_model(art: Artifact):
    """The checkpoint as an fp32 HF model with eager attention (explicit attention MatMuls)."""
    try:
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise HoloServeError(f"export needs torch and transformers ({e}): pip install 'holoserve[export]'") from None
    hf_logging.disable_progress_bar()  # a bar per load is noise (and carriage returns in a log file)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(art.path), local_files_only=True, attn_implementation="eager"
    )
    model.eval()
    return model


def quantized_layers(art: Artifact) -> list[str]:
    q = art.manifest.quantization
    if not q:
        raise ArtifactError(
            f"{art.path}: the manifest has no INT8 quantization section; only compressed (INT8) checkpoints "
            "can be exported with QDQ nodes — run `holoserve compress` first"
        )
    if not (q.activations and q.activations.amax):
        raise ArtifactError(
            f"{art.path}: the manifest has no calibrated activation ranges (quantization.activations.amax); "
            "re-run `holoserve compress` (calibration) before exporting"
        )
    return list(q.weights.scales)


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
    names = list(verify.INPUT_NAMES)
    axes = {k: {0: "batch", 1: "sequence"} for k in names} | {verify.OUTPUT_NAME: {0: "batch"}}
    import warnings

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _Logits(model), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(path),
            input_names=names, output_names=[verify.OUTPUT_NAME], dynamic_axes=axes,
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


def reference_logits(model, art: Artifact, batches, *, tensorrt: bool = False) -> np.ndarray:
    """The checkpoint's fake-quant numerics in PyTorch (what `holoserve eval` computes); with `tensorrt`,
    also the extra quantizers TensorRT QAT trained (what its `model.trt.onnx` computes).

    Pass the model from compress.checkpoint.load_model, as `holoserve eval` does: the quantized
    network amplifies float noise (e.g. eager against SDPA attention flips a few predictions).
    """
    import contextlib

    import torch

    from holoserve.compress.quant import input_quantizers, tensorrt_quantizers

    layers = quantized_layers(art)
    amax = art.activation_amax()
    out = []
    with torch.no_grad(), input_quantizers(model, amax, layers, exact=True), \
            (tensorrt_quantizers(model, amax, layers) if tensorrt else contextlib.nullcontext()):
        for b in batches:
            out.append(model(**{k: torch.from_numpy(v) for k, v in b.items()}).logits.float().numpy())
    return np.concatenate(out, axis=0)


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


@dataclass(frozen=True)
class ExportOptions:
    """How `export_checkpoint` exports; the defaults are what `holoserve export` does.

    targets:         "onnxruntime" (model.onnx) and/or "tensorrt" (model.trt.onnx)
    out_dir:         write the files (plus export_report.json) there and leave the checkpoint untouched
    data / data_dir: the rows (holoserve.data.sources.DataOptions: the user's --train/--dev files, or a GLUE
                     shortcut's folder): training rows calibrate the TensorRT placement's extra ranges, dev
                     rows drive the parity check; without any, built-in sentences
    dev_rows / calib_rows / threads: the checks' rows and ORT threads
    check_predictions: refuse an export whose dev predictions through ONNX Runtime differ from the PyTorch
                     fake-quant model's by more than float rounding explains (metrics.prediction_check: at most
                     1 % of them changed); max_metric_diff adds a fixed bound (points)
    embeddings:      "fp32" keeps the word-embedding table as in the checkpoint; "int8" stores it as int8
                     + per-row scale (a smaller file, but a numeric change the checkpoint
                     does not have: verification then compares against the PyTorch model with the same
                     table and reports the effect against the checkpoint's own numerics separately);
                     "auto" uses int8 only when that is lossless (the table already sits on a per-row grid)
    The onnxruntime target's graph rewrites (export/fusion.py), each on by default:
    fuse_attention:  each eager attention block -> ONNX Runtime's MultiHeadAttention contrib op
    fuse_matmul:     each QDQ MatMul -> MatMulIntegerToFloat with the Linear's bias folded in
    fuse_gelu:       a tanh-approximated GELU (gelu_new, gelu_pytorch_tanh) -> FastGelu
    classifier_row:  the last layer computes only the [CLS] row the classifier reads (exact)
    tensorrt_precision: the tensorrt target's float type outside its Q/DQ pairs. A strongly typed TensorRT
                     network (TensorRT-RTX, TensorRT >= 11, or 10.12+ without the deprecated flags) runs the
                     graph's own types: "fp16" writes a float16 graph (float16 Q/DQ scales, LayerNormalization
                     and Softmax in float32, float32 logits, opset 19), "fp32" (default) the float32 graph
    tensorrt_residuals: which residual-Add inputs the tensorrt target quantizes (qdq.RESIDUAL_MODES).
                     "int8": all, so the attention-output and FFN-output GEMMs are INT8-in/INT8-out; "float":
                     none; "auto" (default): each input whose per-tensor INT8 SQNR on the calibration rows is
                     at least qdq.RESIDUAL_MIN_SQNR_DB (the others' GEMMs then write float); for a checkpoint
                     made with TensorRT QAT, exactly the inputs QAT quantized (it applies the same floor at its
                     calibration). Why auto: docs/results/2026-11-24-tensorrt-placement.md; whether TensorRT
                     still picks sparse INT8 tactics for a GEMM that writes float is unmeasured
    openvino_precision: the precision the openvino target's check runs OpenVINO's float ops at
                     (holoserve.backends.openvino.PRECISIONS; "auto" = OpenVINO's CPU default, bf16 where the
                     CPU has bf16 units; "f32" = the checkpoint's numerics); serve with the same setting
    """

    targets: tuple[str, ...] = ("onnxruntime",)
    out_dir: str | os.PathLike | None = None
    data_dir: str | os.PathLike | None = None
    data: Any = None  # holoserve.data.sources.DataOptions; default: the GLUE shortcut in data_dir
    dev_rows: int | None = None
    calib_rows: int = 256
    verify_exports: bool = True
    polygraphy: bool = True
    keep_float: bool = False
    threads: int = 1
    progress: bool = True
    check_predictions: bool = True
    max_metric_diff: float | None = None
    embeddings: str = "auto"
    fuse_attention: bool = True
    fuse_matmul: bool = True
    fuse_gelu: bool = True
    classifier_row: bool = True
    tensorrt_precision: str = "fp32"
    tensorrt_residuals: str = "auto"
    openvino_precision: str = "auto"

    def validate(self) -> "ExportOptions":
        for t in self.targets:
            if t not in TARGET_FILES:
                raise HoloServeError(f"unknown export target {t!r}: choose onnxruntime, tensorrt or all")
        if self.tensorrt_residuals not in qdq.RESIDUAL_MODES:
            raise HoloServeError(f"unknown --tensorrt-residuals {self.tensorrt_residuals!r}: choose "
                                 + ", ".join(qdq.RESIDUAL_MODES))
        from holoserve.backends.openvino import check_precision

        check_precision(self.openvino_precision)
        if self.embeddings not in ("auto", "int8", "fp32"):
            raise HoloServeError(f"--embeddings must be auto, int8 or fp32, not {self.embeddings!r}")
        if self.tensorrt_precision not in TENSORRT_PRECISIONS:
            raise HoloServeError(f"--tensorrt-precision must be fp16 or fp32, not {self.tensorrt_precision!r}")
        return self


def export_checkpoint(checkpoint: str | os.PathLike, targets: Sequence[str] = ("onnxruntime",), **options: Any
                      ) -> ExportResult:
    """Export `targets` ("onnxruntime", "tensorrt"), verify, and record them in the checkpoint.

    `options` are the fields of ExportOptions (out_dir, data_dir, embeddings, fuse_attention, ...).
    """
    opts = ExportOptions(targets=tuple(targets), **options).validate()
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
        return _Export(art, opts, tmp).run()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Export:
    """One export, as explicit steps over explicit state: fp32 graph -> calibration rows -> one QDQ graph
    per placement (+ ONNX Runtime rewrites) -> verification -> files into place."""

    def __init__(self, art: Artifact, opts: ExportOptions, tmp: Path):
        self.art, self.opts, self.tmp = art, opts, tmp
        self.layers = quantized_layers(art)
        self.sparse = set(art.sparse_layers)
        self.weight_scales = {k: art.weight_scales(k) for k in self.layers}
        self.act_amax = art.activation_amax()
        self.data = opts.data or DataOptions(data_dir=opts.data_dir)
        self.result = ExportResult(Path(art.path), Path(opts.out_dir) if opts.out_dir else Path(art.path))
        self.report: dict[str, Any] = {"checkpoint": art.path.name, "targets": list(opts.targets), "opset": OPSET}
        self.float_path = tmp / FLOAT_FILE
        # the onnxruntime placement before its contrib-op rewrites: the TensorRT placement's extra
        # tensors (attention MatMul inputs) exist only there, so they are calibrated on it
        self.calib_model = tmp / CALIB_FILE
        self.built: dict[str, Path] = {}
        self.trt_fp16 = "tensorrt" in opts.targets and opts.tensorrt_precision == "fp16"
        self.trt_fp32_path = tmp / TRT_FP32_FILE if self.trt_fp16 and opts.verify_exports else None
        self.trt_as_trained = False  # the tensorrt placement quantizes exactly what the checkpoint's TensorRT QAT did

    def run(self) -> ExportResult:
        opts = self.opts
        steps = ["export fp32"] + [f"build {t}" for t in opts.targets] + (["verify"] if opts.verify_exports else [])
        # an overall bar over the steps; each step (and the verification's passes over the rows) a phase
        with Progress(len(steps), enabled=opts.progress, desc="export") as progress:
            self.bar = StepBar(progress)
            return self._run()

    def _run(self) -> ExportResult:
        opts = self.opts
        t0 = time.time()
        self.export_fp32()
        self.bar.update(1)
        self.calibration_rows()
        # the TensorRT placement is calibrated through the ORT placement, which is built first
        for target in ("onnxruntime", "tensorrt", "openvino"):
            if target in opts.targets or (target == "onnxruntime" and "tensorrt" in opts.targets):
                self.build(target)
                if target in opts.targets:
                    self.bar.update(1)
        if opts.verify_exports:
            self.verify()
            self.bar.update(1)
        self.bar.close()
        self.report["seconds"] = round(time.time() - t0, 1)
        self.report["exports"] = self.result.entries
        self.install()
        self.result.report = self.report
        return self.result

    # -- steps
    def export_fp32(self) -> None:
        import onnx

        self.bar.set_postfix_str("torch.onnx.export")
        self.model = load_torch_model(self.art)
        torch_export_fp32(self.model, self.float_path)
        fp32 = onnx.load(str(self.float_path))
        state = {k: v.detach().numpy() for k, v in self.model.state_dict().items()}
        self.weights = {k: state[f"{k}.weight"] for k in self.layers}
        try:
            self.sites = qdq.find_linears(fp32, self.weights)
        except ValueError as e:
            raise HoloServeError(f"cannot export {self.art.path}: {e}") from None
        onnx.save(fp32, str(self.float_path))  # renamed weights: "<layer>.weight_t"
        self.table = self.model.get_input_embeddings().weight.detach().numpy()
        self.emb_scales = self.art.embedding_scales()  # None unless the checkpoint quantized the table itself
        self.lossless = qdq.embedding_is_int8_exact(self.table, self.emb_scales)
        emb = self.opts.embeddings
        self.emb_int8 = emb == "int8" or (emb == "auto" and self.lossless)
        self.report["word_embeddings"] = {"requested": emb, "int8": self.emb_int8, "int8_lossless": self.lossless}
        self.report["fp32_bytes"] = self.float_path.stat().st_size
        self.report["linears"] = len(self.sites)

    def calibration_rows(self) -> None:
        art, opts = self.art, self.opts
        self.tok = make_tokenizer(art)
        found = split = None
        for split in ("train", "dev"):
            found = _rows(art, split, self.data, opts.calib_rows)
            if found is not None:
                break
        if found is not None:
            _, texts, pairs, _ = found
            self.calib_source = f"{art.task_name} {split} split, first {len(texts)} rows"
        else:
            texts, pairs = list(BUILTIN_SENTENCES), (list(BUILTIN_SENTENCES[::-1]) if art.is_pair else None)
            self.calib_source = "builtin sentences"
        self.calib_batches = [b for _, b in encode_batches(self.tok, texts, pairs, batch_size=32)]

    def build(self, target: str) -> None:
        import onnx

        self.bar.set_postfix_str(f"QDQ {target}")
        m = onnx.load(str(self.float_path))
        sites = qdq.find_linears(m, self.weights, rename=False)
        extra, float_res = None, []
        if target == "tensorrt":
            mode = self.opts.tensorrt_residuals
            residual = qdq.residual_tensors(m, sites)
            wanted = sorted({p[0] for p in qdq.tensorrt_extra_tensors(m, sites, residual if mode == "float" else ())})
            trained = {t: v for t, v in qdq.trained_ranges(m, sites, self.act_amax).items()  # from TensorRT QAT
                       if t in wanted}
            extra, sqnr = _extra_ranges(self.calib_model, wanted, self.calib_batches, trained,
                                        residual if mode == "auto" else [])
            qat = any(t not in residual for t in trained)  # a TensorRT-QAT checkpoint (Q/K/V ranges trained)
            if mode == "float":
                float_res = residual
            elif mode == "auto" and qat:  # what QAT trained: it left the inputs it stored no range for in float
                float_res = [t for t in residual if t not in trained]
            else:
                float_res = [t for t in residual
                             if mode == "auto" and sqnr.get(t, SQNR_CAP_DB) < qdq.RESIDUAL_MIN_SQNR_DB]
            extra = {t: v for t, v in extra.items() if t not in float_res}
            # the placement is exactly what QAT trained: the export can check it against those numerics
            self.trt_as_trained = qat and mode == "auto" and all(t in trained for t in extra)
            self.report["tensorrt_extra_ranges"] = {"from_checkpoint_qat": len(trained),
                                                    "calibrated_here": sum(t not in trained for t in extra)}
            self.residuals = {"mode": mode, "int8": len(residual) - len(float_res), "float": float_res}
            if mode == "auto":
                self.residuals.update(min_sqnr_db=qdq.RESIDUAL_MIN_SQNR_DB, sqnr_db=sqnr,
                                      chosen_by="checkpoint's TensorRT QAT" if qat else "SQNR here")
        placement = PLACEMENT[target]
        rep = qdq.apply_placement(m, sites, self.weight_scales, self.act_amax, placement, extra,
                                  float_tensors=float_res)
        emb = None
        if self.emb_int8:
            emb = qdq.quantize_embedding(m, self.table, lookup_first=placement == "onnxruntime",
                                         scales=self.emb_scales)
        m.producer_name, m.producer_version = "holoserve", _version()
        path = self.tmp / TARGET_FILES[target]
        attention, fused_ops = None, None
        if target == "tensorrt" and self.trt_fp16:
            if self.trt_fp32_path is not None:  # what the float16 graph is checked against
                onnx.save(m, str(self.trt_fp32_path))
            fused_ops = {"float16": qdq.to_float16(m)}
        if target == "onnxruntime":
            if "tensorrt" in self.opts.targets:
                onnx.save(m, str(self.calib_model))
            attention, fused_ops = self.rewrite_for_onnxruntime(m, len(rep.linears))
        elif target == "openvino":  # standard ops only; the exact [CLS]-row rewrite still applies
            attention = "standard ONNX ops (MatMul, Softmax)"
            fused_ops = {"classifier_row": fusion.keep_classifier_row(m, fusion.tensor_ranks(m))} \
                if self.opts.classifier_row else {}
            fused_ops["key_transposes_split"] = fusion.split_key_transposes(m)  # for OpenVINO's MatMul
        onnx.save(m, str(path))
        self.built[target] = path
        if target in self.opts.targets:
            self.result.entries[MANIFEST_KEYS[target]] = self.entry(target, path, m, rep, emb, attention, fused_ops,
                                                                    extra)

    def rewrite_for_onnxruntime(self, m, quantized_linears: int) -> tuple[Any, dict[str, Any]]:
        """The onnxruntime placement's contrib-op rewrites (export/fusion.py), as the options ask."""
        opts, path = self.opts, self.art.path
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
            heads = int(self.model.config.num_attention_heads)
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
            fused_ops["classifier_row"] = fusion.keep_classifier_row(m, ranks)
        return attention, fused_ops

    def entry(self, target: str, path: Path, m, rep, emb, attention, fused_ops, extra) -> dict[str, Any]:
        """The manifest's record of one ONNX file (holoserve.core.manifest.OnnxExport)."""
        entry = {
            "file": TARGET_FILES[target],
            "format": "onnx",
            "opset": qdq.FP16_OPSET if target == "tensorrt" and self.trt_fp16 else OPSET,
            "placement": PLACEMENT[target],
            "inputs": {n: {"dtype": "int64", "shape": ["batch", "sequence"]} for n in verify.INPUT_NAMES},
            "outputs": {verify.OUTPUT_NAME: {"dtype": "float32", "shape": ["batch", self.art.num_labels]}},
            "weights": "int8 initializers, per-output-channel scales, zero-point 0, read by "
            + ("MatMulIntegerToFloat" if target == "onnxruntime" and self.opts.fuse_matmul else "DequantizeLinear"),
            "activations": "uint8 zero-point 128 (MatMul inputs only)" if PLACEMENT[target] == "onnxruntime"
            else "int8 zero-point 0 (Linear inputs, attention MatMul inputs"
            + (f", {self.residuals['int8']} of {self.residuals['int8'] + len(self.residuals['float'])} residual Add "
               "inputs)" if target == "tensorrt" else ")")
            + ("; float16 outside Q/DQ (float16 scales), LayerNormalization and Softmax in float32"
               if target == "tensorrt" and self.trt_fp16 else ""),
            "quantized_linears": len(rep.linears),
            "activation_qdq_pairs": rep.activation_qdq,
            "weight_dequantize": rep.weight_dq,
            "bytes": path.stat().st_size,
            "size_ratio_vs_fp32": round(self.report["fp32_bytes"] / path.stat().st_size, 3),
            "ops": qdq.count_ops(m),
            "word_embeddings": emb or "float32 (as in the checkpoint)",
        }
        if attention is not None:
            entry["attention"] = attention
        if fused_ops is not None:
            entry["fused_ops"] = fused_ops
        if target == "tensorrt":
            entry["extra_ranges"] = {
                "source": f"max |x| from the onnxruntime placement (checkpoint numerics) on {self.calib_source}",
                "amax": {k: round(v, 6) for k, v in extra.items()},
            }
            entry["residual_adds"] = self.residuals
        return entry

    def verify(self) -> None:
        opts = self.opts
        self.bar.set_postfix_str("verify")
        # the reference is exactly what `holoserve eval` runs: compress.checkpoint.load_model
        # (default attention kernel) + compress.quant.input_quantizers
        from holoserve.compress.checkpoint import load_model

        ref_model, _ = load_model(self.art, verify=False)
        del self.model
        self.report["verification"] = _verify(
            self.art, ref_model, self.built, opts.targets, self.float_path, self.sites, self.sparse, self.tok,
            self.data, opts.dev_rows, opts.threads, self.tmp, opts.polygraphy,
            opts.max_metric_diff, self.emb_int8 and not self.lossless,
            tensorrt_fp32=self.trt_fp32_path, check_predictions=opts.check_predictions,
            openvino_precision=opts.openvino_precision, tensorrt_qat=self.trt_as_trained,
        )
        for t in opts.targets:
            self.result.entries[MANIFEST_KEYS[t]]["verification"] = self.report["verification"][t]

    def install(self) -> None:
        """Move the files into place: into out_dir with a report, or into the checkpoint and its manifest."""
        opts, result = self.opts, self.result
        files = {TARGET_FILES[t]: self.built[t] for t in opts.targets}
        if opts.keep_float:
            files[FLOAT_FILE] = self.float_path
        if opts.out_dir:
            od = Path(opts.out_dir)
            od.mkdir(parents=True, exist_ok=True)
            for name, src in files.items():
                atomic_copy(src, od / name)
                result.files[name] = od / name
            atomic_write_json(od / "export_report.json", self.report)
        else:
            add_files(self.art, files, exports=result.entries)
            result.files = {name: self.art.path / name for name in files}


def _version() -> str:
    from holoserve import __version__

    return __version__


def _verify_openvino(path, batches, ref, rows_source, threads, task, labels, order, precision="auto") -> dict:
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
                          for b in counted(batches, "verify: openvino through OpenVINO")])
    out = {"parity_openvino_vs_pytorch_fakequant": verify.parity(got, ref) | {"rows_source": rows_source},
           "openvino_gemm_precisions": gemm_precisions(compiled), "openvino_sparse_weights": sparse,
           "openvino_inference_precision": inference_precision(compiled)}
    if labels is not None:
        ordered = np.asarray(labels)[order]
        out["dev_metric_openvino"] = score(task, got, ordered)
        # borderline rows move both ways under bf16: whether the accuracy differs, not just the rows; the
        # rounding verdict is recorded, not enforced (bf16 changes more rows than rounding does)
        out["openvino_vs_pytorch_fakequant_rows"] = compare_within_rounding(task, got, ref, ordered)
    return out


def _verify_tensorrt_fp16(fp32_path, threads, batches, got, ref, rows_source, task, labels, order, ref_metric,
                          check_predictions, max_metric_diff) -> dict:
    """The float16 TensorRT graph against the same placement in float32 (the effect of float16 alone).

    Refuses the export when float16 measurably changes the dev accuracy (metrics.prediction_check with
    precision_change, and `max_metric_diff` as a further bound; pass --tensorrt-precision fp32 then)."""
    fp32 = verify.ort_logits(verify.ort_session(fp32_path, threads=threads), batches)
    out: dict[str, Any] = {
        "precision": "float16 outside Q/DQ; LayerNormalization and Softmax in float32",
        "parity_vs_fp32_placement": verify.parity(got, fp32) | {"rows_source": rows_source},
        "parity_fp32_placement_vs_pytorch_fakequant": verify.parity(fp32, ref),
        "ort_float16_note": "ONNX Runtime's CPU provider has no float16 kernel for "
        + ", ".join(ORT_CPU_FP32_FALLBACK) + ": it computes them in float32 between Casts, so this check covers the "
        "float16 weights, scales, constants and Q/DQ, not float16 accumulation (TensorRT's float16 kernels)",
    }
    if labels is not None:
        y = np.asarray(labels)[order]
        m16, m32 = score(task, got, y), score(task, fp32, y)
        key = task.primary_metric
        check, why = prediction_check(task, got, fp32, y, max_metric_diff, precision_change=True)
        out["dev_metric_ort_fp32_placement"] = m32
        out["dev_metric_diff_points_vs_fp32_placement"] = check.pop("dev_metric_diff_points")
        out["vs_fp32_placement"] = check
        out["dev_metric_diff_points"] = round(100.0 * abs(m16[key] - ref_metric[key]), 4)
        if check_predictions and why:
            raise verify.ExportVerificationError(
                f"the float16 TensorRT graph through ONNX Runtime (dev {key} {100 * m16[key]:.2f}) against the "
                f"float32 one ({100 * m32[key]:.2f}): {why}; export it with --tensorrt-precision fp32")
    return out


def _verify(art, model, built, targets, float_path, sites, sparse, tok, data, dev_rows, threads, tmp,
            polygraphy, max_metric_diff, lossy_embeddings=False, tensorrt_fp32=None, openvino_precision="auto",
            tensorrt_qat=False, check_predictions=True) -> dict:
    out: dict[str, dict] = {}
    # Polygraphy on the float-weight export: every sparse encoder weight must be 2:4 along K.
    poly = None
    if polygraphy and art.nm == (2, 4):
        expected = [s.weight for s in sites if s.layer in sparse]
        with current_progress().phase("verify: Polygraphy 2:4 check", None, weight=0.0):
            poly = verify.polygraphy_sparsity(float_path, expected)
        if not poly["all_encoder_weights_2of4"]:
            raise verify.ExportVerificationError(
                f"Polygraphy found encoder weights that are not 2:4 although the manifest says so: "
                f"{poly['encoder_weights_not_2of4'] or poly['encoder_weights_not_reported']}"
            )
    # rows for parity
    dev = eval_batches_np(art, "dev", data, dev_rows)
    if dev is not None:
        # The very batches `holoserve eval` scores (same tokenizer settings, length order and padding):
        # a quantized network turns float noise from a different padding into a few flipped rows, so
        # only identical batches make "ORT metric vs holoserve eval" a statement about the export.
        task, idx_batches, labels = dev
        rows_source = f"{task.name} dev, {len(labels)} rows, batches of {EVAL_BATCH_SIZE} as in holoserve eval"
    else:
        task, labels = None, None
        texts, pairs = list(BUILTIN_SENTENCES), (list(BUILTIN_SENTENCES[::-1]) if art.is_pair else None)
        idx_batches = list(encode_batches(tok, texts, pairs, batch_size=32))
        rows_source = "builtin sentences (no dev rows given)"
    order = np.concatenate([np.asarray(i) for i, _ in idx_batches])
    batches = [b for _, b in idx_batches]
    ref = reference_logits(model, art, counted(batches, "verify: PyTorch fake-quant"))
    ref_metric = score(task, ref, np.asarray(labels)[order]) if labels is not None else None
    ckpt_metric = ref_metric
    if lossy_embeddings:
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
        ref_metric = score(task, ref, np.asarray(labels)[order]) if labels is not None else None
    for t in targets:
        path = built[t]
        v: dict[str, Any] = {}
        v.update(verify.check_onnx(path))
        sess = verify.ort_session(path, threads=threads)
        got = verify.ort_logits(sess, counted(batches, f"verify: {t} through ONNX Runtime"))
        v["parity_vs_pytorch_fakequant"] = verify.parity(got, ref) | {"rows_source": rows_source}
        if labels is not None:
            v["dev_metric_ort"] = score(task, got, np.asarray(labels)[order])
            v["dev_metric_pytorch_fakequant"] = ref_metric
            if lossy_embeddings:
                v["dev_metric_checkpoint_numerics"] = ckpt_metric  # what `holoserve eval` computes
                v["reference_note"] = "PyTorch fake-quant reference uses the same int8 word-embedding table"
        if t == "tensorrt" and tensorrt_qat:  # the numerics TensorRT QAT trained: model.trt.onnx must compute them
            ref_trt = reference_logits(model, art, batches, tensorrt=True)
            v["parity_vs_pytorch_tensorrt_qat"] = verify.parity(got, ref_trt) | {"rows_source": rows_source}
            if labels is not None:
                v["dev_metric_pytorch_tensorrt_qat"] = score(task, ref_trt, np.asarray(labels)[order])
        if t == "tensorrt" and tensorrt_fp32 is not None:
            v.update(_verify_tensorrt_fp16(tensorrt_fp32, threads, batches, got, ref, rows_source, task, labels, order,
                                           ref_metric, check_predictions, max_metric_diff))
        if t == "openvino":
            v.update(_verify_openvino(path, batches, ref, rows_source, threads, task, labels, order,
                                      openvino_precision))
        if t == "onnxruntime":
            fused = verify.fused_matmuls(path, tmp)
            v["ort_fusion"] = fused
            if fused["fused_integer_matmuls"] < len(sites):
                raise verify.ExportVerificationError(
                    f"ONNX Runtime fused only {fused['fused_integer_matmuls']} of {len(sites)} QDQ MatMuls into "
                    "integer kernels; the export would run in float"
                )
            if labels is not None:
                key = task.primary_metric
                check, why = prediction_check(task, got, ref, np.asarray(labels)[order], max_metric_diff)
                v.update(check)
                if check_predictions and why:
                    raise verify.ExportVerificationError(
                        f"the export does not reproduce the checkpoint: on dev through ONNX Runtime ({key} "
                        f"{100 * v['dev_metric_ort'][key]:.2f}) against the PyTorch fake-quant model "
                        f"({100 * ref_metric[key]:.2f}), {why}. Nothing was written; `holoserve export --no-verify` "
                        "writes it unchecked, `holoserve eval CKPT --onnx` then scores it")
        if poly is not None:
            v["polygraphy_sparsity"] = poly
        out[t] = v
    return out
