"""`holoserve build-engine ONNX_OR_CHECKPOINT`: a TensorRT engine with INT8 + sparse weights and its sidecar.

Light module: TensorRT is imported only inside run().
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from holoserve.cli_options import advanced


def add_arguments(p: argparse.ArgumentParser) -> None:
    adv = advanced(p)
    p.add_argument("source", metavar="ONNX_OR_CHECKPOINT",
                   help="a TensorRT-placement ONNX file, or a checkpoint folder holding model.trt.onnx "
                        "(`holoserve export --target tensorrt`)")
    p.add_argument("--out", default=None,
                   help="plan file (default: model.plan in the checkpoint, recorded in its manifest; "
                        "or <onnx stem>.plan next to an ONNX file); the sidecar is written to <out>.json")
    adv.add_argument("--sparse", dest="sparse", action="store_true", default=True,
                   help="enable SPARSE_WEIGHTS (default)")
    adv.add_argument("--no-sparse", dest="sparse", action="store_false", help="disable SPARSE_WEIGHTS")
    adv.add_argument("--no-fp16", dest="fp16", action="store_false", default=True,
                   help="TensorRT 10 only: do not allow FP16 for the unquantized layers")
    p.add_argument("--min", default="1x1", metavar="BxS", help="smallest batch x sequence (default 1x1)")
    p.add_argument("--opt", default="8x128", metavar="BxS", help="batch x sequence to tune for (default 8x128)")
    p.add_argument("--max", default=None, metavar="BxS",
                   help="largest batch x sequence (default 32 x the model's max_seq_length, or 32x512)")
    adv.add_argument("--workspace", default=None, help="builder workspace limit, e.g. 2G (default: TensorRT's)")
    adv.add_argument("--timing-cache", default=None, metavar="PATH",
                   help="timing cache file, loaded if present and saved after the build (reused across builds)")
    p.add_argument("--compute-capability", default="SM80",
                   help="TensorRT-RTX target GPU architecture: SM75, SM80, SM86, SM89 or SM120 (default SM80); "
                        "datacenter TensorRT always builds for the GPU it runs on")
    p.add_argument("--flavour", choices=("tensorrt", "tensorrt_rtx"), default=None,
                   help="TensorRT library to use (default: datacenter tensorrt if installed, else tensorrt_rtx)")
    adv.add_argument("--log", default=None, metavar="PATH", help="write the full builder log here")


def run(args: argparse.Namespace) -> int:
    from holoserve import HoloServeError
    from holoserve.core.artifact import MANIFEST, add_files, load_artifact
    from holoserve.core.manifest import TENSORRT_ENGINE, TENSORRT_ONNX

    from .engine import ShapeProfile, build_engine, parse_shape, parse_size

    src = Path(args.source)
    art = None
    if src.is_dir():
        if not (src / MANIFEST).is_file():
            raise HoloServeError(f"{src} is neither an ONNX file nor a HoloServe checkpoint (no {MANIFEST})")
        art = load_artifact(src, check_weights=False)
        onnx_path = art.export_path(TENSORRT_ONNX)
        if onnx_path is None or not onnx_path.is_file():
            raise HoloServeError(
                f"{src} has no TensorRT-placement ONNX export; run `holoserve export {src} --target tensorrt` first"
            )
        max_seq = art.max_seq_length
    elif src.is_file():
        onnx_path, max_seq = src, None
    else:
        raise HoloServeError(f"{src} does not exist")
    mx = parse_shape(args.max) if args.max else (32, max_seq or 512)
    profile = ShapeProfile(parse_shape(args.min), parse_shape(args.opt), mx)
    profile = ShapeProfile(profile.min, (profile.opt[0], min(profile.opt[1], mx[1])), mx).validate(max_seq)

    if art is not None and args.out is None:
        with tempfile.TemporaryDirectory(prefix=".holoserve-engine-", dir=art.path) as tmp:
            plan = Path(tmp) / "model.plan"
            res = _build(build_engine, onnx_path, plan, profile, args, parse_size)
            side = res.sidecar
            add_files(art, {"model.plan": plan, "model.plan.json": res.sidecar_path}, exports={
                TENSORRT_ENGINE: {
                    "file": "model.plan", "sidecar": "model.plan.json", "onnx": onnx_path.name,
                    "tensorrt": side["tensorrt"], "target": side["target"], "profiles": side["profiles"],
                    "precision": side["precision"], "builder_flags": side["builder_flags"],
                },
            })
            out = art.path / "model.plan"
    else:
        out = Path(args.out) if args.out else onnx_path.with_name(onnx_path.name.split(".")[0] + ".plan")
        res = _build(build_engine, onnx_path, out, profile, args, parse_size)
        side = res.sidecar
    _print(out, side)
    return 0


def _build(build_engine, onnx_path, out, profile, args, parse_size):
    return build_engine(
        onnx_path, out, profile=profile, sparse=args.sparse, fp16=args.fp16, workspace=parse_size(args.workspace),
        timing_cache=args.timing_cache, compute_capability=args.compute_capability, flavour=args.flavour,
        log_path=args.log,
    )


def _print(out: Path, side: dict) -> None:
    t, tgt, p = side["tensorrt"], side["target"], side["parser"]
    print(f"engine: {out} ({side['plan_bytes'] / 1e6:.1f} MB) built in {side['build_seconds']} s with "
          f"{t['flavour']} {t['version']} for {tgt.get('gpu') or tgt['compute_capability']} ({tgt['built_on']})")
    print(f"  parser accepted {p['network_layers']} layers: {p['layer_types'].get('QUANTIZE', 0)} Quantize, "
          f"{p['layer_types'].get('DEQUANTIZE', 0)} Dequantize, {p['layer_types'].get('MATRIX_MULTIPLY', 0)} MatMul")
    print(f"  flags: network {side['network_flags'] or ['(default)']}, builder {side['builder_flags']}; {side['precision']}")
    lay = side.get("engine_layers")
    if lay:
        print(f"  engine GEMMs: {lay['gemm_layers']} ({lay['gemm_int8_inputs']} with INT8 inputs, "
              f"{lay['gemm_int8_in_int8_out']} INT8-in/INT8-out)")
    sp = side["sparsity"]
    print(f"  sparsity: eligible {len(sp['eligible'])}, picked sparse {len(sp['picked_sparse'])}"
          + (f" — {sp['note']}" if sp.get("note") else ""))
    print(f"  profile min/opt/max: {side['profiles'][0][side['inputs'][0]['name']]}")
    print(f"  sidecar: {out.with_name(out.name + '.json')}")
