"""OpenVINO backend (CPU): the checkpoint's own quantized model (our QDQ placement and calibrated ranges)
compiled by OpenVINO, whose CPU plugin runs the Q/DQ Linears as u8 x i8 GEMMs.

It reads the `openvino` export (`holoserve export CKPT`, which writes it where OpenVINO is installed: the
ONNX Runtime placement in standard ONNX ops, with the [CLS]-row rewrite). On CPUs with AMX, OpenVINO can
also decompress sparse INT8 weights (`CPU_SPARSE_WEIGHTS_DECOMPRESSION_RATE`): 2:4 weights are half zeros.
It is off by default, having shown no consistent gain for MiniLM (docs/results/2026-11-24-openvino.md);
`sparse=True` (`--openvino-sparse-weights`) turns it on where the CPU has AMX; `info()` reports which.

The float ops around the Q/DQ GEMMs run at OpenVINO's inference precision. Its CPU plugin defaults to
bf16 on CPUs with AVX-512 BF16 or AMX, which changes a few predictions against `holoserve eval` (the
checkpoint's numerics, which ONNX Runtime reproduces); `precision="f32"` keeps them in float32, at some
speed. `info()` reports the precision in use.

HoloServe's 2:4 kernels (`kernels="auto"`, the default; `--openvino-kernels`): on CPUs with AVX-512 VNNI
and VBMI and no AMX (or AMX withheld: ONEDNN_MAX_CPU_ISA below it, or the OS refusing it to the process), the
2:4 INT8 Linears run on our own OpenVINO extension (holoserve.kernels), which skips the zeros
(docs/results/2026-11-27-sparse24-kernels.md). Under `auto`, anything that keeps them from
running (the CPU, no build, a library that does not load or compile) leaves OpenVINO's own GEMMs in
charge; `info()["kernels"]` says whether they run and why. `kernels="reference"` runs their portable scalar
build on any x86-64 CPU: the same numbers, many times slower, to check a checkpoint's predictions through the
kernels' graph on a machine that cannot run them.

Static shapes (`shapes=[(batch, seq), ...]`, `--openvino-shapes 1x128,32x128`): OpenVINO's CPU plugin
fuses the element-wise ops around the quantized GEMMs (LayerNorm's affine, the activation quantizers,
residual adds) into JIT subgraphs only when every dimension is static; with dynamic shapes each runs as
its own pass (docs/results/2026-11-24-openvino.md). The backend compiles one such model per listed shape
beside the dynamic one, and runs a batch on the smallest listed shape that holds it when padding it up
adds at most STATIC_PAD_SHARE of its tokens: extra rows repeat the first row, extra positions are masked
out, and the padded rows' logits are dropped. Every other batch runs on the dynamic model. Worth it where
traffic has fixed shapes (clients padding to a fixed length, offline scoring at a fixed batch size).
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from holoserve import HoloServeError
from holoserve.core.artifact import Artifact
from holoserve.core import int8_probe
from holoserve.core.choices import OPENVINO_KERNELS, OPENVINO_KERNELS_DEFAULT, OPENVINO_PRECISIONS
from holoserve.core.machine import cpu_flags
from holoserve.core.manifest import OPENVINO

from .base import BackendUnavailable

log = logging.getLogger("holoserve.backends")

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
SPARSE_RATE = 0.5  # every 2:4 weight is at least half zeros
# A batch is padded up to a listed static shape only when that adds at most this share to the tokens the
# dynamic model would run it at (its length padded to SEQ_MULTIPLE): a static shape saves more than that, so a
# little padding still pays and more would not.
STATIC_PAD_SHARE = 0.10
# The dynamic model's sequence lengths are padded up to a multiple of this (within the checkpoint's length):
# OpenVINO prepares its kernels for each new input shape and keeps them for shapes it has seen, so few
# lengths that recur cost less than every exact length once (docs/results/2026-11-29-amx-xeon-served.md).
SEQ_MULTIPLE = 16
PRECISIONS = OPENVINO_PRECISIONS  # INFERENCE_PRECISION_HINT values (holoserve.core.choices)
KERNEL_CHOICES = OPENVINO_KERNELS
DEFAULT_KERNELS = OPENVINO_KERNELS_DEFAULT


INT8_SATURATES = ("OpenVINO's int8 GEMMs saturate on this CPU (x86-64 without VNNI: each pair of u8 x s8 products is "
                  "added in 16 bits), so its predictions can differ from the checkpoint's; ONNX Runtime computes "
                  "them exactly here")


PROBE_ENV = int8_probe.ENV


def int8_gemm_saturates() -> bool:
    """Whether OpenVINO's CPU plugin computes an INT8 MatMul wrongly on this CPU (holoserve.core.int8_probe),
    measured once per process; False where OpenVINO is not installed. HOLOSERVE_INT8_PROBE=exact or
    saturates states the answer instead (tests of either kind of CPU, a fleet whose CPUs are known)."""
    stated = int8_probe.stated()
    return stated if stated is not None else _measured_saturates()


@functools.lru_cache(maxsize=1)
def _measured_saturates() -> bool:
    try:
        import openvino as ov
    except ImportError:
        return False
    core = ov.Core()  # the model from memory: a server's container may have no writable temporary folder
    model = core.read_model(int8_probe.probe_onnx(), ov.Tensor(np.empty(0, np.uint8)))
    compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 1})
    y = compiled(int8_probe.FEED)[compiled.outputs[0]]
    return not int8_probe.exact(y)


# OpenVINO's CPU plugin runs oneDNN, which honours ONEDNN_MAX_CPU_ISA: set below an AMX level (e.g.
# AVX512_CORE_BF16), it uses no AMX tiles, and the CPU is then the AVX-512 VNNI CPU the 2:4 kernels are for.
ISA_LIMIT_ENV = "ONEDNN_MAX_CPU_ISA"
_ARCH_PRCTL = 158  # x86-64 Linux syscall number
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 0x1023, 18


def isa_limit() -> str | None:
    """ONEDNN_MAX_CPU_ISA as set in this process (upper case), or None where it is unset or places no cap."""
    limit = os.environ.get(ISA_LIMIT_ENV, "").strip().upper()
    return None if limit in ("", "ALL", "DEFAULT") else limit


@functools.lru_cache(maxsize=1)
def amx_permitted() -> bool:
    """Whether Linux lets this process use AMX tile data: the request oneDNN and ONNX Runtime make before their
    first AMX instruction (arch_prctl ARCH_REQ_XCOMP_PERM), which a seccomp rule or an old kernel refuses, and
    then both run their AVX-512 VNNI kernels on a CPU that has AMX."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def amx_withheld() -> str | None:
    """Why OpenVINO runs no AMX tiles on a CPU that has them (a cap on oneDNN, or the OS refusing them to this
    process); None where the CPU has none or they run."""
    if "amx_int8" not in cpu_flags():
        return None
    limit = isa_limit()
    if limit is not None and "AMX" not in limit:
        return f"{ISA_LIMIT_ENV}={limit}"
    if not amx_permitted():
        return "the OS refuses AMX to this process (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


