"""What a built TensorRT engine runs, read from what TensorRT says about it: the builder's sparsity
log lines, the engine's layer information (JSON from the inspector, or the text the builder logs),
the per-GEMM INT8/sparse report, the precision summary, and the sidecar written next to the plan.

Plain functions over text and dicts: nothing here imports TensorRT, torch or onnx.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from holoserve.core.sidecar import SIDECAR_FORMAT, SIDECAR_VERSION

from .engine_settings import EngineBuildError, Flavour, ShapeProfile

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


# ------------------------------------------------------------------------------------------ layer information

# Data types as TensorRT spells them in layer information, old and new: a bare name ("Int8", "Half"),
# or inside a descriptive format ("Thirty-two wide channel vectorized row major Int8 format",
# "Row major linear FP32 format (kLINEAR)", "Channel major FP16 format where channel % 2 == 0").
_DTYPES = {
    "int8": "Int8", "uint8": "UInt8", "int4": "Int4", "int32": "Int32", "int64": "Int64", "bool": "Bool",
    "fp8": "FP8", "e4m3": "FP8", "fp4": "FP4", "e2m1": "FP4",
    "half": "Half", "fp16": "Half", "float16": "Half",
    "bf16": "BFloat16", "bfloat16": "BFloat16",
    "float": "Float", "fp32": "Float", "float32": "Float",
}
_DTYPE_RE = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(sorted(_DTYPES, key=len, reverse=True)) + r")(?![A-Za-z0-9])",
                       re.I)
FLOAT_TYPES = ("Float", "Half", "BFloat16", "FP8", "FP4")


def normalize_dtype(text: Any) -> str | None:
    """"Thirty-two wide channel vectorized row major Int8 format." -> "Int8"; "N/A due to dynamic shapes" -> None."""
    if text is None:
        return None
    m = _DTYPE_RE.search(str(text))
    return _DTYPES[m.group(1).lower()] if m else None


_ONNX_META = re.compile(r"\[ONNX Layer: ([^\]]+)\]")


def onnx_layer_names(metadata: str) -> list[str]:
    """The ONNX node names in a TensorRT layer's metadata ("[ONNX Layer: /bert/.../MatMul]")."""
    return _ONNX_META.findall(metadata)


def _tensor_dtype(t: Mapping[str, Any] | str) -> str | None:
    """One tensor of a JSON layer: "Format/Datatype" (TensorRT 8.x-10.x) or separate Datatype/Format keys."""
    if isinstance(t, str):
        return normalize_dtype(t)
    for key, value in t.items():
        if re.fullmatch(r"data\s*type", str(key), re.I):
            found = normalize_dtype(value)
            if found:
                return found
    for key in ("Format/Datatype", "Format", "Type"):
        if key in t:
            found = normalize_dtype(t[key])
            if found:
                return found
    return None


def _json_layer(x: Mapping[str, Any]) -> dict[str, Any]:
    meta = x.get("Metadata") or ""
    meta = " ".join(meta) if isinstance(meta, list) else str(meta)
    name = str(x.get("Name") or "")
    consts = [_tensor_dtype(c) for c in x.get("Constants") or []]
    weights = x.get("Weights")
    if isinstance(weights, Mapping) and weights.get("Type"):
        consts.append(normalize_dtype(weights.get("Type")))
    return {
        "name": name,
        "type": x.get("LayerType"),
        "parameter_type": x.get("ParameterType"),
        "tactic": x.get("TacticName") if x.get("TacticName") is not None else x.get("TacticValue"),
        "input_types": [_tensor_dtype(i) for i in x.get("Inputs") or []],
        "constant_types": consts,
        "output_types": [_tensor_dtype(o) for o in x.get("Outputs") or []],
        "onnx_layers": _ONNX_META.findall(meta) or [s.strip() for s in name.split(" + ") if s.strip()],
        "allow_sparse": x.get("AllowSparse"),
    }


def _oneline_tensors(section: str) -> list[str | None]:
    """Data types of the `{ ... }` tensor blocks in one ONELINE section ("Inputs: [ {...}, {...} ]")."""
    out = []
    for block in re.findall(r"\{([^{}]*)\}", section):
        m = re.search(r"(?:Format/Datatype|Datatype|DataType):\s*([^,}]*)", block)
        out.append(normalize_dtype(m.group(1)) if m else None)
    return out


