"""`ExportOptions`: everything `holoserve export` decides, built once (by the CLI, or from keywords by
`export_checkpoint`) and passed whole through the export and its verification."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from holoserve import HoloServeError

TARGETS = ("onnxruntime", "tensorrt", "openvino")
TENSORRT_PRECISIONS = ("fp16", "fp32")
EMBEDDINGS = ("auto", "int8", "fp32")


@dataclass(frozen=True)
class ExportOptions:
    """How `export_checkpoint` exports; the defaults are what `holoserve export` does.

    targets:         any of "onnxruntime" (model.onnx), "tensorrt" (model.trt.onnx), "openvino" (model.ov.onnx)
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
    The graph rewrites, each on by default: the onnxruntime target's contrib ops (export/fusion.py), and
    the [CLS] row (export/standard_rewrites.py), which the openvino target gets too:
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
            if t not in TARGETS:
                raise HoloServeError(f"unknown export target {t!r}: choose onnxruntime, tensorrt or openvino")
        from .qdq import RESIDUAL_MODES

        if self.tensorrt_residuals not in RESIDUAL_MODES:
            raise HoloServeError(f"unknown --tensorrt-residuals {self.tensorrt_residuals!r}: choose "
                                 + ", ".join(RESIDUAL_MODES))
        from holoserve.backends.openvino import check_precision

        check_precision(self.openvino_precision)
        if self.embeddings not in EMBEDDINGS:
            raise HoloServeError(f"--embeddings must be auto, int8 or fp32, not {self.embeddings!r}")
        if self.tensorrt_precision not in TENSORRT_PRECISIONS:
            raise HoloServeError(f"--tensorrt-precision must be fp16 or fp32, not {self.tensorrt_precision!r}")
        return self

    def rows(self):
        """The rows to read (holoserve.data.sources.DataOptions): `data`, else the GLUE shortcut in `data_dir`."""
        from holoserve.data.sources import DataOptions

        return self.data or DataOptions(data_dir=self.data_dir)
