"""`holoserve build-engine ONNX_OR_CHECKPOINT`: a TensorRT engine with INT8 + sparse weights and its sidecar.

Light module: TensorRT is imported only inside run(), and nothing here needs torch or onnx, so the
command works in the GPU image, which has TensorRT but not the [export] extra.
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
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="write the engine to DIR/<model>/<tensorrt flavour-version-GPU>/model.plan instead, leaving "
                        "the checkpoint untouched (a read-only checkpoint, an engine volume shared by several GPUs); "
                        "`holoserve serve` finds it through HOLOSERVE_ENGINE_CACHE=DIR")
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing when an engine built from this ONNX by this TensorRT for this GPU is already there")
    adv.add_argument("--sparse", dest="sparse", action="store_true", default=True,
                     help="enable SPARSE_WEIGHTS (default)")
    adv.add_argument("--no-sparse", dest="sparse", action="store_false", help="disable SPARSE_WEIGHTS")
    p.add_argument("--require-sparse", action="store_true",
                   help="fail (and write no plan) unless at least one weight GEMM is known to run a sparse kernel")
    adv.add_argument("--no-fp16", dest="fp16", action="store_false", default=True,
                     help="TensorRT 10 only: do not allow FP16 for the unquantized layers")
    p.add_argument("--min", default="1x1", metavar="BxS", help="smallest batch x sequence (default 1x1)")
    p.add_argument("--opt", default="8x128", metavar="BxS", help="batch x sequence to tune for (default 8x128)")
    p.add_argument("--max", default=None, metavar="BxS",
                   help="largest batch x sequence (default 32 x the model's max_seq_length, or 32x512)")
    adv.add_argument("--workspace", default=None, help="builder workspace limit, e.g. 2G (default: TensorRT's)")
    adv.add_argument("--timing-cache", default=None, metavar="PATH",
                     help="timing cache file (datacenter TensorRT), loaded if this GPU and TensorRT can use it and "
                          "saved after the build")
    p.add_argument("--compute-capability", default=None, metavar="SM",
                   help="TensorRT-RTX: pin the target architecture (SM75, SM80, SM86, SM89, SM120, SM121; several "
                        "comma-separated); default: a portable engine for 8.0/8.6/8.9/12.0 and later. Datacenter "
                        "TensorRT always builds for the GPU it runs on")
    p.add_argument("--flavour", choices=("tensorrt", "tensorrt_rtx"), default=None,
                   help="TensorRT library to use (default: datacenter tensorrt if installed, else tensorrt_rtx)")
    adv.add_argument("--log", default=None, metavar="PATH", help="write the full builder log here")


def run(args: argparse.Namespace) -> int:
    from holoserve import HoloServeError
    from holoserve.core.artifact import MANIFEST, add_files, load_artifact
    from holoserve.core.manifest import TENSORRT_ENGINE, TENSORRT_ONNX

    from .engine import build_engine
    from .engine_cache import build_cached_engine, up_to_date
    from .engine_settings import EngineOptions, ShapeProfile, build_target, load_trt, parse_shape, parse_size

    src = Path(args.source)
    art = None
    onnx_sha = None
    if src.is_dir():
        if not (src / MANIFEST).is_file():
            raise HoloServeError(f"{src} is neither an ONNX file nor a HoloServe checkpoint (no {MANIFEST})")
        art = load_artifact(src, check_weights=False)
        onnx_path = art.export_path(TENSORRT_ONNX)
        if onnx_path is None or not onnx_path.is_file():
            raise HoloServeError(
                f"{src} has no TensorRT-placement ONNX export; run `holoserve export {src} --target tensorrt` first"
            )
        entry = art.manifest.files.get(onnx_path.name)
        onnx_sha = entry.sha256 if entry is not None else None
        max_seq = art.max_seq_length
    elif src.is_file():
        onnx_path, max_seq = src, None
    else:
        raise HoloServeError(f"{src} does not exist")
    if args.cache_dir and args.out:
        raise HoloServeError("give either --out or --cache-dir, not both")
    mx = parse_shape(args.max) if args.max else (32, max_seq or 512)
    profile = ShapeProfile(parse_shape(args.min), parse_shape(args.opt), mx)
    profile = ShapeProfile(
        (min(profile.min[0], mx[0]), min(profile.min[1], mx[1])),
        (min(profile.opt[0], mx[0]), min(profile.opt[1], mx[1])), mx,
    ).validate(max_seq)
    options = EngineOptions(profile=profile, sparse=args.sparse, fp16=args.fp16, workspace=parse_size(args.workspace),
                            timing_cache=args.timing_cache, compute_capability=args.compute_capability,
                            flavour=args.flavour, log_path=args.log, require_sparse=args.require_sparse)

    if args.cache_dir:
        res = build_cached_engine(onnx_path, args.cache_dir, options, onnx_sha256=onnx_sha, if_missing=args.if_missing)
        return _done(res.plan, res.sidecar, res.skipped)

    if art is not None and args.out is None:
        if args.if_missing:
            entry = art.export(TENSORRT_ENGINE)
            if entry is not None:
                _, flv = load_trt(args.flavour)
                why = up_to_date(art.path / entry.file, flavour=flv, target=build_target(flv, args.compute_capability),
                                 onnx_sha256=onnx_sha or "")
                if why is None:
                    from holoserve.core.sidecar import read_sidecar

                    return _done(art.path / entry.file, read_sidecar(art.path / entry.file), True)
        with tempfile.TemporaryDirectory(prefix=".holoserve-engine-", dir=art.path) as tmp:
            plan = Path(tmp) / "model.plan"
            res = build_engine(onnx_path, plan, options, onnx_sha256=onnx_sha)
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
        if args.if_missing and out.is_file():
            _, flv = load_trt(args.flavour)
            from holoserve.core.files import sha256_file
            from holoserve.core.sidecar import read_sidecar

            if up_to_date(out, flavour=flv, target=build_target(flv, args.compute_capability),
                          onnx_sha256=onnx_sha or sha256_file(onnx_path)) is None:
                return _done(out, read_sidecar(out), True)
        res = build_engine(onnx_path, out, options, onnx_sha256=onnx_sha)
        side = res.sidecar
    return _done(out, side, False)


def _done(out: Path, side: dict, skipped: bool) -> int:
    if skipped:
        t, tgt = side["tensorrt"], side["target"]
        print(f"engine: {out} is up to date ({t['flavour']} {t['version']}, {_target_text(tgt)}); not rebuilt")
        return 0
    _print(out, side)
    return 0


def _target_text(tgt: dict) -> str:
    from holoserve.core.sidecar import RTX_PORTABLE

    if tgt.get("portable"):
        ccs = list(tgt.get("compute_capabilities") or RTX_PORTABLE)
        return ("portable: " if tuple(ccs) == RTX_PORTABLE else "") + "/".join(ccs)
    return f"{tgt.get('gpu') or tgt.get('compute_capability')}" + (
        f" ({tgt['compute_capability']})" if tgt.get("gpu") else "")


def _print(out: Path, side: dict) -> None:
    t, tgt, p = side["tensorrt"], side["target"], side["parser"]
    print(f"engine: {out} ({side['plan_bytes'] / 1e6:.1f} MB) built in {side['build_seconds']} s with "
          f"{t['flavour']} {t['version']} for {_target_text(tgt)} ({tgt['built_on']})")
    print(f"  parser accepted {p['network_layers']} layers: {p['layer_types'].get('QUANTIZE', 0)} Quantize, "
          f"{p['layer_types'].get('DEQUANTIZE', 0)} Dequantize, {p['layer_types'].get('MATRIX_MULTIPLY', 0)} MatMul "
          f"({p.get('weight_gemms', 0)} with INT8 weights)")
    print(f"  flags: network {side['network_flags'] or ['(default)']}, builder {side['builder_flags']}")
    print(f"  precision: {side['precision']}")
    lay = side.get("engine_layers")
    if lay:
        print(f"  engine GEMMs: {lay['gemm_layers']} ({lay['gemm_int8_inputs']} with INT8 inputs, "
              f"{lay['gemm_int8_in_int8_out']} INT8-in/INT8-out), from the {lay.get('source', 'layer information')}")
    else:
        print("  engine GEMMs: no layer information (the builder logged none and the plan cannot be inspected here)")
    sp = side["sparsity"]
    print(f"  sparsity: {sp.get('verdict', '')}" + (f" — {sp['note']}" if sp.get("note") else ""))
    mark = {True: "sparse", False: "dense", None: "unknown"}
    groups: dict[tuple, list[str]] = {}
    for g in sp.get("gemms") or []:  # per GEMM, grouped by verdict and reason
        groups.setdefault((g["sparse"], g["why"]), []).append(g["gemm"])
    for (verdict, why), names in groups.items():
        print(f"    {mark[verdict]} ({len(names)}): {why}")
        for name in names:
            print(f"      {name}")
    if side.get("timing_cache"):
        print(f"  timing cache: {side['timing_cache']}")
    print(f"  profile min/opt/max: {side['profiles'][0][side['inputs'][0]['name']]}")
    print(f"  sidecar: {out.with_name(out.name + '.json')}")