def _section(chunk: str, key: str, nxt: Sequence[str]) -> str:
    if f"{key}: [" not in chunk:
        return ""
    rest = chunk.split(f"{key}: [", 1)[1]
    cut = len(rest)
    for n in nxt:
        i = rest.find(f"], {n}")
        if i >= 0:
            cut = min(cut, i)
    return rest[:cut]


def _parse_oneline(text: str) -> list[dict[str, Any]]:
    """The text layer information: "Name: ..., LayerType: ..., Inputs: [...], ..., Metadata: [ONNX Layer: ...]"."""
    body = re.split(r"\n\s*(?:I/O Tensors|Bindings|Engine Metadata):", text, maxsplit=1)[0]
    out = []
    for chunk in re.split(r"(?:^|\n)Name: ", body)[1:]:
        name = chunk.split(", LayerType:")[0].strip()
        lt = re.search(r"LayerType: ([^,]+)", chunk)
        pt = re.search(r"ParameterType: ([^,]+)", chunk)
        tac = re.search(r"TacticName: ([^,]*)", chunk) or re.search(r"TacticValue: ([^,]*)", chunk)
        after = ("Constants", "Outputs", "ParameterType", "TacticName", "TacticValue", "StreamId", "Metadata")
        out.append({
            "name": name,
            "type": lt.group(1).strip() if lt else None,
            "parameter_type": pt.group(1).strip() if pt else None,
            "tactic": tac.group(1).strip() if tac else None,
            "input_types": _oneline_tensors(_section(chunk, "Inputs", after)),
            "constant_types": _oneline_tensors(_section(chunk, "Constants", after[1:])),
            "output_types": _oneline_tensors(_section(chunk, "Outputs", after[2:])),
            "onnx_layers": _ONNX_META.findall(chunk),
            "allow_sparse": None,
        })
    return out


_OLD_LAYER = re.compile(r"^Layer\(([^)]*)\): (.*?), Tactic: (\S+?), (.*) -> (.*)$")


def _parse_engine_layer_lines(text: str) -> list[dict[str, Any]]:
    """The older verbose log form: "Layer(CaskGemmConvolution): fc1, Tactic: 0x.., x[Int8(8,128)] -> y[Int8(8,64)]"."""
    out = []
    for line in text.splitlines():
        m = _OLD_LAYER.match(line.split("] ", 1)[-1].strip() if line.startswith("[") else line.strip())
        if not m:
            continue
        out.append({
            "name": m.group(2), "type": m.group(1), "parameter_type": None, "tactic": m.group(3),
            "input_types": [normalize_dtype(t) for t in re.findall(r"\[(\w+)\(", m.group(4))],
            "constant_types": [],
            "output_types": [normalize_dtype(t) for t in re.findall(r"\[(\w+)\(", m.group(5))],
            "onnx_layers": [s.strip() for s in m.group(2).split(" + ")],
            "allow_sparse": None,
        })
    return out


def parse_layer_info(text: str) -> list[dict[str, Any]]:
    """Parse the engine's layer information in any form TensorRT writes it.

    - JSON from IEngineInspector (LayerInformationFormat.JSON): {"Layers": [{...}], "Bindings" | "I/O Tensors"};
      tensors carry "Format/Datatype" (TensorRT 8.x-10.x) or separate "Datatype"/"Format" keys;
    - the text form the builder logs ("Layers:" then "Name: ..., LayerType: ..., Inputs: [ { ..., Datatype:
      Int8, Format: ... } ], ..."), as TensorRT-RTX prints it;
    - the older "Engine Layer Information:" lines ("Layer(Type): name, Tactic: ..., in[Int8(..)] -> out[..]").

    Each layer: name, type, parameter_type, tactic, input/constant/output data types (normalized to
    Int8 / Half / Float / ..., None where TensorRT does not say), the ONNX nodes it came from.
    """
    s = text.strip()
    if s.startswith("{"):
        try:
            info = json.loads(s)
        except json.JSONDecodeError as e:
            raise EngineBuildError(f"engine layer information is not valid JSON: {e}") from None
        return [_json_layer(x) for x in info.get("Layers", []) if isinstance(x, Mapping)]
    if re.search(r"(?m)^(?:\[[^\]]*\]\s*)*Layer\([^)]*\): ", s):
        return _parse_engine_layer_lines(s)
    return _parse_oneline(s)


