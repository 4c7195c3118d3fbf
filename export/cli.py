"""`holoserve export CHECKPOINT`: ONNX with QDQ nodes for ONNX Runtime and/or TensorRT, verified.

Light module: heavy imports (torch, onnx) happen inside run().
"""
from __future__ import annotations

import argparse
import json

from holoserve.cli_options import add_data_arguments, advanced
from holoserve.core.choices import OPENVINO_PRECISIONS

TARGETS = ("onnxruntime", "tensorrt", "openvino", "all")


def add_arguments(p: argparse.ArgumentParser) -> None:
    adv = advanced(p)
    p.add_argument("checkpoint", help="checkpoint folder written by `holoserve compress`")
    p.add_argument("--target", choices=TARGETS, default="all",
                   help="onnxruntime: model.onnx (MatMul-only QDQ, uint8 activations, fused by ORT on CPU); "
                        "tensorrt: model.trt.onnx (QDQBERT placement for TensorRT); openvino: model.ov.onnx (the "
                        "onnxruntime placement in standard ops, for --backend openvino); all (default): every "
                        "target this install can serve (openvino where OpenVINO is installed), so that `serve "
                        "--backend auto` can choose among them")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write the files and export_report.json here instead of into the checkpoint "
                        "(default: into the checkpoint folder, recorded in its manifest)")
    p.add_argument("--data-dir", default=None,
                   help="GLUE data dir (or $HOLOSERVE_DATA_DIR): dev rows for the parity check, train rows for "
                        "calibrating the TensorRT-only ranges; without it built-in sentences are used and no "
                        "dev metric is checked")
    add_data_arguments(p, training=False)
    adv.add_argument("--dev-rows", type=int, default=None, help="limit the parity check to the first N dev rows")
    adv.add_argument("--calib-rows", type=int, default=256,
                   help="training rows used to calibrate the TensorRT-only tensor ranges (default 256)")
    p.add_argument("--max-metric-diff", type=float, default=None,
                   help="also fail if the ONNX Runtime dev metric differs from the PyTorch fake-quant model by more "
                        "than this many points. Without it the export fails when more than 1 %% of the dev predictions "
                        "change: float rounding alone flips a few borderline rows")
    p.add_argument("--tensorrt-precision", choices=("fp16", "fp32"), default="fp32",
                   help="float type of the tensorrt target outside its Q/DQ pairs (strongly typed TensorRT runs the "
                        "graph's own types): fp32 (default) or fp16 (LayerNormalization and Softmax stay fp32)")
    adv.add_argument("--tensorrt-residuals", choices=("auto", "int8", "float"), default="auto",
                     help="tensorrt target: which residual-Add inputs get INT8 Q/DQ. auto (default): each one whose "
                          "INT8 SQNR on the calibration rows is >= 20 dB (the others' GEMMs then write float); int8: "
                          "all (every GEMM INT8-out); float: none. Why auto: "
                          "docs/results/2026-11-24-tensorrt-placement.md")
    adv.add_argument("--openvino-precision", choices=OPENVINO_PRECISIONS, default="auto",
                     help="openvino target: the precision its check runs OpenVINO's float ops at; auto (default) is "
                          "OpenVINO's CPU default, bf16 on CPUs with bf16 units (a few predictions then differ from "
                          "`holoserve eval`), f32 the checkpoint's numerics. Serve with the same "
                          "--openvino-precision")
    adv.add_argument("--tensorrt-float-residuals", dest="tensorrt_residuals", action="store_const", const="float",
                     help="the same as --tensorrt-residuals float")
    p.add_argument("--embeddings", choices=("auto", "int8", "fp32"), default="auto",
                   help="word-embedding table storage: int8 + per-row scale (a quarter of the table's fp32 bytes), "
                        "a numeric change unless the checkpoint's table is already on that grid; auto (default) = "
                        "int8 only when lossless")
    adv.add_argument("--no-fuse-attention", action="store_true",
                   help="onnxruntime target: keep attention as standard ONNX ops instead of ONNX Runtime's "
                        "MultiHeadAttention contrib op (slower; docs/results/2026-11-22-cpu-latency.md)")
    adv.add_argument("--no-fuse-matmul", action="store_true",
                   help="onnxruntime target: keep QDQ MatMul + bias Add instead of MatMulIntegerToFloat with the "
                        "bias folded in (slower; docs/results/2026-11-22-cpu-latency.md)")
    adv.add_argument("--no-fuse-gelu", action="store_true",
                   help="onnxruntime target: keep a tanh-approximated GELU as elementwise ops instead of FastGelu")
    adv.add_argument("--no-classifier-row", action="store_true",
                   help="onnxruntime target: compute the last layer for every token instead of only the [CLS] row "
                        "the classifier reads (exact either way; slower; docs/results/2026-11-24-openvino.md)")
    adv.add_argument("--no-verify", action="store_true", help="skip checker/parity/fusion/Polygraphy checks")
    adv.add_argument("--no-polygraphy", action="store_true", help="skip `polygraphy inspect sparsity`")
    adv.add_argument("--keep-float", action="store_true",
                   help="also keep model.float.onnx (fp32 weights; what Polygraphy inspects)")
    adv.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads for the checks")
    adv.add_argument("--json", action="store_true", help="print the full export report as JSON")
    p.add_argument("--triton-repo", metavar="DIR", default=None,
                   help="also write this model into the Triton Inference Server model repository DIR (created if "
                        "missing; other models there are kept): a Python-backend model that takes text and runs "
                        "the ONNX Runtime export, plus token-id models for Triton's onnxruntime and TensorRT "
                        "backends (see docs/usage.md)")
    adv.add_argument("--triton-model-name", metavar="NAME", default=None,
                   help="the Triton model name (default: the checkpoint folder's name)")
    adv.add_argument("--triton-max-batch-size", type=int, default=32,
                   help="max_batch_size of the Triton models (default 32)")
    adv.add_argument("--triton-queue-delay-us", type=int, default=0,
                   help="dynamic_batching max_queue_delay_microseconds of the Triton models (default 0)")
    adv.add_argument("--triton-instances", type=int, default=1,
                   help="instance_group count of each Triton model (default 1)")


