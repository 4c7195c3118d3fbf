"""A Triton Inference Server model repository for an exported checkpoint.

`holoserve export CKPT --triton-repo DIR` (or `write_triton_repo`) writes, next to whatever other models
DIR already holds:

    DIR/<name>/                  Python backend, text in: TEXT (and TEXT_PAIR) -> LOGITS, LABEL
        config.pbtxt             dynamic batcher, KIND_CPU instances
        labels.txt               label names, for Triton's classification extension (not for regression)
        1/model.py               HoloServe's tokenizer + ONNX Runtime backend (needs `pip install holoserve`
                                 in the Python that Triton's Python backend runs)
        1/checkpoint/            manifest.json, config.json, tokenizer.json and the ONNX Runtime export
    DIR/<name>_onnx/             platform onnxruntime_onnx on token ids (Triton's onnxruntime backend, CPU)
    DIR/<name>_trt_onnx/         the TensorRT-placement ONNX on Triton's onnxruntime backend with the TensorRT
                                 execution accelerator (INT8, 2:4 sparsity), KIND_GPU; when that export exists
    DIR/<name>_trt/              platform tensorrt_plan, KIND_GPU; when the checkpoint holds a datacenter
                                 TensorRT engine (a TensorRT-RTX plan is not loadable by Triton's TensorRT
                                 backend, so none is written for one)

The token-id models take input_ids / attention_mask / token_type_ids (INT64, [-1] per row) and return
logits (FP32, [num_labels] per row): the client tokenizes (the checkpoint's tokenizer.json, truncated to
its max_seq_length). Triton's dynamic batcher only combines requests of the same shape, so clients of
these models pad to a fixed length.

A model folder of the same name is replaced; each is assembled outside DIR (a temporary sibling of DIR,
so a Triton polling DIR never sees a partial model) and renamed into place whole. A model of an earlier
export of the same name that this export no longer writes is removed (only folders this module wrote,
recognised by the first line of their config.pbtxt).

Running such a repository on one machine, with the tritonserver of the `nvidia-pytriton` wheel:
export/triton_local.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from holoserve import HoloServeError
from holoserve.core.artifact import MANIFEST, Artifact, load_artifact
from holoserve.core.files import (atomic_copy, atomic_write_json, atomic_write_text, file_entry, replace_dir,
                                  sweep_stale, temp_sibling)
from holoserve.core.manifest import ONNXRUNTIME, TENSORRT_ENGINE, TENSORRT_ONNX, parse
from holoserve.core.sidecar import read_sidecar, sidecar_path

HEADER = "# Written by `holoserve export --triton-repo`"
VERSION = "1"  # the model version folder
BUNDLE = "checkpoint"  # the Python model's checkpoint files, inside the version folder
ID_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
SUFFIXES = {"onnx": "_onnx", "trt_onnx": "_trt_onnx", "trt": "_trt"}
DEFAULT_MAX_BATCH = 32
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,100}$")
_TRITON_DTYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32", "float16": "TYPE_FP16"}


class TritonRepoError(HoloServeError):
    """The model repository cannot be written as asked; the message says why and what to do."""


@dataclass
class TritonRepo:
    path: Path
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> what was written
    skipped: dict[str, str] = field(default_factory=dict)  # variant -> why it was not written
    removed: list[str] = field(default_factory=list)  # stale models of an earlier export

    def report(self) -> dict[str, Any]:
        return {"path": str(self.path), "models": self.models, "skipped": self.skipped, "removed": self.removed}


# --------------------------------------------------------------------------- config.pbtxt


def _q(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _tensor(name: str, dtype: str, dims: list[int], label_file: str | None = None) -> str:
    extra = f"\n    label_filename: {_q(label_file)}" if label_file else ""
    return (f"  {{\n    name: {_q(name)}\n    data_type: {dtype}\n    dims: [ {', '.join(str(d) for d in dims)} ]"
            f"{extra}\n  }}")


def _params(params: Mapping[str, str]) -> str:
    return "".join(f"parameters: {{\n  key: {_q(k)}\n  value: {{ string_value: {_q(v)} }}\n}}\n"
                   for k, v in params.items())


@dataclass(frozen=True)
class Batching:
    """How Triton batches and replicates a model: max_batch_size, the dynamic batcher's queue delay, and
    the instance_group count."""

    max_batch_size: int = DEFAULT_MAX_BATCH
    max_queue_delay_us: int = 0
    instances: int = 1


@dataclass(frozen=True)
class ModelConfig:
    """A config.pbtxt in Triton's model-configuration schema (protobuf text format): a `backend` or a
    `platform`, the batching, the input and output tensors (`_tensor`), the instance kind."""

    name: str
    comment: list[str]
    batching: Batching
    inputs: list[str]
    outputs: list[str]
    kind: str
    backend: str | None = None
    platform: str | None = None
    parameters: Mapping[str, str] | None = None
    tail: str = ""

    def text(self) -> str:
        head = "\n".join([HEADER, *(f"# {c}" for c in self.comment)])
        which = f"backend: {_q(self.backend)}" if self.backend else f"platform: {_q(self.platform)}"
        sep = ",\n"
        b = self.batching
        text = (f"{head}\nname: {_q(self.name)}\n{which}\nmax_batch_size: {b.max_batch_size}\n"
                f"dynamic_batching {{\n  max_queue_delay_microseconds: {b.max_queue_delay_us}\n}}\n"
                f"input [\n{sep.join(self.inputs)}\n]\noutput [\n{sep.join(self.outputs)}\n]\n"
                f"instance_group [\n  {{\n    count: {b.instances}\n    kind: {self.kind}\n  }}\n]\n")
        return text + _params(self.parameters or {}) + self.tail


# --------------------------------------------------------------------------- the Python model

# The model.py of the Python-backend model: it runs inside Triton's Python backend stub, whose Python
# must have holoserve's base install (no torch). Settings come from config.pbtxt `parameters`.
MODEL_PY = '''\
"""Triton Python-backend model written by `holoserve export --triton-repo`.