_GEMM_TYPES = ("gemm", "matrixmultiply", "matrix_multiply", "fullyconnected", "fully_connected")


def is_gemm(layer: Mapping[str, Any]) -> bool:
    """A matrix-multiply kernel: a GEMM layer type, a MatrixMultiply/FullyConnected parameter type, a GEMM
    tactic, or a convolution TensorRT made of an ONNX MatMul/Gemm (INT8 MatMuls often run as 1x1 convolutions)."""
    kind = (str(layer.get("type") or "") + " " + str(layer.get("parameter_type") or "")).lower()
    if any(k in kind for k in _GEMM_TYPES) or "gemm" in str(layer.get("tactic") or "").lower():
        return True
    return "conv" in kind and any(str(m).endswith(("MatMul", "Gemm")) for m in layer.get("onnx_layers", []))


def _int8(types: Iterable[str | None]) -> bool:
    return "Int8" in list(types)


_SPARSE_TACTIC = re.compile(r"sparse|sptensor", re.I)


def _opaque_tactic(tactic: Any) -> bool:
    """Whether the tactic name tells nothing about the kernel (empty, a number, Myelin's CASK stub)."""
    t = str(tactic or "").strip()
    return not t or bool(re.fullmatch(r"(0x)?[0-9a-fA-F]+", t)) or "stub" in t.lower()


def sparse_verdict(layer: Mapping[str, Any], *, picked: Sequence[str] = (), eligible: Sequence[str] = (),
                   log_reported: bool = False, jit: bool = False) -> tuple[bool | None, str]:
    """(True / False / None = unknown, why) for one engine GEMM layer."""
    names = {layer.get("name"), *layer.get("onnx_layers", [])}
    tactic = layer.get("tactic")
    if names & set(picked):
        return True, "the builder log lists it under 'picked sparse implementation'"
    if tactic and _SPARSE_TACTIC.search(str(tactic)):
        return True, f"sparse kernel {tactic}"
    if jit:
        return None, "TensorRT-RTX picks this kernel on the GPU at run time; an ahead-of-time build cannot tell"
    if log_reported and names & set(eligible):
        return False, "eligible for sparse math, but the builder picked a dense kernel"
    if _opaque_tactic(tactic):
        if log_reported:
            return False, "not picked sparse (builder log); the kernel name is not shown"
        return None, f"kernel name not shown ({tactic or 'empty'}) and no builder sparsity log"
    return False, f"dense kernel {tactic}"


def gemm_report(layers: Sequence[Mapping[str, Any]], weight_gemms: Sequence[str] | None = None, *,
                picked: Sequence[str] = (), eligible: Sequence[str] = (), log_reported: bool = False,
                jit: bool = False) -> list[dict[str, Any]]:
    """Per weight GEMM (an ONNX MatMul whose weights are Q/DQ constants): engine layer, INT8, sparse or not.

    Without `weight_gemms` (the names from the parsed network), every GEMM layer with INT8 constants
    (or, failing that, every GEMM layer) of the engine is reported.
    """
    gemm_layers = [x for x in layers if is_gemm(x)]
    if weight_gemms is None:
        chosen = [x for x in gemm_layers if _int8(x["constant_types"])] or gemm_layers
        targets = [(x["name"], [x]) for x in chosen]
    else:
        targets = []
        for w in weight_gemms:
            hits = [x for x in gemm_layers if w in x.get("onnx_layers", []) or w == x.get("name")]
            if not hits:
                hits = [x for x in layers if w in x.get("onnx_layers", [])]
            targets.append((w, hits))
    fused = [x for x in layers if "myelin" in str(x.get("type") or "").lower()
             or str(x.get("name") or "").startswith("{ForeignNode")]
    out = []
    for gemm, hits in targets:
        if not hits:
            if not layers:
                out.append({"gemm": gemm, "engine_layer": None, "tactic": None, "int8": None, "sparse": None,
                            "why": "no engine layer information (none in the builder log, and the plan cannot be "
                                   "inspected without a GPU)"})
            elif fused:
                out.append({"gemm": gemm, "engine_layer": fused[0]["name"], "tactic": fused[0].get("tactic"),
                            "int8": None, "sparse": None,
                            "why": "compiled inside a fused (Myelin) region whose kernels the layer information "
                                   "does not list"})
            else:
                out.append({"gemm": gemm, "engine_layer": None, "tactic": None, "int8": None, "sparse": None,
                            "why": "no engine layer names this GEMM"})
            continue
        layer = hits[0]
        sparse, why = sparse_verdict(layer, picked=picked, eligible=eligible, log_reported=log_reported, jit=jit)
        types = [*layer["input_types"], *layer["constant_types"]]
        out.append({
            "gemm": gemm, "engine_layer": layer["name"], "tactic": layer.get("tactic"),
            "int8": True if "Int8" in types else (None if all(t is None for t in types) else False),
            "sparse": sparse, "why": why,
        })
    return out