def all_targets() -> tuple[list[str], dict[str, str]]:
    """(the targets `--target all` writes, {target: why it is left out}): every one a backend of this
    install can serve; the TensorRT placement is plain ONNX, written for engines built elsewhere."""
    import importlib.util

    targets, left_out = ["onnxruntime", "tensorrt"], {}
    if importlib.util.find_spec("openvino") is not None:
        targets.append("openvino")
    else:
        left_out["openvino"] = "OpenVINO is not installed (pip install 'holoserve[openvino]')"
    return targets, left_out


def export_options(args: argparse.Namespace, targets: list[str]):
    """The parsed command line as the one ExportOptions the export and its verification read."""
    from holoserve.data.sources import data_options

    from .options import ExportOptions

    return ExportOptions(
        targets=tuple(targets),
        out_dir=args.out,
        data_dir=args.data_dir,
        data=data_options(args),
        dev_rows=args.dev_rows,
        calib_rows=args.calib_rows,
        verify_exports=not args.no_verify,
        polygraphy=not args.no_polygraphy,
        keep_float=args.keep_float,
        threads=args.threads,
        max_metric_diff=args.max_metric_diff,
        embeddings=args.embeddings,
        tensorrt_precision=args.tensorrt_precision,
        tensorrt_residuals=args.tensorrt_residuals,
        openvino_precision=args.openvino_precision,
        fuse_attention=not args.no_fuse_attention,
        fuse_matmul=not args.no_fuse_matmul,
        fuse_gelu=not args.no_fuse_gelu,
        classifier_row=not args.no_classifier_row,
    )


