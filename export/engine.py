"""The one TensorRT engine builder: datacenter TensorRT 10 / 11 (`tensorrt`) or TensorRT-RTX (`tensorrt_rtx`).

Every difference between the flavours lives in `Flavour` and `builder_settings`:

| flavour            | network                   | precision flags             | target GPU                        |
|--------------------|---------------------------|-----------------------------|-----------------------------------|
| tensorrt 10        | weakly typed              | INT8 (explicit QDQ) + FP16  | the GPU of the building machine   |
| tensorrt >= 11     | strongly typed (always)   | none: precision = the graph | the GPU of the building machine   |
| tensorrt_rtx       | strongly typed (always)   | none: precision = the graph | chosen compute capability (AOT,   |
|                    |                           |                             | builds on a CPU-only machine)     |

SPARSE_WEIGHTS is set in all of them unless disabled. Everything that needs no library (shape
profiles, flag selection, log parsing, the sidecar) is a plain function; the library is
imported lazily in `load_trt` with a clear message when absent.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from holoserve import HoloServeError
from holoserve.core.files import atomic_write_bytes, atomic_write_json
from holoserve.core.sidecar import SIDECAR_FORMAT, SIDECAR_VERSION

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
RTX_COMPUTE_CAPABILITIES = ("SM75", "SM80", "SM86", "SM89", "SM120")  # what TensorRT-RTX AOT-builds for


class EngineBuildError(HoloServeError):
    """The engine could not be built (parser errors, builder failure, bad settings)."""


# ------------------------------------------------------------------------------------------ flavours


@dataclass(frozen=True)
class Flavour:
    module: str  # "tensorrt" or "tensorrt_rtx"
    version: str

    @property
    def name(self) -> str:
        return "tensorrt-rtx" if self.module == "tensorrt_rtx" else "tensorrt"

    @property
    def major(self) -> int:
        m = re.match(r"(\d+)", self.version)
        return int(m.group(1)) if m else 0

    @property
    def strongly_typed(self) -> bool:
        """TensorRT-RTX and TensorRT >= 11 only build strongly typed networks (no INT8/FP16 flags)."""
        return self.module == "tensorrt_rtx" or self.major >= 11

    @property
    def aot(self) -> bool:
        """Builds for a chosen compute capability without a GPU (TensorRT-RTX)."""
        return self.module == "tensorrt_rtx"


def builder_settings(flavour: Flavour, *, sparse: bool = True, fp16: bool = True) -> dict[str, list[str]]:
    """Names of the network-creation and builder flags to set for this flavour."""
    network: list[str] = []
    flags: list[str] = []
    if flavour.strongly_typed:
        # TRT 11 networks are strongly typed by default; the flag still exists in TensorRT-RTX.
        network.append("STRONGLY_TYPED")
    else:
        # TensorRT 10, weakly typed: INT8 comes from the explicit Q/DQ graph once INT8 is allowed;
        # FP16 lets the builder run the unquantized remainder (LayerNorm, softmax, GELU) in half.
        flags.append("INT8")
        if fp16:
            flags.append("FP16")
    if sparse:
        flags.append("SPARSE_WEIGHTS")
    return {"network": network, "builder": flags}


def precision_summary(flavour: Flavour, fp16: bool) -> str:
    if flavour.strongly_typed:
        return "strongly typed: INT8 where the ONNX graph has Q/DQ, FP32 elsewhere (as typed in the graph)"
    return "INT8 from the explicit Q/DQ graph" + (", FP16 allowed for the rest" if fp16 else ", FP32 for the rest")


def load_trt(prefer: str | None = None):
    """Import a TensorRT flavour: `prefer` ("tensorrt" / "tensorrt_rtx"), else datacenter TensorRT first."""
    order = [prefer] if prefer else ["tensorrt", "tensorrt_rtx"]
    errors = []
    for name in order:
        if name not in ("tensorrt", "tensorrt_rtx"):
            raise EngineBuildError(f"unknown TensorRT flavour {name!r}: choose tensorrt or tensorrt_rtx")
        try:
            mod = importlib.import_module(name)
            return mod, Flavour(name, str(getattr(mod, "__version__", "0")))
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise EngineBuildError(
        "no TensorRT library is installed (" + "; ".join(errors) + "). Install TensorRT-RTX with "
        "pip install 'holoserve[tensorrt]' (tensorrt-rtx-cu13, builds engines ahead of time without a GPU) or "
        "NVIDIA's datacenter TensorRT on a GPU machine"
    )


# ------------------------------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class ShapeProfile:
    """One optimization profile over (batch, sequence), applied to every [batch, sequence] input."""

    min: tuple[int, int] = (1, 1)
    opt: tuple[int, int] = (8, 128)
    max: tuple[int, int] = (32, 512)

    def validate(self, max_seq_length: int | None = None) -> "ShapeProfile":
        for name, (b, s) in (("min", self.min), ("opt", self.opt), ("max", self.max)):
            if b < 1 or s < 1:
                raise EngineBuildError(f"--{name} {b}x{s}: batch and sequence must be at least 1")
        for i, what in ((0, "batch"), (1, "sequence")):
            if not self.min[i] <= self.opt[i] <= self.max[i]:
                raise EngineBuildError(
                    f"{what} sizes must satisfy min <= opt <= max, got {self.min[i]} / {self.opt[i]} / {self.max[i]}"
                )
        if max_seq_length is not None and self.max[1] > max_seq_length:
            raise EngineBuildError(
                f"--max sequence {self.max[1]} exceeds the model's maximum of {max_seq_length} positions"
            )
        return self

    def shapes(self, inputs: Sequence[str] = INPUT_NAMES) -> dict[str, dict[str, list[int]]]:
        return {n: {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)} for n in inputs}


def parse_shape(text: str) -> tuple[int, int]:
    """"8x128" (batch x sequence) -> (8, 128)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX,]\s*(\d+)\s*", text or "")
    if not m:
        raise EngineBuildError(f"shape {text!r} is not BATCHxSEQUENCE, e.g. 8x128")
    return int(m.group(1)), int(m.group(2))