Texts in (TEXT, and TEXT_PAIR for a pair task: BYTES, one UTF-8 string per batch row), LOGITS (FP32,
[num_labels]) and LABEL (BYTES) out. It tokenizes with the checkpoint's tokenizer.json and runs the
checkpoint's ONNX Runtime export through HoloServe's own backend, as `holoserve serve` does. Settings are
the `parameters` of config.pbtxt: threads (ONNX Runtime intra-op threads; 0 = what a container's CPU
quota or cpuset leaves each CPU instance, where one limits the process, else the library default),
max_seq_length (0 = the manifest's), max_text_bytes, max_padding_waste. A request with a text that is not
UTF-8, blank, or longer than max_text_bytes gets an error of its own; the rest of its batch is answered.
"""
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from holoserve.backends.onnxruntime import OrtBackend
from holoserve.core.artifact import Artifact, check_config, read_manifest, verify_files
from holoserve.core.machine import cpu_budget
from holoserve.core.tokenizer import TextEncoder, pad_batch

BUNDLE = Path(__file__).resolve().parent / "checkpoint"


class InputError(ValueError):
    pass


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: (v or {}).get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        manifest = read_manifest(BUNDLE)
        entry = manifest.exports.get("onnxruntime")
        if entry is None:
            raise RuntimeError(f"{BUNDLE}: the manifest records no onnxruntime export; re-run holoserve export")
        # The files this model reads, checked against the manifest's sizes and sha256.
        verify_files(BUNDLE, manifest, ["config.json", "tokenizer.json", entry.file])
        check_config(BUNDLE, manifest)
        self.artifact = Artifact(BUNDLE, manifest)
        contract = manifest.max_seq_length
        max_seq = int(params.get("max_seq_length") or 0) or contract
        if max_seq > contract:
            raise RuntimeError(f"parameter max_seq_length {max_seq} exceeds the {contract} tokens the model was "
                               "calibrated and exported for (manifest.json max_seq_length)")
        self.pair = manifest.task.pair
        self.labels = list(manifest.task.labels)
        self.regression = not self.labels
        self.max_text_bytes = int(params.get("max_text_bytes") or 0)
        self.max_padding_waste = float(params.get("max_padding_waste") or 0.25)
        self.encoder = TextEncoder(BUNDLE / "tokenizer.json", max_seq, pair=self.pair)
        device = "cuda" if args.get("model_instance_kind") == "GPU" else "cpu"
        threads = int(params.get("threads") or 0)
        if threads == 0 and device == "cpu":  # the runtime's own pool would follow the machine's cores
            instances = sum(int(g.get("count") or 1) for g in config.get("instance_group") or []
                            if g.get("kind", "KIND_CPU") == "KIND_CPU")
            threads = cpu_budget(max(1, instances)).threads or 0
        self.backend = OrtBackend(self.artifact, device=device, threads=threads)
        self.num_labels = manifest.task.num_labels

    def _column(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise InputError(f"input {name} is missing")
        out = []
        for raw in np.asarray(tensor.as_numpy(), dtype=object).reshape(-1):
            if isinstance(raw, str):
                raw = raw.encode("utf-8")
            if not isinstance(raw, (bytes, bytearray)):
                raise InputError(f"{name} must hold BYTES (UTF-8 text)")
            if self.max_text_bytes and len(raw) > self.max_text_bytes:
                raise InputError(f"a {name} item has {len(raw)} bytes, more than the {self.max_text_bytes} allowed")
            try:
                text = bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{name} items must be UTF-8 text") from None
            if not text.strip():
                raise InputError(f"a {name} item is empty or blank")  # as `holoserve serve` refuses it
            out.append(text)
        return out

    def _items(self, request):
        texts = self._column(request, "TEXT")
        if not self.pair:
            return texts
        seconds = self._column(request, "TEXT_PAIR")
        if len(seconds) != len(texts):
            raise InputError(f"TEXT has {len(texts)} rows but TEXT_PAIR has {len(seconds)}")
        return list(zip(texts, seconds))

    def _groups(self, encs):
        """Row indices in runs of similar length: one padded run per group, padding below max_padding_waste."""
        order = sorted(range(len(encs)), key=lambda i: encs[i].length)
        groups, current, tokens = [], [], 0
        for i in order:
            n = encs[i].length
            if current and (len(current) + 1) * n > 0 and \\
                    1 - (tokens + n) / ((len(current) + 1) * n) > self.max_padding_waste:
                groups.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += n
        if current:
            groups.append(current)
        return groups

    def _infer(self, encs):
        logits = np.zeros((len(encs), self.num_labels), dtype=np.float32)
        for idx in self._groups(encs):
            ids, mask, types = pad_batch([encs[i] for i in idx], self.encoder.pad_id)
            logits[idx] = self.backend.infer(ids, mask, types)
        return logits

    def _response(self, logits):
        if self.regression:
            names = [b"score"] * len(logits)
        else:
            names = [self.labels[k].encode("utf-8") for k in logits.argmax(axis=1)]
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("LOGITS", np.ascontiguousarray(logits, dtype=np.float32)),
            pb_utils.Tensor("LABEL", np.array(names, dtype=object).reshape(-1, 1)),
        ])

    def execute(self, requests):
        responses = [None] * len(requests)
        items, spans = [], []
        for r, request in enumerate(requests):
            try:
                these = self._items(request)
            except InputError as e:
                responses[r] = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e)))
                continue
            spans.append((r, len(items), len(these)))
            items.extend(these)
        if not items:
            return responses
        encs = self.encoder.encode(items)
        try:
            logits = self._infer(encs)
        except Exception:
            # One bad request must not fail the batch it was grouped into: run each request on its own.
            for r, start, n in spans:
                try:
                    responses[r] = self._response(self._infer(encs[start:start + n]))
                except Exception as e:
                    responses[r] = pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError(f"inference failed: {e}"))
            return responses
        for r, start, n in spans:
            responses[r] = self._response(logits[start:start + n])
        return responses

    def finalize(self):
        self.backend = None
'''


# --------------------------------------------------------------------------- the repository


def default_model_name(checkpoint: str | os.PathLike) -> str:
    """The checkpoint folder's name, with anything Triton's model names and paths dislike replaced by '_'."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(checkpoint).resolve().name).lstrip("._-")
    return name[:80] or "model"


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise TritonRepoError(f"Triton model name {name!r}: use letters, digits, '_', '.' and '-' (at most 101 "
                              "characters, starting with a letter or digit)")
    return name


def _export_sources(art: Artifact, exports: Mapping[str, Mapping[str, Any]] | None,
                    exports_dir: str | os.PathLike | None) -> dict[str, tuple[Path, dict[str, Any]]]:
    """manifest key -> (file, entry): the checkpoint's recorded exports, overridden by `exports` (entries of an
    export written to `exports_dir` instead of the checkpoint, as `holoserve export --out` does)."""
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    recorded = art.manifest.to_json()["exports"]
    for key, entry in recorded.items():
        found[key] = (art.path / entry["file"], dict(entry))
    if exports:
        base = Path(exports_dir) if exports_dir is not None else art.path
        for key, entry in exports.items():
            found[key] = (base / entry["file"], dict(entry))
    for key, (path, _) in found.items():
        if not path.is_file():
            raise TritonRepoError(f"the {key} export {path} is missing; re-run `holoserve export {art.path}`")
    return found


def _io_names(entry: Mapping[str, Any], default: tuple[str, ...] = ID_INPUTS) -> list[str]:
    names = list((entry.get("inputs") or {}).keys())
    return names or list(default)


def _output(entry: Mapping[str, Any]) -> str:
    names = list((entry.get("outputs") or {}).keys())
    return names[0] if names else "logits"


def _bundle_manifest(art: Artifact, onnx: tuple[Path, dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint's manifest, its onnxruntime export being the one copied into the bundle."""
    data = art.manifest.to_json()
    path, entry = onnx
    data["exports"][ONNXRUNTIME] = dict(entry)
    data["files"][entry["file"]] = file_entry(path)
    parse(data, where=str(art.path))
    return data


def _write_python_model(folder: Path, art: Artifact, name: str, onnx: tuple[Path, dict[str, Any]],
                        batching: Batching) -> dict[str, Any]:
    version = folder / VERSION
    bundle = version / BUNDLE
    manifest = _bundle_manifest(art, onnx)
    for f in ("config.json", "tokenizer.json"):
        atomic_copy(art.path / f, bundle / f)
    atomic_copy(onnx[0], bundle / onnx[1]["file"])
    if manifest == art.manifest.to_json():
        atomic_copy(art.path / MANIFEST, bundle / MANIFEST)  # byte for byte: the same model version hash
    else:
        atomic_write_json(bundle / MANIFEST, manifest)
    atomic_write_text(version / "model.py", MODEL_PY)
    n = art.num_labels
    labels = _labels_file(folder, art)
    inputs = [_tensor("TEXT", "TYPE_STRING", [1])] + ([_tensor("TEXT_PAIR", "TYPE_STRING", [1])] if art.is_pair else [])
    outputs = [_tensor("LOGITS", "TYPE_FP32", [n], labels), _tensor("LABEL", "TYPE_STRING", [1])]
    comment = [f"HoloServe model {art.path.name} (task {art.task_name}, labels {art.labels or ['score']}), text in:",
               "tokenized by the checkpoint's tokenizer.json and run by HoloServe's ONNX Runtime backend",
               "(Triton's Python backend; its Python needs `pip install holoserve`)."]
    atomic_write_text(folder / "config.pbtxt", ModelConfig(
        name=name, comment=comment, backend="python", batching=batching, inputs=inputs, outputs=outputs,
        kind="KIND_CPU",
        parameters={"threads": "0", "max_seq_length": "0", "max_text_bytes": "10000", "max_padding_waste": "0.25"},
    ).text())
    return {"backend": "python", "kind": "KIND_CPU", "inputs": ["TEXT", "TEXT_PAIR"] if art.is_pair else ["TEXT"],
            "outputs": ["LOGITS", "LABEL"], "onnx": onnx[1]["file"]}


def _id_tensors(entry: Mapping[str, Any], n: int, labels: str | None, dtypes: Mapping[str, str] | None = None):
    dtypes = dtypes or {}
    inputs = [_tensor(i, _TRITON_DTYPES.get(dtypes.get(i, "int64"), "TYPE_INT64"), [-1]) for i in _io_names(entry)]
    outputs = [_tensor(_output(entry), "TYPE_FP32", [n], labels)]
    return inputs, outputs


def _id_comment(art: Artifact, what: str) -> list[str]:
    return [f"HoloServe model {art.path.name} (task {art.task_name}, labels {art.labels or ['score']}), {what}.",
            f"Token ids in: tokenize with the checkpoint's tokenizer.json, truncated to {art.max_seq_length} tokens,",
            "padded to one fixed length so that the dynamic batcher can combine requests."]


def _labels_file(folder: Path, art: Artifact) -> str | None:
    if not art.labels:
        return None
    atomic_write_text(folder / "labels.txt", "".join(f"{lab}\n" for lab in art.labels))
    return "labels.txt"


def _write_onnx_model(folder: Path, art: Artifact, name: str, onnx: tuple[Path, dict[str, Any]],
                      batching: Batching) -> dict[str, Any]:
    atomic_copy(onnx[0], folder / VERSION / "model.onnx")
    inputs, outputs = _id_tensors(onnx[1], art.num_labels, _labels_file(folder, art))
    atomic_write_text(folder / "config.pbtxt", ModelConfig(
        name=name, comment=_id_comment(art, "the ONNX Runtime export on Triton's onnxruntime backend (CPU)"),
        platform="onnxruntime_onnx", batching=batching, inputs=inputs, outputs=outputs, kind="KIND_CPU",
        parameters={"intra_op_thread_count": "0", "execution_mode": "0", "inter_op_thread_count": "1"},
    ).text())
    return {"platform": "onnxruntime_onnx", "kind": "KIND_CPU", "inputs": _io_names(onnx[1]),
            "outputs": [_output(onnx[1])], "onnx": onnx[1]["file"]}


def _profile(names: list[str], batch: int, seq: int) -> str:
    return ",".join(f"{n}:{batch}x{seq}" for n in names)


def _write_trt_onnx_model(folder: Path, art: Artifact, name: str, onnx: tuple[Path, dict[str, Any]],
                          batching: Batching) -> dict[str, Any]:
    max_batch_size = batching.max_batch_size
    atomic_copy(onnx[0], folder / VERSION / "model.onnx")
    inputs, outputs = _id_tensors(onnx[1], art.num_labels, _labels_file(folder, art))
    names = _io_names(onnx[1])
    seq = art.max_seq_length
    trt = {
        "precision_mode": "INT8",  # the graph carries its own Q/DQ scales: no calibration table
        "trt_sparsity_enable": "1",  # the encoder weights are 2:4 sparse
        "max_workspace_size_bytes": str(2 << 30),
        "trt_engine_cache_enable": "1",
        "trt_timing_cache_enable": "1",
        "trt_profile_min_shapes": _profile(names, 1, 1),
        "trt_profile_opt_shapes": _profile(names, min(8, max_batch_size), min(128, seq)),
        "trt_profile_max_shapes": _profile(names, max_batch_size, seq),
    }
    params = "".join(f"      parameters {{ key: {_q(k)} value: {_q(v)} }}\n" for k, v in trt.items())
    tail = ("optimization {\n  execution_accelerators {\n    gpu_execution_accelerator: [\n      {\n"
            f"      name: \"tensorrt\"\n{params}      }}\n    ]\n  }}\n}}\n")
    atomic_write_text(folder / "config.pbtxt", ModelConfig(
        name=name, comment=_id_comment(art, "the TensorRT-placement ONNX on Triton's onnxruntime backend with the "
                                            "TensorRT accelerator (the engine is built by the serving GPU at load)"),
        platform="onnxruntime_onnx", batching=batching, inputs=inputs, outputs=outputs, kind="KIND_GPU", tail=tail,
    ).text())
    return {"platform": "onnxruntime_onnx", "kind": "KIND_GPU", "accelerator": "tensorrt", "inputs": names,
            "outputs": [_output(onnx[1])], "onnx": onnx[1]["file"]}


def _engine_plan(found: Mapping[str, tuple[Path, dict[str, Any]]]) -> tuple[Path, dict, str | None]:
    """(plan, sidecar, why not usable by Triton's TensorRT backend or None)."""
    plan, entry = found[TENSORRT_ENGINE]
    side_path = plan.parent / (entry.get("sidecar") or plan.name + ".json")
    try:
        side = read_sidecar(plan) if side_path == sidecar_path(plan) else \
            json.loads(side_path.read_text(encoding="utf-8"))
    except (HoloServeError, OSError, ValueError) as e:
        return plan, {}, f"its sidecar cannot be read ({e})"
    flavour = (side.get("tensorrt") or {}).get("flavour")
    if flavour != "tensorrt":
        return plan, side, (f"the engine was built with {flavour}, which Triton's TensorRT backend cannot load; "
                            f"the {SUFFIXES['trt_onnx']} model builds a TensorRT engine on the serving GPU instead")
    return plan, side, None


def _write_trt_model(folder: Path, art: Artifact, name: str, plan: Path, side: Mapping[str, Any],
                     batching: Batching) -> dict[str, Any]:
    max_batch_size = batching.max_batch_size
    profile = (side.get("profiles") or [{}])[0]
    side_inputs = side.get("inputs") or []
    names = [i["name"] for i in side_inputs if isinstance(i, dict) and "name" in i] or list(profile) or list(ID_INPUTS)
    dtypes = {i["name"]: str(i.get("dtype", "int64")).lower().replace("datatype.", "")
              for i in side_inputs if isinstance(i, dict) and "name" in i}
    top = [p.get("max", [max_batch_size])[0] for p in profile.values() if isinstance(p, dict) and p.get("max")]
    batch = min([max_batch_size, *top])
    outs = [o.get("name") for o in side.get("outputs") or [] if isinstance(o, dict) and o.get("name")]
    entry = {"inputs": {n: {} for n in names}, "outputs": {(outs or ["logits"])[0]: {}}}
    inputs, outputs = _id_tensors(entry, art.num_labels, _labels_file(folder, art), dtypes)
    atomic_copy(plan, folder / VERSION / "model.plan")
    trt = side.get("tensorrt") or {}
    target = side.get("target") or {}
    built = f"TensorRT {trt.get('version')} for {target.get('gpu') or target.get('compute_capability') or 'its GPU'}"
    atomic_write_text(folder / "config.pbtxt", ModelConfig(
        name=name, comment=_id_comment(art, f"the TensorRT plan ({built}): it loads only in a Triton release "
                                            "with that TensorRT version, on that GPU architecture"),
        platform="tensorrt_plan", batching=replace(batching, max_batch_size=batch), inputs=inputs,
        outputs=outputs, kind="KIND_GPU",
    ).text())
    return {"platform": "tensorrt_plan", "kind": "KIND_GPU", "tensorrt": trt.get("version"),
            "max_batch_size": batch, "inputs": names}


def _ours(folder: Path) -> bool:
    cfg = folder / "config.pbtxt"
    try:
        with open(cfg, encoding="utf-8") as f:
            return f.readline().startswith(HEADER)
    except (OSError, UnicodeDecodeError):
        return False


def write_triton_repo(
    checkpoint: str | os.PathLike | Artifact,
    repo: str | os.PathLike,
    *,
    model_name: str | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH,
    max_queue_delay_us: int = 0,
    instances: int = 1,
    exports: Mapping[str, Mapping[str, Any]] | None = None,
    exports_dir: str | os.PathLike | None = None,
) -> TritonRepo:
    """Write (or replace) this checkpoint's models in the Triton model repository `repo`.

    exports / exports_dir: export entries (manifest key -> entry) whose files are in exports_dir rather
    than recorded in the checkpoint (`holoserve export --out`); they take precedence over the manifest's.
    Other models in `repo` are left alone.
    """
    if max_batch_size < 1:
        raise TritonRepoError(f"max batch size must be at least 1, got {max_batch_size}")
    if max_queue_delay_us < 0 or instances < 1:
        raise TritonRepoError("the queue delay must be >= 0 microseconds and the instance count >= 1")
    art = checkpoint if isinstance(checkpoint, Artifact) else load_artifact(checkpoint, check_weights=False)
    name = _check_name(model_name or default_model_name(art.path))
    found = _export_sources(art, exports, exports_dir)
    if ONNXRUNTIME not in found:
        raise TritonRepoError(
            f"{art.path} has no onnxruntime export, which the Triton models run: export it with "
            f"`holoserve export {art.path} --target onnxruntime` (or all) and --triton-repo")
    repo = Path(repo)
    if repo.exists() and not repo.is_dir():
        raise TritonRepoError(f"{repo} exists and is not a folder; a Triton model repository is a folder")
    out = TritonRepo(repo)
    batching = Batching(max_batch_size, max_queue_delay_us, instances)

    sweep_stale(repo)
    tmp = temp_sibling(repo, "tmp")  # beside the repository, never inside it
    try:
        models: dict[str, Path] = {}

        def folder(model: str) -> Path:
            models[model] = tmp / model
            return models[model]

        out.models[name] = _write_python_model(folder(name), art, name, found[ONNXRUNTIME], batching)
        n_onnx = name + SUFFIXES["onnx"]
        out.models[n_onnx] = _write_onnx_model(folder(n_onnx), art, n_onnx, found[ONNXRUNTIME], batching)
        n_trt_onnx = name + SUFFIXES["trt_onnx"]
        if TENSORRT_ONNX in found:
            out.models[n_trt_onnx] = _write_trt_onnx_model(folder(n_trt_onnx), art, n_trt_onnx,
                                                           found[TENSORRT_ONNX], batching)
        else:
            out.skipped[n_trt_onnx] = "no tensorrt-onnx export (holoserve export --target tensorrt or all)"
        n_trt = name + SUFFIXES["trt"]
        if TENSORRT_ENGINE in found:
            plan, side, why = _engine_plan(found)
            if why:
                out.skipped[n_trt] = why
            else:
                out.models[n_trt] = _write_trt_model(folder(n_trt), art, n_trt, plan, side, batching)
        else:
            out.skipped[n_trt] = "no TensorRT engine in the checkpoint (holoserve build-engine)"

        repo.mkdir(parents=True, exist_ok=True)
        for model, src in models.items():
            replace_dir(src, repo / model)
        for model in out.skipped:
            stale = repo / model
            if stale.is_dir() and not stale.is_symlink() and _ours(stale):
                shutil.rmtree(stale)
                out.removed.append(model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