def run(args: argparse.Namespace) -> int:

    from .onnx_export import MANIFEST_KEYS, export_checkpoint

    targets, left_out = all_targets() if args.target == "all" else ([args.target], {})
    res = export_checkpoint(args.checkpoint, options=export_options(args, targets))
    triton = None
    if args.triton_repo:
        from .triton import write_triton_repo

        triton = write_triton_repo(
            res.checkpoint, args.triton_repo,
            model_name=args.triton_model_name,
            max_batch_size=args.triton_max_batch_size,
            max_queue_delay_us=args.triton_queue_delay_us,
            instances=args.triton_instances,
            # with --out the new files are beside the checkpoint, not recorded in it
            exports=res.entries if args.out else None,
            exports_dir=res.out_dir if args.out else None,
        )
    if left_out:
        res.report["targets_left_out"] = left_out
    if args.json:
        print(json.dumps(res.report | ({"triton_repo": triton.report()} if triton else {}), indent=2))
        return 0
    print(f"fp32 ONNX export: {res.report['fp32_bytes'] / 1e6:.1f} MB, {res.report['linears']} encoder Linears")
    for t in targets:
        e = res.entries[MANIFEST_KEYS[t]]
        emb = "int8" if isinstance(e.get("word_embeddings"), dict) else "fp32"
        print(f"{t}: {res.out_dir / e['file']}  {e['bytes'] / 1e6:.1f} MB ({e['size_ratio_vs_fp32']}x smaller "
              f"than fp32), {e['activation_qdq_pairs']} activation Q/DQ, {e['weight_dequantize']} int8 weights, "
              f"{emb} word embeddings")
        if isinstance(e.get("attention"), dict):
            print(f"  attention: {e['attention']['blocks']} blocks fused into {e['attention']['op']}")
        ops = e.get("fused_ops") or {}
        if ops.get("integer_matmuls"):
            mm = ops["integer_matmuls"]
            print(f"  Linears: {mm['matmuls']} written as MatMulIntegerToFloat, "
                  f"{mm['bias_folded']} with the bias folded in")
        if ops.get("fast_gelu"):
            print(f"  tanh GELU: {ops['fast_gelu']} written as FastGelu")
        if ops.get("classifier_row", {}).get("row_nodes"):
            cr = ops["classifier_row"]
            print(f"  classifier row: {cr['row_nodes']} nodes of the last layer(s) run on the [CLS] row only "
                  f"({cr['slices']} Slices)")
        v = e.get("verification")
        if not v:
            continue
        par = v["parity_vs_pytorch_fakequant"]
        line = f"  onnx.checker (full): {v['onnx_checker_full']}; vs PyTorch fake-quant on {par['rows_source']}: " \
               f"max |dlogit| {par['max_abs_diff']:.4g}"
        if "argmax_agreement" in par:
            line += f", argmax agreement {100 * par['argmax_agreement']:.2f}%"
        print(line)
        if "dev_metric_ort" in v:
            print(f"  dev metric ORT {v['dev_metric_ort']} vs PyTorch fake-quant {v['dev_metric_pytorch_fakequant']}")
        if "changed_predictions" in v:
            print(f"  dev predictions changed: {v['changed_predictions']} "
                  f"(allowed {v['allowed_changed_predictions']}); "
                  f"right only here {v['right_here_only']}, only in the PyTorch model {v['right_in_reference_only']} "
                  f"(McNemar p = {v['mcnemar_exact_p']:.3g})")
        if "parity_vs_pytorch_tensorrt_qat" in v:
            pq = v["parity_vs_pytorch_tensorrt_qat"]
            line = f"  vs the checkpoint's TensorRT QAT numerics: max |dlogit| {pq['max_abs_diff']:.4g}"
            if "argmax_agreement" in pq:
                line += f", argmax agreement {100 * pq['argmax_agreement']:.2f}%"
            if "dev_metric_pytorch_tensorrt_qat" in v:
                line += f"; their dev metric {v['dev_metric_pytorch_tensorrt_qat']}"
            print(line)
        if "dev_metric_checkpoint_numerics" in v:
            print(f"  (int8 word embeddings: the checkpoint's own numerics score "
                  f"{v['dev_metric_checkpoint_numerics']})")
        if "dev_metric_openvino" in v or "parity_openvino_vs_pytorch_fakequant" in v:
            po = v["parity_openvino_vs_pytorch_fakequant"]
            print(f"  OpenVINO: dev metric {v.get('dev_metric_openvino')}, argmax agreement "
                  f"{100 * po.get('argmax_agreement', float('nan')):.2f}%, GEMMs {v['openvino_gemm_precisions']}; "
                  f"sparse weights {v['openvino_sparse_weights']}")
            rows = v.get("openvino_vs_pytorch_fakequant_rows", {})
            if "mcnemar_exact_p" in rows:
                print(f"  OpenVINO vs PyTorch fake-quant, row by row: right only in OpenVINO "
                      f"{rows['right_here_only']}, "
                      f"only in PyTorch {rows['right_in_reference_only']} (McNemar p {rows['mcnemar_exact_p']:.2f})")
        elif "openvino" in v:
            print(f"  OpenVINO: {v['openvino']}")
        if "ort_fusion" in v:
            f = v["ort_fusion"]
            print(f"  ORT fused {f['fused_integer_matmuls']} QDQ MatMuls into integer kernels {f['fused_by_op']}")
        if "polygraphy_sparsity" in v:
            ps = v["polygraphy_sparsity"]
            print(f"  Polygraphy: {ps['encoder_weights_2of4']}/{ps['encoder_weights']} encoder weights 2:4 "
                  f"({ps['tensors_checked']} tensors checked)")
    for t, why in left_out.items():
        print(f"{t}: not written ({why})")
    if not args.out:
        print(f"recorded in {res.checkpoint / 'manifest.json'}")
    if triton:
        print(f"Triton model repository {triton.path}:")
        for name, m in triton.models.items():
            kind = f"backend {m['backend']}" if "backend" in m else f"platform {m['platform']}"
            print(f"  {name}: {kind}, {m['kind']}, inputs {', '.join(m['inputs'])}")
        for name, why in triton.skipped.items():
            print(f"  {name}: not written ({why})")
        for name in triton.removed:
            print(f"  {name}: removed (left by an earlier export)")
    return 0