def parse_size(text: str | int | None) -> int | None:
    """Workspace size: bytes, or with a K/M/G suffix (binary)."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)i?[bB]?\s*", text)
    if not m:
        raise EngineBuildError(f"size {text!r} is not a number of bytes like 2G or 512M")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


# ------------------------------------------------------------------------------------------ logs


_ELIGIBLE = re.compile(r"Layers eligible for sparse math:\s*(.*)", re.I)
_PICKED = re.compile(r"picked sparse implementation for layers:\s*(.*)", re.I)


def _split_layers(s: str) -> list[str]:
    return [x.strip() for x in s.strip().rstrip(".").split(",") if x.strip()]


def parse_sparsity_log(lines: Iterable[str]) -> dict[str, Any]:
    """TensorRT's "(Sparsity)" builder log lines: which layers were eligible, which got sparse tactics."""
    eligible: list[str] = []
    picked: list[str] = []
    seen = False
    for line in lines:
        m = _ELIGIBLE.search(line)
        if m:
            seen = True
            eligible += _split_layers(m.group(1))
        m = _PICKED.search(line)
        if m:
            seen = True
            picked += _split_layers(m.group(1))
    return {"reported": seen, "eligible": eligible, "picked_sparse": picked}


_LAYER_SPLIT = re.compile(r"(?:^|\n)Name: ")


def parse_layer_info(text: str) -> list[dict[str, Any]]:
    """Parse the engine's layer information text ("Name: ..., LayerType: ..., Inputs: [...], ...")."""
    out = []
    for chunk in _LAYER_SPLIT.split(text)[1:]:
        name = chunk.split(", LayerType:")[0].strip()
        lt = re.search(r"LayerType: ([^,]+)", chunk)
        tac = re.search(r"TacticName: ([^,]*)", chunk)
        ins = chunk.split("Inputs: [", 1)[1].split("Outputs: [", 1)[0] if "Inputs: [" in chunk else ""
        outs = chunk.split("Outputs: [", 1)[1] if "Outputs: [" in chunk else ""
        outs = outs.split("TacticName:", 1)[0]
        if "Constants: [" in ins:
            consts = ins.split("Constants: [", 1)[1]
            ins = ins.split("Constants: [", 1)[0]
        else:
            consts = ""
        meta = re.findall(r"\[ONNX Layer: ([^\]]+)\]", chunk)
        out.append({
            "name": name,
            "type": lt.group(1).strip() if lt else None,
            "tactic": tac.group(1).strip() if tac else None,
            "input_types": re.findall(r"Datatype: (\w+)", ins),
            "constant_types": re.findall(r"Datatype: (\w+)", consts),
            "output_types": re.findall(r"Datatype: (\w+)", outs),
            "onnx_layers": meta,
        })
    return out


