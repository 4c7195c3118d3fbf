"""The one TensorRT engine builder: datacenter TensorRT 10 / 11 (`tensorrt`) or TensorRT-RTX (`tensorrt_rtx`).

`build_engine` parses the ONNX export, sets the flags its flavour needs (export/engine_settings.py),
builds the plan, and writes it with a sidecar describing what the engine runs (export/engine_report.py).
Nothing here imports torch or onnx, so `holoserve build-engine` runs in the GPU image with only
TensorRT installed; the engine cache is export/engine_cache.py.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from holoserve.core.files import atomic_write_bytes, atomic_write_json, atomic_write_text

from .engine_report import (
    EngineReport,
    ParsedNetwork,
    PlanBuild,
    make_sidecar,
    onnx_layer_names,
    parse_layer_info,
    precision_summary,
    runs_in,
    sparsity_report,
    summarize_layers,
)
from .engine_settings import (
    EngineBuildError,
    EngineOptions,
    Flavour,
    ShapeProfile,
    build_target,
    builder_settings,
    load_trt,
    rtx_targets,
)

# ------------------------------------------------------------------------------------------ network


def _type_name(x: Any) -> str:
    return str(x).rsplit(".", 1)[-1]


def weight_gemms(network) -> list[str]:
    """ONNX names of the network's MatMuls whose one operand is a dequantized constant (the INT8 weight GEMMs)."""
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    producer = {}
    for layer in layers:
        for j in range(layer.num_outputs):
            producer[layer.get_output(j).name] = layer
    found = []
    for layer in layers:
        if _type_name(layer.type) != "MATRIX_MULTIPLY":
            continue
        for k in range(layer.num_inputs):
            t = layer.get_input(k)
            node, saw_dq = producer.get(t.name) if t is not None else None, False
            for _ in range(6):  # Constant -> DequantizeLinear (-> Shuffle/Cast) -> MatMul
                if node is None:
                    break
                kind = _type_name(node.type)
                if kind == "DEQUANTIZE":
                    saw_dq = True
                elif kind == "CONSTANT":
                    break
                elif kind not in ("SHUFFLE", "IDENTITY", "CAST"):
                    node = None
                    break
                src = node.get_input(0)
                node = producer.get(src.name) if src is not None else None
            if node is not None and _type_name(node.type) == "CONSTANT" and saw_dq:
                meta = onnx_layer_names(str(getattr(layer, "metadata", "") or ""))
                found.append(meta[0] if meta else layer.name)
                break
    return found


def network_float_types(network) -> dict[str, int]:
    """Float outputs (FLOAT / HALF / BF16) of the network's layers outside Q/DQ: the precision it runs in there."""
    names = {"FLOAT": "Float", "HALF": "Half", "BF16": "BFloat16", "FP8": "FP8", "FP4": "FP4"}
    counts: dict[str, int] = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if _type_name(layer.type) in ("QUANTIZE", "DEQUANTIZE", "CONSTANT", "SHAPE"):
            continue
        for j in range(layer.num_outputs):
            t = names.get(_type_name(layer.get_output(j).dtype))
            if t:
                counts[t] = counts.get(t, 0) + 1
    return dict(sorted(counts.items()))


# ------------------------------------------------------------------------------------------ timing cache


def attach_timing_cache(config, blob: bytes) -> tuple[Any, str]:
    """Give the builder a timing cache: `blob` if this TensorRT accepts it here, else a fresh one.

    `set_timing_cache(cache, ignore_mismatch=False)` returns False for a cache written on another GPU
    or by another TensorRT version; a damaged file may not even load. Both fall back to a fresh cache,
    so the build goes on and the saved cache is one this machine can reuse. Returns (cache or None, note).
    """
    note = "created"
    if blob:
        try:
            cache = config.create_timing_cache(blob)
        except Exception:  # a damaged file: the binding raises on some versions
            cache = None
        if cache is not None and _is_empty(config, cache):
            cache = None  # TensorRT could not read it and handed back an empty cache ("Failed to deserialize")
        if cache is not None and config.set_timing_cache(cache, False):
            return cache, "reused"
        note = ("not reusable here (written on another GPU or TensorRT version, or damaged): "
                "built with a fresh cache that replaces it")
    try:
        fresh = config.create_timing_cache(b"")
    except Exception:
        fresh = None
    if fresh is None or not config.set_timing_cache(fresh, False):
        return None, "could not attach a timing cache; built without one"
    return fresh, note


def _is_empty(config, cache) -> bool:
    """Whether `cache` serializes like a new, empty one."""
    try:
        return bytes(cache.serialize()) == bytes(config.create_timing_cache(b"").serialize())
    except Exception:
        return False


def save_timing_cache(config, path: Path) -> str | None:
    """Write the builder's timing cache to `path`; a note when there is nothing to write (no crash)."""
    cache = config.get_timing_cache()
    if cache is None:
        return "not saved: the builder returned no timing cache"
    data = cache.serialize()
    if data is None:
        return "not saved: the timing cache could not be serialized"
    atomic_write_bytes(path, bytes(data))
    return None


