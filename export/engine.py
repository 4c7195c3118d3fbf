"""The one TensorRT engine builder: datacenter TensorRT 10 / 11 (`tensorrt`) or TensorRT-RTX (`tensorrt_rtx`).

Every difference between the flavours lives in `Flavour` and `builder_settings`:

| flavour            | network                   | precision flags             | target GPU                        |
|--------------------|---------------------------|-----------------------------|-----------------------------------|
| tensorrt 10        | weakly typed              | INT8 (explicit QDQ) + FP16  | the GPU of the building machine   |
|                    |                           | (deprecated from 10.12)     |                                   |
| tensorrt >= 11     | strongly typed (always)   | none: precision = the graph | the GPU of the building machine   |
| tensorrt_rtx       | strongly typed (always)   | none: precision = the graph | portable (8.0/8.6/8.9/12.0+) by   |
|                    |                           |                             | default, or pinned; built ahead   |
|                    |                           |                             | of time on a CPU-only machine     |

SPARSE_WEIGHTS is set in all of them unless disabled. Everything that needs no library (shape
profiles, flag selection, layer-information and log parsing, the per-GEMM sparsity report, the
sidecar) is a plain function; the library is imported lazily in `load_trt` with a clear message when
absent. Nothing here imports torch or onnx, so `holoserve build-engine` runs in the GPU image with
only TensorRT installed.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from holoserve import HoloServeError
from holoserve.core.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from holoserve.core.sidecar import (
    RTX_PORTABLE,
    SIDECAR_FORMAT,
    SIDECAR_VERSION,
    EngineMismatchError,
    check_compatible,
    current_gpu,
    engine_cache_dir,
    read_sidecar,
)

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
# What TensorRT-RTX can pin (ComputeCapability enum names); Hopper SM90 is not among them.
RTX_COMPUTE_CAPABILITIES = ("SM75", "SM80", "SM86", "SM89", "SM120", "SM121")


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
    def version_tuple(self) -> tuple[int, int]:
        m = re.match(r"(\d+)(?:\.(\d+))?", self.version)
        return (int(m.group(1)), int(m.group(2) or 0)) if m else (0, 0)

    @property
    def major(self) -> int:
        return self.version_tuple[0]

    @property
    def strongly_typed(self) -> bool:
        """TensorRT-RTX and TensorRT >= 11 only build strongly typed networks (no INT8/FP16 flags)."""
        return self.module == "tensorrt_rtx" or self.major >= 11

    @property
    def precision_flags_deprecated(self) -> bool:
        """TensorRT 10.12 deprecated the INT8/FP16 builder flags (TensorRT 11 removed them)."""
        return self.module == "tensorrt" and (10, 12) <= self.version_tuple < (11, 0)

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
        "no TensorRT library is installed (" + "; ".join(errors) + "). On a GPU server use the GPU image "
        "(docker/Dockerfile.gpu, datacenter TensorRT) or pip install tensorrt-cu12; to build ahead of time "
        "without a GPU install TensorRT-RTX: tensorrt-rtx-cu12 for a CUDA 12 driver, tensorrt-rtx-cu13 for "
        "a CUDA 13 driver"
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


# ------------------------------------------------------------------------------------------ target GPU


def cc_label(cc: str) -> str:
    """"8.0" / "SM80" / "sm_80" -> "SM80"."""
    s = cc.strip().upper().replace("SM_", "SM")
    if s.startswith("SM"):
        if not re.fullmatch(r"SM\d{2,3}", s):
            raise EngineBuildError(f"compute capability {cc!r} is not like 8.0 or SM80")
        return s
    m = re.fullmatch(r"(\d+)\.(\d+)", s)
    if not m:
        raise EngineBuildError(f"compute capability {cc!r} is not like 8.0 or SM80")
    return f"SM{m.group(1)}{m.group(2)}"


def gpu_info() -> dict[str, Any] | None:
    """Name and compute capability of the GPU this process runs on (CUDA's current device); None without one."""
    return current_gpu()


def requested_ccs(compute_capability: str | Sequence[str] | None) -> list[str]:
    """"SM86, sm_89" (or a list) -> ["SM86", "SM89"]; [] for None or "portable"."""
    if compute_capability is None:
        return []
    items = compute_capability.split(",") if isinstance(compute_capability, str) else list(compute_capability)
    items = [c.strip() for c in items if c and c.strip()]
    if any(c.lower() in ("portable", "all", "default") for c in items):
        return []
    labels: list[str] = []
    for c in items:
        if cc_label(c) not in labels:
            labels.append(cc_label(c))
    return labels


def rtx_targets(compute_capability: str | Sequence[str] | None) -> list[str]:
    """TensorRT-RTX targets: [] for a portable engine (the default), else the pinned SM labels."""
    labels = requested_ccs(compute_capability)
    for cc in labels:
        if cc not in RTX_COMPUTE_CAPABILITIES:
            raise EngineBuildError(
                f"TensorRT-RTX cannot build for {cc}; choose one of {', '.join(RTX_COMPUTE_CAPABILITIES)}, or leave "
                "--compute-capability out for a portable engine (Hopper SM90 needs datacenter TensorRT)"
            )
    return labels


def build_target(flv: Flavour, compute_capability: str | Sequence[str] | None = None,
                 gpu: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the plan will run on, as recorded in the sidecar (and used as the engine-cache key)."""
    if flv.aot:
        labels = rtx_targets(compute_capability)
        if not labels:
            return {"compute_capability": None, "compute_capabilities": list(RTX_PORTABLE), "portable": True,
                    "gpu": None, "built_on": "ahead of time (no GPU needed), portable"}
        if len(labels) == 1:
            return {"compute_capability": labels[0], "gpu": None, "built_on": "ahead of time (no GPU needed)"}
        return {"compute_capability": None, "compute_capabilities": labels, "portable": True, "gpu": None,
                "built_on": "ahead of time (no GPU needed)"}
    gpu = gpu if gpu is not None else gpu_info()
    if gpu is None:
        raise EngineBuildError("datacenter TensorRT builds for the GPU it runs on, and no GPU was found "
                               "(check CUDA_VISIBLE_DEVICES and that the container was started with --gpus)")
    have = cc_label(gpu["compute_capability"])
    wanted = requested_ccs(compute_capability)
    if wanted and wanted != [have]:
        raise EngineBuildError(
            f"datacenter TensorRT builds for the GPU it runs on ({gpu['name']}, {have}); "
            f"--compute-capability {','.join(wanted)} cannot be honoured: leave it out, or run the build on that GPU"
        )
    return {"compute_capability": have, "gpu": gpu["name"], "built_on": "this GPU",
            "device": gpu.get("device"), "probe": gpu.get("source")}


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
        text = head + "; outside Q/DQ FP16 is allowed and the builder chooses per layer (layer information not available)"
    if flavour.precision_flags_deprecated:
        text += "; the INT8/FP16 builder flags are deprecated since TensorRT 10.12"
    return text


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
                meta = _ONNX_META.findall(str(getattr(layer, "metadata", "") or ""))
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


# ------------------------------------------------------------------------------------------ sidecar


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
    precision_outside_qdq: Mapping[str, Any] | None = None,
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

        def log(self, severity, msg):  # noqa: A003 - TensorRT's interface
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


def build_engine(
    onnx_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    profile: ShapeProfile = ShapeProfile(),
    sparse: bool = True,
    fp16: bool = True,
    workspace: int | None = None,
    timing_cache: str | os.PathLike | None = None,
    compute_capability: str | Sequence[str] | None = None,
    flavour: str | None = None,
    verbose: bool = False,
    log_path: str | os.PathLike | None = None,
    require_sparse: bool = False,
    onnx_sha256: str | None = None,
) -> BuildResult:
    """Parse `onnx_path`, build a serialized engine at `out` and its JSON sidecar at `out`.json.

    compute_capability: TensorRT-RTX only; None builds a portable engine, "SM86" (or "SM86,SM89")
    pins it. require_sparse: refuse (write nothing) unless at least one weight GEMM is known to run a
    sparse kernel.
    """
    if require_sparse and not sparse:
        raise EngineBuildError("--require-sparse needs sparse weights: drop --no-sparse")
    trt, flv = load_trt(flavour)
    onnx_path, out = Path(onnx_path), Path(out)
    if not onnx_path.is_file():
        raise EngineBuildError(f"ONNX file {onnx_path} does not exist")
    target = build_target(flv, compute_capability)
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
    if workspace:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace))
    if hasattr(trt, "ProfilingVerbosity"):
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    pinned = rtx_targets(compute_capability) if flv.aot else []
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
        opt_profile.set_shape(t.name, profile.min, profile.opt, profile.max)
    config.add_optimization_profile(opt_profile)

    cache_note = None
    if timing_cache and flv.aot:
        # TensorRT-RTX picks kernels on the device at run time; its timing-cache calls are deprecated
        # no-ops that would make the ahead-of-time build look for a GPU.
        cache_note = "not used: TensorRT-RTX has no build-time timing cache (the file is left as it was)"
    elif timing_cache:
        tc_path = Path(timing_cache)
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
    if log_path:
        atomic_write_text(Path(log_path), "\n".join(lines) + "\n")

    parsed, layer_source = _layer_information(trt, flv, lines, plan, logger, profile)
    layers = summarize_layers(parsed) if parsed is not None else None
    if layers is not None:
        layers["source"] = layer_source
    sp = parse_sparsity_log(lines)
    per_gemm = gemm_report(parsed or [], gemm_names, picked=sp["picked_sparse"], eligible=sp["eligible"],
                           log_reported=sp["reported"], jit=flv.aot)
    picked_gemms = [g["gemm"] for g in per_gemm if g["sparse"] is True]
    unknown = [g["gemm"] for g in per_gemm if g["sparse"] is None]
    sparsity = {
        "requested": sparse,
        "eligible": sp["eligible"],
        "picked_sparse": sp["picked_sparse"] or (layers or {}).get("sparse_tactic_layers", []),
        "builder_reported": sp["reported"],
        "gemms": per_gemm,
        "sparse_gemms": len(picked_gemms),
        "dense_gemms": sum(1 for g in per_gemm if g["sparse"] is False),
        "unknown_gemms": len(unknown),
        "verdict": _sparsity_verdict(per_gemm, sparse),
    }
    if flv.aot and not sp["reported"]:
        sparsity["note"] = ("TensorRT-RTX compiles GEMM kernels on the target device at first run, so which layers "
                            "use sparse tactics is not known from an ahead-of-time build")
    if require_sparse and not picked_gemms:
        raise EngineBuildError(
            f"--require-sparse: {sparsity['verdict']}; no plan was written. "
            + ("TensorRT-RTX cannot confirm sparse kernels ahead of time; build with datacenter TensorRT on the "
               "serving GPU to check. " if flv.aot else
               "Check that the weights are 2:4 along K and that the GPU supports sparse tensor cores (SM80+). ")
            + (f"Builder log: {log_path}" if log_path else "Rerun with --log PATH to keep the builder log")
        )
    engine_types = (layers or {}).get("float_outputs_outside_gemms") or None
    outside = {
        "graph": graph_types,
        "engine": engine_types,
        "runs": (runs_in(graph_types) if flv.strongly_typed else
                 runs_in(engine_types) if engine_types else ("FP16/FP32, chosen by the builder" if fp16 else "FP32")),
        "source": ("the ONNX graph (strongly typed network)" if flv.strongly_typed else
                   f"engine layer information ({layer_source})" if engine_types else "builder flags"),
    }
    if missing_flags:
        outside["builder_flags_missing"] = missing_flags
    precision = precision_summary(flv, fp16, graph_types, engine_types)
    sidecar = make_sidecar(
        flavour=flv, target=target, profile=profile,
        inputs=[{"name": t.name, "dtype": _type_name(t.dtype), "shape": list(t.shape)} for t in inputs],
        outputs=[{"name": t.name, "dtype": _type_name(t.dtype), "shape": list(t.shape)} for t in outputs],
        settings=settings, precision=precision, sparsity=sparsity, layers=layers,
        parser=parser_info, onnx_file=onnx_path.name, onnx_sha256=onnx_sha256 or _sha256(onnx_path),
        build_seconds=seconds, plan_bytes=len(plan), timing_cache=cache_note, precision_outside_qdq=outside,
    )
    atomic_write_bytes(out, plan)
    if timing_cache and not flv.aot:
        saved = save_timing_cache(config, Path(timing_cache))
        if saved:
            sidecar["timing_cache"] = f"{cache_note}; {saved}"
    side = out.with_name(out.name + ".json")
    atomic_write_json(side, sidecar)  # last: a sidecar next to a plan means the plan is complete
    return BuildResult(out, side, sidecar, lines)


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


# ------------------------------------------------------------------------------------------ engine cache


def up_to_date(plan: Path, *, flavour: Flavour, target: Mapping[str, Any], onnx_sha256: str) -> str | None:
    """None if `plan` (with its sidecar) was built from this ONNX by this TensorRT for this target; else why not."""
    if not plan.is_file():
        return f"{plan.name} does not exist"
    try:
        side = read_sidecar(plan)
        check_compatible(side, flavour=flavour.name, version=flavour.version,
                         compute_capability=None if target.get("portable") else target.get("compute_capability"))
    except EngineMismatchError as e:
        return str(e)
    if (side.get("onnx") or {}).get("sha256") != onnx_sha256:
        return "it was built from another ONNX export"
    built = side.get("target") or {}
    if (bool(built.get("portable")), built.get("compute_capabilities")) != (
            bool(target.get("portable")), target.get("compute_capabilities")):
        return "it was built for other compute capabilities"
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (one build per engine, even with several server workers starting at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            yield
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_cached_engine(onnx_path: str | os.PathLike, cache_root: str | os.PathLike, *, onnx_sha256: str | None = None,
                        if_missing: bool = True, flavour: str | None = None,
                        compute_capability: str | Sequence[str] | None = None, **build_kw: Any) -> BuildResult:
    """Build into <cache>/<model>/<flavour-version-GPU>/model.plan, or reuse the engine already there.

    The key (holoserve.core.sidecar.engine_cache_dir) names the TensorRT flavour and version and the
    GPU, so one volume serves several GPUs and image versions; the build holds a lock so concurrent
    server workers build once.
    """
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise EngineBuildError(f"ONNX file {onnx_path} does not exist")
    sha = onnx_sha256 or _sha256(onnx_path)
    _, flv = load_trt(flavour)
    target = build_target(flv, compute_capability)
    folder = engine_cache_dir(cache_root, sha, flv.name, flv.version, target)
    plan = folder / "model.plan"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EngineBuildError(f"cannot create the engine cache folder {folder}: {e}; mount a writable volume "
                               "there (the server runs as uid 10001)") from None
    with _locked(folder.with_name(folder.name + ".lock")):
        if if_missing and up_to_date(plan, flavour=flv, target=target, onnx_sha256=sha) is None:
            side = read_sidecar(plan)
            return BuildResult(plan, plan.with_name(plan.name + ".json"), side, [], skipped=True)
        return build_engine(onnx_path, plan, flavour=flv.module, compute_capability=compute_capability,
                            onnx_sha256=sha, **build_kw)
