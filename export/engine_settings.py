"""What a TensorRT engine build is for: the library flavour, its builder flags, the shape profile and
the target GPU, and `EngineOptions`, the settings of one build.

| flavour            | network                   | precision flags             | target GPU                        |
|--------------------|---------------------------|-----------------------------|-----------------------------------|
| tensorrt 10        | weakly typed              | INT8 (explicit QDQ) + FP16  | the GPU of the building machine   |
|                    |                           | (deprecated from 10.12)     |                                   |
| tensorrt >= 11     | strongly typed (always)   | none: precision = the graph | the GPU of the building machine   |
| tensorrt_rtx       | strongly typed (always)   | none: precision = the graph | portable (8.0/8.6/8.9/12.0+) by   |
|                    |                           |                             | default, or pinned; built ahead   |
|                    |                           |                             | of time on a CPU-only machine     |

SPARSE_WEIGHTS is set in all of them unless disabled. Every difference between the flavours lives
in `Flavour` and `builder_settings`; the library is imported lazily in `load_trt` with a clear
message when absent.
"""
from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from holoserve import HoloServeError
from holoserve.core.sidecar import RTX_PORTABLE, current_gpu

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


# ------------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class EngineOptions:
    """How `build_engine` builds; the defaults are what `holoserve build-engine` does.

    compute_capability: TensorRT-RTX only; None builds a portable engine, "SM86" (or "SM86,SM89")
    pins it. require_sparse: refuse (write nothing) unless at least one weight GEMM is known to run a
    sparse kernel. flavour: "tensorrt" or "tensorrt_rtx" (None: datacenter TensorRT first).
    """

    profile: ShapeProfile = ShapeProfile()
    sparse: bool = True
    fp16: bool = True
    workspace: int | None = None
    timing_cache: str | os.PathLike | None = None
    compute_capability: str | Sequence[str] | None = None
    flavour: str | None = None
    verbose: bool = False
    log_path: str | os.PathLike | None = None
    require_sparse: bool = False