# ------------------------------------------------------------------------------------------ builder


@dataclass
class BuildResult:
    plan: Path
    sidecar_path: Path
    sidecar: dict[str, Any]
    log: list[str] = field(default_factory=list)
    skipped: bool = False  # an up-to-date engine was already there (--if-missing)


def _logger(trt, lines: list[str], verbose: bool):
    class _Collect(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):  # the name and signature TensorRT calls
            lines.append(f"[{str(severity).rsplit('.', 1)[-1]}] {msg}")
            if verbose and severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                print(msg)

    return _Collect()


def _sha256(path: Path) -> str:
    from holoserve.core.files import sha256_file

    return sha256_file(path)


def _set_flags(trt, config, names: Sequence[str]) -> list[str]:
    """Set the builder flags this library has; return the ones it lacks (removed in newer versions)."""
    missing = []
    for name in names:
        flag = getattr(trt.BuilderFlag, name, None)
        if flag is None:
            missing.append(name)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # INT8/FP16 from TensorRT 10.12
            config.set_flag(flag)
    return missing


def _layer_information(trt, flv: Flavour, lines: list[str], plan: bytes, logger,
                       profile: ShapeProfile) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The engine's layers: the inspector's JSON where the plan can be loaded (a GPU), else the builder log."""
    if not flv.aot:
        text = _inspect_engine(trt, plan, logger, profile)
        if text:
            return parse_layer_info(text), "engine inspector (JSON)"
    bodies = [ln.split("] ", 1)[1] if ln.startswith("[") and "] " in ln else ln for ln in lines]
    for i, body in enumerate(bodies):
        if body.startswith("Layers:"):
            return parse_layer_info(body.split(":", 1)[1]), "builder log"
        if body.startswith("Engine Layer Information:"):  # older builders log one message per layer after it
            text = [body.split(":", 1)[1]]
            for nxt in bodies[i + 1:]:
                if not nxt.startswith("Layer("):
                    break
                text.append(nxt)
            return parse_layer_info("\n".join(text)), "builder log"
    return None, None


def build_engine(onnx_path: str | os.PathLike, out: str | os.PathLike, options: EngineOptions = EngineOptions(), *,
                 onnx_sha256: str | None = None) -> BuildResult:
    """Parse `onnx_path`, build a serialized engine at `out` and its JSON sidecar at `out`.json, as
    `options` say; `onnx_sha256` is the export's digest when the caller already has it."""
    o = options
    if o.require_sparse and not o.sparse:
        raise EngineBuildError("--require-sparse needs sparse weights: drop --no-sparse")
    trt, flv = load_trt(o.flavour)
    onnx_path, out = Path(onnx_path), Path(out)
    if not onnx_path.is_file():
        raise EngineBuildError(f"ONNX file {onnx_path} does not exist")
    target = build_target(flv, o.compute_capability)
    settings = builder_settings(flv, sparse=o.sparse, fp16=o.fp16)
    lines: list[str] = []
    logger = _logger(trt, lines, o.verbose)
    builder = trt.Builder(logger)
    net_flags = 0
    for name in settings["network"]:
        flag = getattr(trt.NetworkDefinitionCreationFlag, name, None)
        if flag is not None:  # absent where the mode is the only one (then it is the default)
            net_flags |= 1 << int(flag)
    network = builder.create_network(net_flags)
    parser = trt.OnnxParser(network, logger)
    ok = parser.parse_from_file(str(onnx_path))
    errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
    if not ok or errors:
        raise EngineBuildError(
            f"TensorRT's ONNX parser rejected {onnx_path.name}: " + ("; ".join(errors[:5]) or "unknown error")
        )
    counts: dict[str, int] = {}
    for i in range(network.num_layers):
        t = _type_name(network.get_layer(i).type)
        counts[t] = counts.get(t, 0) + 1
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    outputs = [network.get_output(i) for i in range(network.num_outputs)]
    gemm_names = weight_gemms(network)
    graph_types = network_float_types(network)
    parser_info = {
        "accepted": True,
        "errors": errors,
        "network_layers": network.num_layers,
        "layer_types": dict(sorted(counts.items())),
        "weight_gemms": len(gemm_names),
    }

    config = builder.create_builder_config()
    missing_flags = _set_flags(trt, config, settings["builder"])
    if "SPARSE_WEIGHTS" in missing_flags:
        raise EngineBuildError(f"{flv.name} {flv.version} has no SPARSE_WEIGHTS builder flag; build with --no-sparse")
    if o.workspace:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(o.workspace))
    if hasattr(trt, "ProfilingVerbosity"):
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    pinned = rtx_targets(o.compute_capability) if flv.aot else []
    if pinned:
        config.num_compute_capabilities = len(pinned)
        for i, cc in enumerate(pinned):
            enum = getattr(trt.ComputeCapability, cc, None)
            if enum is None:
                raise EngineBuildError(f"TensorRT-RTX {flv.version} cannot build for {cc}; leave "
                                       "--compute-capability out for a portable engine")
            config.set_compute_capability(enum, i)
    # else: TensorRT-RTX's default, no compute capability set, is the portable engine.
    opt_profile = builder.create_optimization_profile()
    for t in inputs:
        if len(t.shape) != 2:
            raise EngineBuildError(f"input {t.name} has shape {tuple(t.shape)}; expected [batch, sequence]")
        opt_profile.set_shape(t.name, o.profile.min, o.profile.opt, o.profile.max)
    config.add_optimization_profile(opt_profile)

    cache_note = None
    if o.timing_cache and flv.aot:
        # TensorRT-RTX picks kernels on the device at run time; its timing-cache calls are deprecated
        # no-ops that would make the ahead-of-time build look for a GPU.
        cache_note = "not used: TensorRT-RTX has no build-time timing cache (the file is left as it was)"
    elif o.timing_cache:
        tc_path = Path(o.timing_cache)
        blob = tc_path.read_bytes() if tc_path.is_file() else b""
        _cache_obj, cache_note = attach_timing_cache(config, blob)  # kept alive until the build is done
        cache_note = f"{tc_path.name}: {cache_note}"

    t0 = time.time()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.time() - t0
    if serialized is None:
        errs = [ln for ln in lines if ln.startswith(("[ERROR]", "[INTERNAL_ERROR]"))]
        raise EngineBuildError(f"TensorRT failed to build {onnx_path.name}: " + (" | ".join(errs[-3:]) or "see log"))
    plan = bytes(serialized)
    if o.log_path:
        atomic_write_text(Path(o.log_path), "\n".join(lines) + "\n")

    parsed, layer_source = _layer_information(trt, flv, lines, plan, logger, o.profile)
    layers = summarize_layers(parsed) if parsed is not None else None
    if layers is not None:
        layers["source"] = layer_source
    sparsity = sparsity_report(parsed or [], layers, gemm_names, lines, requested=o.sparse, jit=flv.aot)
    if o.require_sparse and not sparsity["sparse_gemms"]:
        raise EngineBuildError(
            f"--require-sparse: {sparsity['verdict']}; no plan was written. "
            + ("TensorRT-RTX cannot confirm sparse kernels ahead of time; build with datacenter TensorRT on the "
               "serving GPU to check. " if flv.aot else
               "Check that the weights are 2:4 along K and that the GPU supports sparse tensor cores (SM80+). ")
            + (f"Builder log: {o.log_path}" if o.log_path else "Rerun with --log PATH to keep the builder log")
        )
    engine_types = (layers or {}).get("float_outputs_outside_gemms") or None
    outside = {
        "graph": graph_types,
        "engine": engine_types,
        "runs": (runs_in(graph_types) if flv.strongly_typed else
                 runs_in(engine_types) if engine_types else ("FP16/FP32, chosen by the builder" if o.fp16 else "FP32")),
        "source": ("the ONNX graph (strongly typed network)" if flv.strongly_typed else
                   f"engine layer information ({layer_source})" if engine_types else "builder flags"),
    }
    if missing_flags:
        outside["builder_flags_missing"] = missing_flags
    precision = precision_summary(flv, o.fp16, graph_types, engine_types)
    sidecar = make_sidecar(
        PlanBuild(flavour=flv, target=target, profile=o.profile, settings=settings, build_seconds=seconds,
                  plan_bytes=len(plan), timing_cache=cache_note),
        ParsedNetwork(
            inputs=[{"name": t.name, "dtype": _type_name(t.dtype), "shape": list(t.shape)} for t in inputs],
            outputs=[{"name": t.name, "dtype": _type_name(t.dtype), "shape": list(t.shape)} for t in outputs],
            parser=parser_info, onnx_file=onnx_path.name, onnx_sha256=onnx_sha256 or _sha256(onnx_path)),
        EngineReport(precision=precision, sparsity=sparsity, layers=layers, precision_outside_qdq=outside),
    )
    atomic_write_bytes(out, plan)
    if o.timing_cache and not flv.aot:
        saved = save_timing_cache(config, Path(o.timing_cache))
        if saved:
            sidecar["timing_cache"] = f"{cache_note}; {saved}"
    side = out.with_name(out.name + ".json")
    atomic_write_json(side, sidecar)  # last: a sidecar next to a plan means the plan is complete
    return BuildResult(out, side, sidecar, lines)


def _inspect_engine(trt, plan: bytes, logger, profile: ShapeProfile) -> str | None:
    """The inspector's JSON layer information; needs a runtime that can load the plan (a GPU), else None."""
    try:
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(plan)
        if engine is None:
            return None
        insp = engine.create_engine_inspector()
        try:  # with an execution context at the opt shapes, formats of dynamic-shape tensors are resolved
            ctx = engine.create_execution_context()
            for i in range(engine.num_io_tensors):
                name = engine.get_tensor_name(i)
                if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                    ctx.set_input_shape(name, profile.opt)
            insp.execution_context = ctx
        except Exception:
            pass
        return insp.get_engine_information(trt.LayerInformationFormat.JSON)
    except Exception:  # no GPU / runtime on this machine
        return None