def summarize_layers(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """GEMM precision and sparse-tactic view of the engine's layers."""
    gemms = [x for x in layers if (x["type"] or "").lower() in ("gemm", "matrixmultiply", "matrix_multiply", "cask_gemm")
             or "gemm" in (x["tactic"] or "").lower()]
    int8_in = [g for g in gemms if "Int8" in g["input_types"] or "Int8" in g["constant_types"]]
    int8_io = [g for g in int8_in if "Int8" in g["output_types"]]
    sparse = [g["name"] for g in gemms if "sparse" in (g["tactic"] or "").lower()]
    return {
        "layers": len(layers),
        "gemm_layers": len(gemms),
        "gemm_int8_inputs": len(int8_in),
        "gemm_int8_in_int8_out": len(int8_io),
        "gemm_tactics": sorted({g["tactic"] or "" for g in gemms}),
        "sparse_tactic_layers": sparse,
        "onnx_matmuls_in_gemms": sum(sum(1 for m in g["onnx_layers"] if m.endswith("MatMul")) for g in gemms),
    }


# ------------------------------------------------------------------------------------------ sidecar


def gpu_info() -> dict[str, Any] | None:
    """Name and compute capability of GPU 0 via nvidia-smi (torch-free); None without a GPU."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    name, _, cc = out[0].rpartition(",")
    return {"name": name.strip(), "compute_capability": cc.strip()}


def cc_label(cc: str) -> str:
    """"8.0" / "SM80" / "sm_80" -> "SM80"."""
    s = cc.strip().upper().replace("SM_", "SM")
    if s.startswith("SM"):
        return s
    m = re.fullmatch(r"(\d+)\.(\d+)", s)
    if not m:
        raise EngineBuildError(f"compute capability {cc!r} is not like 8.0 or SM80")
    return f"SM{m.group(1)}{m.group(2)}"


def make_sidecar(
    *,
    flavour: Flavour,
    target: Mapping[str, Any],
    profile: ShapeProfile,
    inputs: Sequence[Mapping[str, Any]],
    outputs: Sequence[Mapping[str, Any]],
    settings: Mapping[str, list[str]],
    precision: str,
    sparsity: Mapping[str, Any],
    layers: Mapping[str, Any] | None,
    parser: Mapping[str, Any],
    onnx_file: str,
    onnx_sha256: str | None,
    build_seconds: float,
    plan_bytes: int,
    timing_cache: str | None,
) -> dict[str, Any]:
    return {
        "format": SIDECAR_FORMAT,
        "version": SIDECAR_VERSION,
        "tensorrt": {"flavour": flavour.name, "module": flavour.module, "version": flavour.version},
        "target": dict(target),
        "profiles": [profile.shapes([i["name"] for i in inputs])],
        "inputs": list(inputs),
        "outputs": list(outputs),
        "precision": precision,
        "network_flags": settings["network"],
        "builder_flags": settings["builder"],
        "sparsity": dict(sparsity),
        "engine_layers": dict(layers) if layers else None,
        "parser": dict(parser),
        "onnx": {"file": onnx_file, "sha256": onnx_sha256},
        "build_seconds": round(build_seconds, 2),
        "plan_bytes": plan_bytes,
        "timing_cache": timing_cache,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ------------------------------------------------------------------------------------------ builder


@dataclass
class BuildResult:
    plan: Path
    sidecar_path: Path
    sidecar: dict[str, Any]
    log: list[str] = field(default_factory=list)


def _logger(trt, lines: list[str], verbose: bool):
    class _Collect(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):  # noqa: A003 - TensorRT's interface
            lines.append(f"[{str(severity).rsplit('.', 1)[-1]}] {msg}")
            if verbose and severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                print(msg)

    return _Collect()


def _sha256(path: Path) -> str:
    from holoserve.core.files import sha256_file

    return sha256_file(path)


def build_engine(
    onnx_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    profile: ShapeProfile = ShapeProfile(),
    sparse: bool = True,
    fp16: bool = True,
    workspace: int | None = None,
    timing_cache: str | os.PathLike | None = None,
    compute_capability: str = "SM80",
    flavour: str | None = None,
    verbose: bool = False,
    log_path: str | os.PathLike | None = None,
) -> BuildResult:
    """Parse `onnx_path`, build a serialized engine at `out` and its JSON sidecar at `out`.json."""
    trt, flv = load_trt(flavour)
    onnx_path, out = Path(onnx_path), Path(out)
    if not onnx_path.is_file():
        raise EngineBuildError(f"ONNX file {onnx_path} does not exist")
    settings = builder_settings(flv, sparse=sparse, fp16=fp16)
    lines: list[str] = []
    logger = _logger(trt, lines, verbose)
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
        t = str(network.get_layer(i).type).rsplit(".", 1)[-1]
        counts[t] = counts.get(t, 0) + 1
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    outputs = [network.get_output(i) for i in range(network.num_outputs)]
    parser_info = {
        "accepted": True,
        "errors": errors,
        "network_layers": network.num_layers,
        "layer_types": dict(sorted(counts.items())),
    }

    config = builder.create_builder_config()
    for name in settings["builder"]:
        config.set_flag(getattr(trt.BuilderFlag, name))
    if workspace:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace))
    if hasattr(trt, "ProfilingVerbosity"):
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    target: dict[str, Any]
    if flv.aot:
        cc = cc_label(compute_capability)
        if cc not in RTX_COMPUTE_CAPABILITIES:
            raise EngineBuildError(
                f"TensorRT-RTX cannot build for {cc}; choose one of {', '.join(RTX_COMPUTE_CAPABILITIES)} "
                "(Hopper SM90 needs datacenter TensorRT)"
            )
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, cc), 0)
        target = {"compute_capability": cc, "gpu": None, "built_on": "ahead of time (no GPU needed)"}
    else:
        gpu = gpu_info()
        if gpu is None:
            raise EngineBuildError("datacenter TensorRT builds for the GPU it runs on, and no GPU was found")
        target = {"compute_capability": cc_label(gpu["compute_capability"]), "gpu": gpu["name"],
                  "built_on": "this GPU"}
    opt_profile = builder.create_optimization_profile()
    for t in inputs:
        if len(t.shape) != 2:
            raise EngineBuildError(f"input {t.name} has shape {tuple(t.shape)}; expected [batch, sequence]")
        opt_profile.set_shape(t.name, profile.min, profile.opt, profile.max)
    config.add_optimization_profile(opt_profile)

    cache_note = None
    cache_obj = None
    if timing_cache and flv.aot:
        # TensorRT-RTX picks kernels on the device at run time; its timing-cache calls are no-ops.
        cache_note = "not used: TensorRT-RTX has no build-time timing cache"
    elif timing_cache:
        tc_path = Path(timing_cache)
        blob = tc_path.read_bytes() if tc_path.is_file() else b""
        cache_obj = config.create_timing_cache(blob)
        config.set_timing_cache(cache_obj, False)  # False: refuse a cache from another device/version
        cache_note = f"{'reused' if blob else 'created'} {tc_path.name}"

    t0 = time.time()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.time() - t0
    if serialized is None:
        errs = [ln for ln in lines if ln.startswith(("[ERROR]", "[INTERNAL_ERROR]"))]
        raise EngineBuildError(f"TensorRT failed to build {onnx_path.name}: " + (" | ".join(errs[-3:]) or "see log"))
    plan = bytes(serialized)
    atomic_write_bytes(out, plan)
    if timing_cache and not flv.aot:
        atomic_write_bytes(Path(timing_cache), bytes(config.get_timing_cache().serialize()))

    layer_text = next((ln.split("] ", 1)[1] for ln in lines if "] Layers:" in ln), None)
    layers = summarize_layers(parse_layer_info(layer_text)) if layer_text else None
    if layers is None:
        layers = _inspect_engine(trt, plan, logger)
    sp = parse_sparsity_log(lines)
    sparsity = {
        "requested": sparse,
        "eligible": sp["eligible"],
        "picked_sparse": sp["picked_sparse"] or (layers or {}).get("sparse_tactic_layers", []),
        "builder_reported": sp["reported"],
    }
    if flv.aot and not sp["reported"]:
        sparsity["note"] = ("TensorRT-RTX compiles GEMM kernels on the target device at first run, so which layers "
                            "use sparse tactics is not known from an ahead-of-time build")
    sidecar = make_sidecar(
        flavour=flv, target=target, profile=profile,
        inputs=[{"name": t.name, "dtype": str(t.dtype).rsplit(".", 1)[-1], "shape": list(t.shape)} for t in inputs],
        outputs=[{"name": t.name, "dtype": str(t.dtype).rsplit(".", 1)[-1], "shape": list(t.shape)} for t in outputs],
        settings=settings, precision=precision_summary(flv, fp16), sparsity=sparsity, layers=layers,
        parser=parser_info, onnx_file=onnx_path.name, onnx_sha256=_sha256(onnx_path), build_seconds=seconds,
        plan_bytes=len(plan), timing_cache=cache_note,
    )
    side = out.with_name(out.name + ".json")
    atomic_write_json(side, sidecar)
    if log_path:
        Path(log_path).write_text("\n".join(lines) + "\n")
    return BuildResult(out, side, sidecar, lines)


def _inspect_engine(trt, plan: bytes, logger) -> dict[str, Any] | None:
    """Layer information through the engine inspector; needs a runtime that can load the plan (a GPU)."""
    try:
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(plan)
        if engine is None:
            return None
        insp = engine.create_engine_inspector()
        info = json.loads(insp.get_engine_information(trt.LayerInformationFormat.JSON))
    except Exception:  # no GPU / runtime on this machine
        return None
    layers = []
    for x in info.get("Layers", []):
        if isinstance(x, str):
            continue
        layers.append({
            "name": x.get("Name"), "type": x.get("LayerType"), "tactic": x.get("TacticName"),
            "input_types": [str(i.get("Format/Datatype", "")) for i in x.get("Inputs", [])],
            "constant_types": [], "output_types": [str(o.get("Format/Datatype", "")) for o in x.get("Outputs", [])],
            "onnx_layers": [],
        })
    return summarize_layers(layers)
