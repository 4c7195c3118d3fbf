"""Export a HoloServe checkpoint to ONNX with QDQ nodes, verify it, and record it in the manifest.

Route: torch.onnx.export of the fp32 Hugging Face model (eager attention, so the attention
MatMuls are explicit nodes) -> locate the encoder Linears' weights by value -> rewrite with the
onnx library (export/qdq.py): int8 weight initializers + per-channel DequantizeLinear, Q/DQ on
activations with the manifest's calibrated ranges -> for the onnxruntime target, rewrite into
ONNX Runtime contrib ops (export/fusion.py): each QDQ Linear into MatMulIntegerToFloat with its
bias, a tanh GELU into FastGelu, each attention block into MultiHeadAttention; and the last layer
cut down to the [CLS] row the classifier reads (export/standard_rewrites.py) -> verify
(export/verify_export.py).

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
from holoserve.core.artifact import Artifact, add_files, load_artifact
from holoserve.core.files import atomic_copy, atomic_write_json, sweep_stale, temp_sibling
from holoserve.core.manifest import ONNXRUNTIME, OPENVINO, TENSORRT_ONNX
from holoserve.core.numerics import SQNR_CAP_DB, sqnr_db
from holoserve.core.ort import session as ort_session
from holoserve.core.progress import Progress, StepBar

from . import float16, fusion, qdq, standard_rewrites, verify
from .options import ExportOptions
from .reference import BUILTIN_SENTENCES, encode_batches, load_torch_model, make_tokenizer, quantized_layers, task_rows
from .verify_export import BuiltExport, verify_exports

OPSET = 17
TARGET_FILES = {"onnxruntime": "model.onnx", "tensorrt": "model.trt.onnx", "openvino": "model.ov.onnx"}
MANIFEST_KEYS = {"onnxruntime": ONNXRUNTIME, "tensorrt": TENSORRT_ONNX, "openvino": OPENVINO}
# the QDQ placement each target uses: OpenVINO's INT8 transformations take ONNX Runtime's (standard ops only)
PLACEMENT = {"onnxruntime": "onnxruntime", "tensorrt": "tensorrt", "openvino": "onnxruntime"}
FLOAT_FILE = "model.float.onnx"  # optional, with keep_float: fp32 export Polygraphy checks
CALIB_FILE = "model.calib.onnx"  # temporary: the onnxruntime placement before the contrib-op rewrites
TRT_FP32_FILE = "model.trt.fp32.onnx"  # temporary: the float32 TensorRT placement the float16 one is checked against


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
        self.data = opts.rows()
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
            found = task_rows(art, split, self.data, opts.calib_rows)
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
            fused_ops = {"float16": float16.to_float16(m)}
        if target == "onnxruntime":
            if "tensorrt" in self.opts.targets:
                onnx.save(m, str(self.calib_model))
            attention, fused_ops = self.rewrite_for_onnxruntime(m, len(rep.linears))
        elif target == "openvino":  # standard ops only; the exact [CLS]-row rewrite still applies
            attention = "standard ONNX ops (MatMul, Softmax)"
            fused_ops = {"classifier_row": standard_rewrites.keep_classifier_row(m, fusion.tensor_ranks(m))} \
                if self.opts.classifier_row else {}
            fused_ops["key_transposes_split"] = standard_rewrites.split_key_transposes(m)  # for OpenVINO's MatMul
        onnx.save(m, str(path))
        self.built[target] = path
        if target in self.opts.targets:
            self.result.entries[MANIFEST_KEYS[target]] = self.entry(target, path, m, rep, emb, attention, fused_ops,
                                                                    extra)

    def rewrite_for_onnxruntime(self, m, quantized_linears: int) -> tuple[Any, dict[str, Any]]:
        """The onnxruntime placement's rewrites, as the options ask: contrib ops (export/fusion.py), then
        the [CLS] row only (export/standard_rewrites.py)."""
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
            fused_ops["classifier_row"] = standard_rewrites.keep_classifier_row(m, ranks)
        return attention, fused_ops

    def entry(self, target: str, path: Path, m, rep, emb, attention, fused_ops, extra) -> dict[str, Any]:
        """The manifest's record of one ONNX file (holoserve.core.manifest.OnnxExport)."""
        entry = {
            "file": TARGET_FILES[target],
            "format": "onnx",
            "opset": float16.FP16_OPSET if target == "tensorrt" and self.trt_fp16 else OPSET,
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
        built = BuiltExport(files=dict(self.built), float_path=self.float_path, sites=self.sites,
                            sparse=frozenset(self.sparse), lossy_embeddings=self.emb_int8 and not self.lossless,
                            tensorrt_fp32=self.trt_fp32_path, tensorrt_qat=self.trt_as_trained)
        self.report["verification"] = verify_exports(self.art, ref_model, opts, built, self.tok, self.tmp)
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