def summarize_layers(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """GEMM precision and sparse-tactic view of the engine's layers, and what runs outside the GEMMs."""
    gemms = [x for x in layers if is_gemm(x)]
    int8_in = [g for g in gemms if _int8(g["input_types"]) or _int8(g["constant_types"])]
    int8_io = [g for g in int8_in if _int8(g["output_types"])]
    sparse = [g["name"] for g in gemms if _SPARSE_TACTIC.search(str(g.get("tactic") or ""))]
    rest: dict[str, int] = {}
    for x in layers:
        if x in gemms:
            continue
        for t in x["output_types"]:
            if t in FLOAT_TYPES:
                rest[t] = rest.get(t, 0) + 1
    return {
        "layers": len(layers),
        "gemm_layers": len(gemms),
        "gemm_int8_inputs": len(int8_in),
        "gemm_int8_in_int8_out": len(int8_io),
        "gemm_tactics": sorted({str(g.get("tactic") or "") for g in gemms}),
        "sparse_tactic_layers": sparse,
        "onnx_matmuls_in_gemms": sum(sum(1 for m in g["onnx_layers"] if m.endswith("MatMul")) for g in gemms),
        "float_outputs_outside_gemms": dict(sorted(rest.items())),
    }


def runs_in(types: Mapping[str, int]) -> str:
    """{"Float": 12} -> "FP32"; {"Half": 3, "Float": 1} -> "mixed FP16/FP32"; {} -> "unknown"."""
    names = {"Float": "FP32", "Half": "FP16", "BFloat16": "BF16", "FP8": "FP8", "FP4": "FP4"}
    present = [names.get(t, t) for t, n in sorted(types.items(), key=lambda kv: -kv[1]) if n]
    if not present:
        return "unknown"
    return present[0] if len(present) == 1 else "mixed " + "/".join(present)


def precision_summary(flavour: Flavour, fp16: bool, graph_types: Mapping[str, int] | None = None,
                      engine_types: Mapping[str, int] | None = None) -> str:
    """One sentence: INT8 at the Q/DQ GEMMs, and what the engine runs everywhere else."""
    if flavour.strongly_typed:
        outside = runs_in(graph_types or {}) if graph_types else "FP32"
        return (f"strongly typed: INT8 where the ONNX graph has Q/DQ; outside Q/DQ the engine runs {outside}, "
                "the ONNX graph's own types")
    head = "INT8 from the explicit Q/DQ graph"
    if not fp16:
        text = head + "; outside Q/DQ the engine runs FP32"
    elif engine_types:
        text = head + f"; outside Q/DQ the engine runs {runs_in(engine_types)} (FP16 allowed, chosen per layer)"
    else:
        text = head + ("; outside Q/DQ FP16 is allowed and the builder chooses per layer "
                       "(layer information not available)")
    if flavour.precision_flags_deprecated:
        text += "; the INT8/FP16 builder flags are deprecated since TensorRT 10.12"
    return text


def sparsity_report(parsed: Sequence[Mapping[str, Any]], layers: Mapping[str, Any] | None,
                    weight_gemms: Sequence[str], lines: Iterable[str], *, requested: bool, jit: bool) -> dict[str, Any]:
    """The sidecar's "sparsity": per weight GEMM whether it runs a sparse kernel, from the engine's layers
    (`parsed`, summarized in `layers`) and the builder log `lines`; `jit` for TensorRT-RTX, which picks
    kernels at run time."""
    sp = parse_sparsity_log(lines)
    per_gemm = gemm_report(parsed, weight_gemms, picked=sp["picked_sparse"], eligible=sp["eligible"],
                           log_reported=sp["reported"], jit=jit)
    sparse_gemms = [g["gemm"] for g in per_gemm if g["sparse"] is True]
    unknown = [g["gemm"] for g in per_gemm if g["sparse"] is None]
    out = {
        "requested": requested,
        "eligible": sp["eligible"],
        "picked_sparse": sp["picked_sparse"] or (layers or {}).get("sparse_tactic_layers", []),
        "builder_reported": sp["reported"],
        "gemms": per_gemm,
        "sparse_gemms": len(sparse_gemms),
        "dense_gemms": sum(1 for g in per_gemm if g["sparse"] is False),
        "unknown_gemms": len(unknown),
        "verdict": _sparsity_verdict(per_gemm, requested),
    }
    if jit and not sp["reported"]:
        out["note"] = ("TensorRT-RTX compiles GEMM kernels on the target device at first run, so which layers "
                       "use sparse tactics is not known from an ahead-of-time build")
    return out


def _sparsity_verdict(per_gemm: Sequence[Mapping[str, Any]], requested: bool) -> str:
    n = len(per_gemm)
    if not requested:
        return "sparse weights not requested (--no-sparse)"
    if not n:
        return "no INT8 weight GEMM found in the network"
    yes = sum(1 for g in per_gemm if g["sparse"] is True)
    no = sum(1 for g in per_gemm if g["sparse"] is False)
    unknown = n - yes - no
    parts = [f"{yes} of {n} weight GEMMs run sparse kernels"]
    if no:
        parts.append(f"{no} dense")
    if unknown:
        parts.append(f"{unknown} unknown")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------ sidecar


@dataclass(frozen=True)
class PlanBuild:
    """How the plan was built: TensorRT flavour, target GPU, shape profile, flags, time, size, timing cache."""

    flavour: Flavour
    target: Mapping[str, Any]
    profile: ShapeProfile
    settings: Mapping[str, list[str]]  # engine_settings.builder_settings: network and builder flag names
    build_seconds: float
    plan_bytes: int
    timing_cache: str | None


@dataclass(frozen=True)
class ParsedNetwork:
    """What TensorRT's ONNX parser made of the export: its I/O tensors and a summary of its layers."""

    inputs: Sequence[Mapping[str, Any]]
    outputs: Sequence[Mapping[str, Any]]
    parser: Mapping[str, Any]
    onnx_file: str
    onnx_sha256: str | None


@dataclass(frozen=True)
class EngineReport:
    """What the engine runs: the precision summary, the per-GEMM sparsity report, the layer summary."""

    precision: str
    sparsity: Mapping[str, Any]
    layers: Mapping[str, Any] | None
    precision_outside_qdq: Mapping[str, Any] | None = None


def make_sidecar(build: PlanBuild, network: ParsedNetwork, report: EngineReport) -> dict[str, Any]:
    """The JSON written next to the plan (holoserve.core.sidecar reads it back)."""
    flavour, target, profile, settings = build.flavour, build.target, build.profile, build.settings
    inputs, outputs, parser = network.inputs, network.outputs, network.parser
    precision, sparsity, layers = report.precision, report.sparsity, report.layers
    precision_outside_qdq = report.precision_outside_qdq
    onnx_file, onnx_sha256 = network.onnx_file, network.onnx_sha256
    build_seconds, plan_bytes, timing_cache = build.build_seconds, build.plan_bytes, build.timing_cache
    return {
        "format": SIDECAR_FORMAT,
        "version": SIDECAR_VERSION,
        "tensorrt": {"flavour": flavour.name, "module": flavour.module, "version": flavour.version},
        "target": dict(target),
        "profiles": [profile.shapes([i["name"] for i in inputs])],
        "inputs": list(inputs),
        "outputs": list(outputs),
        "precision": precision,
        "precision_outside_qdq": dict(precision_outside_qdq) if precision_outside_qdq else None,
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