def cpu_has_amx() -> bool:
    """Whether OpenVINO's GEMMs can use AMX int8 tiles here: the CPU has them and they are not withheld."""
    return "amx_int8" in cpu_flags() and amx_withheld() is None


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise HoloServeError(f"unknown OpenVINO precision {precision!r}: choose one of {', '.join(PRECISIONS)} "
                             "(f32 matches `holoserve eval`; auto is OpenVINO's default, bf16 on CPUs with bf16 units)")
    return precision


def check_kernels(kernels: str) -> str:
    if kernels not in KERNEL_CHOICES:
        raise HoloServeError(f"unknown --openvino-kernels {kernels!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    return kernels


def kernels_plan(kernels: str, precision: str) -> tuple[Path | None, bool, str]:
    """(the kernels' library, or None to run OpenVINO's GEMMs; in bf16; why) for --openvino-kernels and the
    float precision.
    `on` raises HoloServeError where they cannot run; `auto` falls back to OpenVINO's GEMMs and says why,
    and leaves CPUs with AMX to OpenVINO (its AMX int8 GEMMs are another class of speed than VNNI).
    `reference` runs their portable scalar build (holoserve.kernels.REFERENCE) on any x86-64 CPU, or raises."""
    check_kernels(kernels)
    if kernels == "off":
        return None, False, "off (--openvino-kernels off)"
    from holoserve.kernels import REFERENCE, KernelsUnavailable, locate

    bf16 = precision in ("bf16", "auto") and cpu_has_bf16()  # elsewhere OpenVINO runs a bf16 hint in f32
    if kernels == "auto" and cpu_has_amx():
        return None, False, ("off: this CPU has AMX, whose int8 tiles OpenVINO's GEMMs use and the kernels "
                              "(AVX-512 VNNI) do not; --openvino-kernels on forces them")
    if precision == "f16":
        why = "off: the kernels read and write f32 or bf16, not f16"
        if kernels != "auto":
            raise HoloServeError(f"--openvino-kernels {kernels}: {why[5:]}; use --openvino-precision auto, bf16 "
                                 "or f32")
        return None, False, why
    try:  # the AVX-512 build checks the CPU's flags first; either builds only where a compiler is present
        library = locate(REFERENCE) if kernels == REFERENCE else locate()
    except KernelsUnavailable as e:
        if kernels != "auto":
            raise
        return None, False, f"off: {e}"
    precision_note = f"{'bf16' if bf16 else 'f32'} in and out"
    if kernels == REFERENCE:
        return library, bf16, (f"reference (HoloServe's 2:4 INT8 kernels from their portable reference build, "
                               f"{precision_note}: the AVX-512 build's numbers, many times slower)")
    return library, bf16, f"on (HoloServe's 2:4 INT8 kernels, {precision_note})"


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """Whether OpenVINO's CPU plugin runs bf16 here (its BF16 capability: the CPU has bf16 units). It runs the
    float ops in bf16 by default where it can, and in f32 where it cannot, even when asked for bf16."""
    try:
        import openvino as ov

        return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except Exception:  # no OpenVINO, or a plugin without the property: the CPU's flags say the same
        return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


@functools.lru_cache(maxsize=4)
def _rewritten(path: str, mtime_ns: int, bf16: bool) -> tuple[bytes, dict[str, int]]:
    """The export with its 2:4 Linears on HoloServe's kernels, serialized (cached per file and version)."""
    import onnx

    from holoserve.kernels.rewrite import rewrite

    model, counts = rewrite(onnx.load(path), bf16=bf16)
    return model.SerializeToString(), counts


def read_model(core, path: str | os.PathLike, library: Path | None = None, bf16: bool = False):
    """(ov.Model, kernel counts or None) of an ONNX file; with the kernels' `library` (kernels_plan), its
    2:4 INT8 Linears run on HoloServe's kernels (the extension is added to `core`)."""
    if library is None:
        return core.read_model(str(path)), None
    core.add_extension(str(library))
    data, counts = _rewritten(str(path), Path(path).stat().st_mtime_ns, bf16)
    import openvino as ov

    # from memory: a server's container may have no writable temporary folder
    return core.read_model(data, ov.Tensor(np.empty(0, np.uint8))), counts


@dataclass(frozen=True)
class Streams:
    """OpenVINO CPU threads (0: its default) split into `streams` that each run one request at a time."""

    threads: int = 0
    streams: int = 1


def _cpu_config(threads: int | Streams) -> dict[str, Any]:
    plan = threads if isinstance(threads, Streams) else Streams(int(threads))
    config: dict[str, Any] = ({"PERFORMANCE_HINT": "LATENCY"} if plan.streams <= 1 else
                              {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": int(plan.streams)})
    if plan.streams > 1:  # the server's own threads share the cores: a pinned stream they preempt would stall
        config["ENABLE_CPU_PINNING"] = False
    if plan.threads > 0:
        config["INFERENCE_NUM_THREADS"] = int(plan.threads)
    return config


class RequestPool:
    """One infer request per stream of a compiled model; `run` takes a free one, so that as many batches as
    there are streams run at once."""

    def __init__(self, compiled, size: int):
        self.compiled = compiled
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(max(1, size)):
            self._free.put(compiled.create_infer_request())

    def run(self, feed: dict[str, np.ndarray], output) -> np.ndarray:
        request = self._free.get()
        try:
            out = request.infer(feed)
            return np.asarray(out[output], dtype=np.float32).copy()
        finally:
            self._free.put(request)


def compile_model(path: str | os.PathLike, *, threads: int | Streams = 0, sparse: bool = False,
                  precision: str = "auto", shape: tuple[int, int] | None = None, extra_outputs: Sequence[str] = (),
                  kernels: str = "off", report: dict | None = None):
    """(compiled model, sparse-weights note) for an ONNX file on OpenVINO's CPU plugin; `shape` (batch,
    seq) compiles it for that one static shape; `extra_outputs` also exposes those tensors (diagnostics:
    it keeps OpenVINO from fusing across them); `kernels` (auto, on, off) runs the 2:4 INT8 Linears on
    HoloServe's kernels (holoserve.kernels); `report`, when given, gets what they did and why."""
    check_precision(precision)
    library, bf16, kernels_note = kernels_plan(kernels, precision)
    try:
        import openvino as ov
    except ImportError as e:
        raise BackendUnavailable(f"OpenVINO is not installed ({e}): pip install 'holoserve[openvino]'") from None
    core = ov.Core()
    config = _cpu_config(threads)
    if precision != "auto":
        config["INFERENCE_PRECISION_HINT"] = precision
    amx = cpu_has_amx()
    if sparse and amx:
        config["CPU_SPARSE_WEIGHTS_DECOMPRESSION_RATE"] = SPARSE_RATE
        note = f"on (CPU_SPARSE_WEIGHTS_DECOMPRESSION_RATE {SPARSE_RATE}: AMX present)"
    elif not amx:
        note = "off: this CPU has no AMX (OpenVINO decompresses sparse INT8 weights only with AMX)"
    else:
        note = "off (the default; AMX present: --openvino-sparse-weights turns it on)"

    def compile_with(library: Path | None):
        model, counts = read_model(core, path, library, bf16)
        if extra_outputs:
            model.add_outputs(list(extra_outputs))
        if shape is not None:
            model.reshape({i.get_any_name(): ov.PartialShape([int(shape[0]), int(shape[1])]) for i in model.inputs})
        return core.compile_model(model, "CPU", config), counts

    try:
        compiled, counts = compile_with(library)
    except Exception as e:  # OpenVINO raises RuntimeError subclasses with long messages
        first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        if library is None or kernels != "auto":
            what = "with HoloServe's 2:4 kernels " if library is not None else ""
            raise BackendUnavailable(f"OpenVINO cannot compile {path} {what}({first})"
                                     + ("; --openvino-kernels auto falls back to OpenVINO's GEMMs" if what else "")
                                     ) from None
        # auto: a library that does not load, or a rewrite OpenVINO refuses, costs speed, not service
        kernels_note = f"off: the kernels failed to load or compile ({first}); OpenVINO's GEMMs run instead"
        core = ov.Core()  # a fresh core, without the extension that failed
        try:
            compiled, counts = compile_with(None)
        except Exception as e2:
            raise BackendUnavailable(f"OpenVINO cannot compile {path}: {str(e2).splitlines()[0][:300]}") from None
    check_gemm_kernels(compiled, path)
    if report is not None:
        report.update({"status": kernels_note, **(counts or {})})
    return compiled, note


def check_gemm_kernels(compiled, path) -> dict[str, int]:
    """The GEMM kernel counts, after one tiny run if the kernels are not chosen yet. Raises
    BackendUnavailable when any GEMM runs OpenVINO's reference kernel, too slow for a server to answer
    in time; why: docs/results/2026-11-24-openvino.md"""
    kernels = gemm_kernels(compiled)
    if any(k.startswith("undef") for k in kernels):
        request = compiled.create_infer_request()
        probe = {}
        for port in compiled.inputs:  # ids and mask 1, segments 0, in each input's own integer type
            shape = port.get_partial_shape()
            dims = [1, 4] if shape.is_dynamic else [d.get_length() for d in shape]
            value = int(port.get_any_name() != "token_type_ids")
            probe[port.get_any_name()] = np.full(dims, value, dtype=port.get_element_type().to_dtype())
        request.infer(probe)
        kernels = gemm_kernels(compiled)
    slow = sum(n for k, n in kernels.items() if k.startswith("ref"))
    if slow:
        raise BackendUnavailable(
            f"OpenVINO would run {slow} of {sum(kernels.values())} GEMMs of {Path(path).name} in its reference "
            f"kernel at inference precision {inference_precision(compiled)} on this CPU (far too slow to "
            "serve); use --openvino-precision auto, bf16 or f32")
    return kernels


def _count_gemms(compiled, key: str) -> dict[str, int]:
    """How many of the compiled graph's GEMMs carry each value of a runtime-model property."""
    out: dict[str, int] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        kind = info["layerType"].astype(str) if "layerType" in info else op.get_type_name()
        if kind in ("FullyConnected", "MatMul"):
            value = info[key].astype(str) if key in info else "?"
            out[value] = out.get(value, 0) + 1
    return out


def gemm_precisions(compiled) -> dict[str, int]:
    """How many of the compiled graph's GEMMs run at each precision (e.g. {'u8': 36, 'bf16': 2})."""
    return _count_gemms(compiled, "runtimePrecision")


def gemm_kernels(compiled) -> dict[str, int]:
    """How many of the compiled graph's GEMMs run each CPU kernel (e.g. {'brgemm_avx512_amx_I8': 36}).
    A dynamic-shape model picks its kernels at its first run: before it they read 'undef'."""
    return _count_gemms(compiled, "primitiveType")


def parse_shapes(spec: str | Sequence[Sequence[int]] | None, max_seq_length: int | None = None
                 ) -> list[tuple[int, int]]:
    """Static shapes from "1x128,32x128" (or a list of (batch, seq) pairs): sorted by size, duplicates
    dropped. Raises HoloServeError naming the bad item and the expected form."""
    if not spec:
        return []
    items = [x.strip() for x in spec.split(",") if x.strip()] if isinstance(spec, str) else list(spec)
    out = set()
    for item in items:
        try:
            b, s = (int(v) for v in (item.lower().split("x") if isinstance(item, str) else item))
        except (TypeError, ValueError):
            raise HoloServeError(f"bad OpenVINO static shape {item!r}: write BATCHxSEQ, e.g. 1x128 or "
                                 "1x128,32x128") from None
        if b < 1 or s < 1:
            raise HoloServeError(f"bad OpenVINO static shape {item!r}: batch and sequence length must be >= 1")
        if max_seq_length is not None and s > max_seq_length:
            raise HoloServeError(f"OpenVINO static shape {item!r} is longer than the longest sequence served "
                                 f"(max_seq_length {max_seq_length}): no batch could use it; use a length <= "
                                 f"{max_seq_length}")
        out.add((b, s))
    return sorted(out, key=lambda bs: (bs[0] * bs[1], bs))


def inference_precision(compiled) -> str:
    """The precision OpenVINO runs the float ops at ("bf16", "f32", ...)."""
    try:
        t = compiled.get_property("INFERENCE_PRECISION_HINT")
    except Exception:  # a plugin without the property
        return "unknown"
    return t.get_type_name() if hasattr(t, "get_type_name") else str(t)


class OpenVinoBackend:
    name = "openvino"
    whole_batches = False  # on a CPU, length groups save the padded tokens' work

    def __init__(self, artifact: Artifact, *, threads: int | None = None, sparse: bool = False,
                 precision: str = "auto", export_key: str = OPENVINO, shapes: str | Sequence = (),
                 kernels: str = DEFAULT_KERNELS, instances: int = 1):
        entry = artifact.export(export_key)
        if entry is None:
            raise BackendUnavailable(
                f"{artifact.path} has no {export_key!r} export: run `holoserve export {artifact.path} --target "
                "openvino` first")
        self.path = artifact.path / entry.file
        threads = threads if threads is not None else int(os.environ.get("HOLOSERVE_ORT_THREADS", "0") or 0)
        self.kernels: dict[str, Any] = {}
        self.instances = max(1, int(instances))  # batches run at once, one per stream
        plan = Streams(threads or 0, self.instances)
        self.compiled, self.sparse_note = compile_model(self.path, threads=plan, sparse=sparse,
                                                        precision=precision, kernels=kernels, report=self.kernels)
        self.requests = RequestPool(self.compiled, self.instances)
        self._count = threading.Lock()  # the run counters below, updated from each instance's thread
        self.input_names = [i.get_any_name() for i in self.compiled.inputs]
        unknown = [n for n in self.input_names if n not in INPUTS]
        if unknown or "input_ids" not in self.input_names:
            raise BackendUnavailable(f"{self.path} has inputs {self.input_names}; expected a subset of {list(INPUTS)}")
        self.output = self.compiled.outputs[0]
        self.threads = threads
        self.max_seq = artifact.max_seq_length
        # (batch, seq, its requests) per static shape, smallest first; what ran where, for info()
        self.static: list[tuple[int, int, RequestPool]] = []
        for b, s in parse_shapes(shapes):
            compiled, _ = compile_model(self.path, threads=plan, sparse=sparse, precision=precision,
                                        shape=(b, s), kernels=kernels)
            pool = RequestPool(compiled, self.instances)
            ones = np.ones((b, s), dtype=np.int64)  # one run now, so that no request pays the first run's setup
            pool.run({n: ones if n != "token_type_ids" else ones * 0 for n in self.input_names}, compiled.outputs[0])
            self.static.append((b, s, pool))
        # how often each static shape ran, and each padded length of the dynamic model: what traffic brought
        self.static_runs = {(b, s): 0 for b, s, _ in self.static}
        self.dynamic_lengths: dict[int, int] = {}
        self.int8_gemm = "saturates: " + INT8_SATURATES if int8_gemm_saturates() else "exact"
        if self.int8_gemm != "exact":
            log.warning("%s", INT8_SATURATES)

    def static_shape_for(self, batch: int, seq: int) -> tuple[int, int, RequestPool] | None:
        """The smallest listed static shape that holds a [batch, seq] batch in at most STATIC_PAD_SHARE more
        tokens than the dynamic model would run it in ([batch, dynamic_seq(seq)]), or None (the dynamic model
        runs it)."""
        budget = batch * self.dynamic_seq(seq) * (1.0 + STATIC_PAD_SHARE)
        return next((x for x in self.static if x[0] >= batch and x[1] >= seq and x[0] * x[1] <= budget), None)

    def dynamic_seq(self, seq: int) -> int:
        """The length a [batch, seq] batch runs at on the dynamic model: seq rounded up to SEQ_MULTIPLE, at most
        the checkpoint's length (a longer input is left as it is)."""
        return max(seq, min(-(-seq // SEQ_MULTIPLE) * SEQ_MULTIPLE, self.max_seq))

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray) -> np.ndarray:
        feed = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        batch, seq = np.shape(input_ids)
        hit = self.static_shape_for(batch, seq) if self.static else None
        if hit is None:
            length = self.dynamic_seq(seq)
            with self._count:
                self.dynamic_lengths[length] = self.dynamic_lengths.get(length, 0) + 1
            return self.requests.run(_padded(feed, self.input_names, batch, length), self.output)
        b, s, pool = hit
        with self._count:
            self.static_runs[(b, s)] += 1
        return pool.run(_padded(feed, self.input_names, b, s), pool.compiled.outputs[0])[:batch]

    @property
    def runs(self) -> dict[str, int]:
        """Batches run on the static shapes and on the dynamic model, in all."""
        return {"static": sum(self.static_runs.values()), "dynamic": sum(self.dynamic_lengths.values())}

    def note_kernels(self, status: str) -> None:
        """Say why the 2:4 kernels are off where the reason lies outside this backend (a serving profile's
        measurement), in place of the setting that turned them off."""
        self.kernels["status"] = status

    def info(self) -> dict[str, Any]:
        import openvino as ov

        return {"backend": self.name, "model": self.path.name, "openvino_version": ov.__version__,
                "device": "CPU", "threads": self.threads or "default", "instances": self.instances,
                "gemm_precisions": gemm_precisions(self.compiled), "gemm_kernels": gemm_kernels(self.compiled),
                "inference_precision": inference_precision(self.compiled),
                "sparse_weights_decompression": self.sparse_note, "kernels": dict(self.kernels),
                "static_shapes": [f"{b}x{s}" for b, s, _ in self.static], "runs": self.runs,
                "static_shape_runs": {f"{b}x{s}": n for (b, s), n in self.static_runs.items()},
                "dynamic_seq_multiple": SEQ_MULTIPLE,
                "dynamic_length_runs": {str(n): c for n, c in sorted(self.dynamic_lengths.items())},
                "int8_gemm": self.int8_gemm}


def _padded(feed: dict[str, np.ndarray], names: Sequence[str], rows: int, seq: int) -> dict[str, np.ndarray]:
    """The inputs `names` of `feed` as int64 [rows, seq]: extra positions id 0, masked out, segment 0; extra rows a
    copy of the first (their outputs are dropped)."""
    batch, length = np.shape(feed["input_ids"])
    out = {}
    for n in names:
        if (batch, length) == (rows, seq):
            out[n] = np.ascontiguousarray(feed[n], dtype=np.int64)
            continue
        x = np.zeros((rows, seq), dtype=np.int64)
        x[:batch, :length] = feed[n]
        x[batch:] = x[0]
        out[n] = x
    return out


def load(artifact: Artifact, **options: Any) -> OpenVinoBackend:
    return OpenVinoBackend(artifact, threads=options.get("threads"),
                           sparse=bool(options.get("openvino_sparse_weights")),
                           precision=options.get("openvino_precision") or "auto",
                           shapes=options.get("openvino_shapes") or (),
                           kernels=options.get("openvino_kernels") or DEFAULT_KERNELS,
                           instances=int(options.get("instances") or 1))
