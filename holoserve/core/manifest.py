"""The checkpoint manifest schema (manifest.json): typed, versioned, unknown fields refused.

Every stage reads the manifest through these models and nothing else; a field that a reader needs
is declared here once. Schema history:

  1  the first format (untyped export entries; task.num_labels optional). Still read: `parse`
     upgrades it in memory, and the next write stores it as the current version.
  2  every section typed, export entries typed by kind, task.num_labels required. Still read (as 3).
  3  this schema: adds `sequence_length`, how max_seq_length was chosen (optional; a v2 manifest has none).

Only JSON is ever read; nothing is unpickled.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any, Literal, Optional

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError,
                      model_validator)

from .. import HoloServeError, __version__
from .numerics import ACT_QMAX, ACT_QMIN, WEIGHT_QMAX

FORMAT = "holoserve-checkpoint"
SCHEMA_VERSION = 3
# Parts of a BERT classifier that stay dense and unquantized; recorded in every manifest.
DENSE_MODULES = ("embeddings", "LayerNorm", "pooler", "classifier")

# exports keys: what each export is recorded under
ONNXRUNTIME = "onnxruntime"
TENSORRT_ONNX = "tensorrt-onnx"
TENSORRT_ENGINE = "tensorrt"
OPENVINO = "openvino"


class ArtifactError(HoloServeError):
    """A checkpoint that cannot be used, with the reason and what to do about it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def _plain_name(name: str) -> str:
    """A file name inside the checkpoint folder itself: no folders, no parent references, not hidden."""
    if not name or name != name.strip() or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        raise ValueError(f"{name!r} is not a plain file name inside the checkpoint folder")
    return name


FileName = Annotated[str, AfterValidator(_plain_name)]


# --------------------------------------------------------------------------- sections


class TaskInfo(_Strict):
    name: str
    labels: list[str]  # empty for regression
    pair: bool
    num_labels: PositiveInt
    regression: bool = False
    metrics: list[str] = Field(default_factory=list)


class Sparsity(_Strict):
    pattern: str
    n: PositiveInt
    m: PositiveInt
    axis: Literal["input"] = "input"
    layers: list[str]

    @model_validator(mode="after")
    def _n_below_m(self) -> "Sparsity":
        if not self.n < self.m:
            raise ValueError(f"sparsity n/m invalid ({self.n}/{self.m})")
        return self


class WeightQuant(_Strict):
    dtype: Literal["int8"] = "int8"
    scheme: Literal["symmetric"] = "symmetric"
    granularity: Literal["per_output_channel"] = "per_output_channel"
    qmax: Literal[WEIGHT_QMAX] = WEIGHT_QMAX
    scales: dict[str, list[float]]


class EmbeddingQuant(_Strict):
    dtype: Literal["int8"] = "int8"
    scheme: Literal["symmetric"] = "symmetric"
    granularity: Literal["per_row"] = "per_row"
    qmax: Literal[WEIGHT_QMAX] = WEIGHT_QMAX
    scales: list[float]


class ActivationQuant(_Strict):
    dtype: Literal["int8"] = "int8"
    scheme: Literal["symmetric"] = "symmetric"
    granularity: Literal["per_tensor"] = "per_tensor"
    qmin: Literal[ACT_QMIN] = ACT_QMIN
    qmax: Literal[ACT_QMAX] = ACT_QMAX
    scale: Literal["amax / 127"] = "amax / 127"
    amax: dict[str, PositiveFloat]  # keyed by tensor: "<linear>.input", "<linear>.output", "<block>.residual"


class Quantization(_Strict):
    weights: WeightQuant
    embeddings: Optional[dict[str, EmbeddingQuant]] = None
    activations: Optional[ActivationQuant] = None


class Metrics(_Strict):
    """Dev-set metrics recorded at compression time: {metric name: value} per model."""

    primary: Optional[str] = None
    split: Optional[str] = None
    dev_rows: Optional[int] = None
    dense: Optional[dict[str, float]] = None
    compressed: Optional[dict[str, float]] = None
    source_fp32: Optional[dict[str, float]] = None  # ptq: the model it started from
    sparse_fp32: Optional[dict[str, float]] = None  # magnitude: after the masked fine-tune, before INT8
    after_projection: Optional[dict[str, float]] = None  # admm: right after the hard projection
    one_shot: Optional[dict[str, float]] = None  # magnitude: right after one-shot pruning
    compressed_tensorrt: Optional[dict[str, float]] = None  # TensorRT QAT: with the TensorRT placement's quantizers


class SequenceLength(_Strict):
    """How `max_seq_length` was chosen: from the training rows' token counts (`data`: the length that covers
    `coverage` of them, rounded up to a multiple of `multiple`, at most `preset_cap` and the model's positions)
    or given by the user (`option`, --max-seq-length)."""

    source: Literal["data", "option"]
    train_rows: int = Field(ge=0)  # tokenized training rows (before any augmentation)
    train_rows_truncated: int = Field(ge=0)  # of those, rows longer than max_seq_length (cut to it)
    longest_row: int = Field(ge=0)  # tokens, special tokens included
    coverage: Optional[float] = Field(None, gt=0, le=1)  # data: the share of rows the length must hold
    tokens_at_coverage: Optional[int] = Field(None, ge=0)  # data: the shortest length that holds `coverage`
    multiple: Optional[PositiveInt] = None  # data: rounded up to a multiple of this
    preset_cap: Optional[PositiveInt] = None  # data: the preset's max_seq_length, the most it may be
    model_positions: Optional[PositiveInt] = None  # the tokens the model's position table holds


class FileEntry(_Strict):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


class OnnxExport(_Strict):
    """An ONNX file (exports['onnxruntime'] / exports['tensorrt-onnx']). `holoserve export` fills in every
    field; only `file` is needed to serve one (a plain fp32 export registered by hand, for instance)."""

    file: FileName
    format: Literal["onnx"] = "onnx"
    opset: Optional[int] = None
    placement: Optional[Literal["onnxruntime", "tensorrt"]] = None
    inputs: Optional[dict[str, dict[str, Any]]] = None
    outputs: Optional[dict[str, dict[str, Any]]] = None
    weights: Optional[str] = None
    activations: Optional[str] = None
    quantized_linears: Optional[int] = None
    activation_qdq_pairs: Optional[int] = None
    weight_dequantize: Optional[int] = None
    bytes: Optional[int] = None
    size_ratio_vs_fp32: Optional[float] = None
    ops: Optional[dict[str, int]] = None
    word_embeddings: Optional[str | dict[str, Any]] = None  # the int8 table's description, or a float32 note
    attention: Optional[str | dict[str, Any]] = None  # what the attention rewrite did
    fused_ops: Optional[dict[str, Any]] = None  # onnxruntime placement: what each graph rewrite matched
    extra_ranges: Optional[dict[str, Any]] = None  # tensorrt placement: ranges calibrated at export
    residual_adds: Optional[dict[str, Any]] = None  # tensorrt placement: which residual-Add inputs are INT8, and why
    verification: Optional[dict[str, Any]] = None


class EngineExport(_Strict):
    """A TensorRT plan written by `holoserve build-engine` (exports['tensorrt']) and its sidecar JSON."""

    file: FileName
    sidecar: str = ""
    onnx: Optional[FileName] = None
    tensorrt: Optional[dict[str, Any]] = None
    target: Optional[dict[str, Any]] = None
    profiles: Optional[list[Any]] = None
    precision: Optional[Any] = None
    builder_flags: Optional[list[str]] = None

    @model_validator(mode="after")
    def _default_sidecar(self) -> "EngineExport":
        if not self.sidecar:
            self.sidecar = self.file + ".json"
        _plain_name(self.sidecar)
        return self


class Exports(_Strict):
    onnxruntime: Optional[OnnxExport] = Field(None, alias=ONNXRUNTIME)
    tensorrt_onnx: Optional[OnnxExport] = Field(None, alias=TENSORRT_ONNX)
    tensorrt: Optional[EngineExport] = Field(None, alias=TENSORRT_ENGINE)
    openvino: Optional[OnnxExport] = Field(None, alias=OPENVINO)

    def get(self, key: str) -> OnnxExport | EngineExport | None:
        """The entry recorded under a manifest key ('onnxruntime', 'tensorrt-onnx', 'tensorrt')."""
        for name, field in type(self).model_fields.items():
            if field.alias == key:
                return getattr(self, name)
        raise KeyError(f"unknown export kind {key!r}; known: {', '.join(self.keys())}")

    @staticmethod
    def keys() -> list[str]:
        return [f.alias for f in Exports.model_fields.values()]

    def recorded(self) -> list[str]:
        return [k for k in self.keys() if self.get(k) is not None]


# --------------------------------------------------------------------------- the manifest


class Manifest(_Strict):
    format: Literal["holoserve-checkpoint"] = FORMAT
    schema_version: Literal[3] = SCHEMA_VERSION
    holoserve_version: str = __version__
    created: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    base_model: str
    task: TaskInfo
    max_seq_length: PositiveInt
    sequence_length: Optional[SequenceLength] = None  # how max_seq_length was chosen (compress writes it)
    sparsity: Optional[Sparsity] = None
    quantization: Optional[Quantization] = None
    dense_modules: list[str] = Field(default_factory=lambda: list(DENSE_MODULES))
    metrics: Metrics = Field(default_factory=Metrics)
    training: dict[str, Any] = Field(default_factory=dict)  # the recipe as run: method, preset, phases, machine
    exports: Exports = Field(default_factory=Exports)
    files: dict[FileName, FileEntry] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _exports_are_listed(self) -> "Manifest":
        """What a server may load must be a file the manifest lists with its hash. (A manifest being built
        has no files yet: the writer fills them in and validates again.)"""
        if self.files:
            for key in self.exports.recorded():
                entry = self.exports.get(key)
                for name in (entry.file, getattr(entry, "sidecar", None)):
                    if name and name not in self.files:
                        raise ValueError(f"exports.{key} names {name!r}, which manifest.json does not list in "
                                         "files (with its sha256); re-run the export")
        return self

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to manifest.json (export keys spelled as on disk)."""
        data = self.model_dump(mode="json", by_alias=True)
        data["exports"] = {k: v for k, v in data["exports"].items() if v is not None}
        for entry in data["exports"].values():
            for key in [k for k, v in entry.items() if v is None]:
                del entry[key]
        return data


def _upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 1 -> 2: the fields v2 requires that a v1 writer could leave out."""
    data = dict(data, schema_version=2)
    task = data.get("task")
    if isinstance(task, dict) and "num_labels" not in task:
        labels = task.get("labels") or []
        data["task"] = dict(task, num_labels=len(labels) or 1)
    if data.get("exports") is None:
        data["exports"] = {}
    return data


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def parse(data: Any, where: str = "manifest.json") -> Manifest:
    """Validate a manifest's JSON object (either schema version) into a `Manifest`.

    Raises ArtifactError naming each bad field and what to do.
    """
    if not isinstance(data, dict):
        raise ArtifactError(f"{where}: manifest.json is not a JSON object")
    if data.get("format") != FORMAT:
        raise ArtifactError(f"{where}: manifest.json is not a {FORMAT} manifest (format={data.get('format')!r})")
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ArtifactError(f"{where}: manifest.json has no integer schema_version; re-create the checkpoint")
    if version > SCHEMA_VERSION:
        raise ArtifactError(
            f"{where}: manifest schema_version {version} is newer than this HoloServe understands "
            f"({SCHEMA_VERSION}); upgrade holoserve"
        )
    if version < 1:
        raise ArtifactError(f"{where}: unknown manifest schema_version {version}")
    if version == 1:
        data = _upgrade_v1(data)
    if data.get("schema_version") == 2:  # 2 -> 3 adds only an optional section
        data = dict(data, schema_version=SCHEMA_VERSION)
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{_where(err['loc'])}: {err['msg']}" for err in e.errors()[:5])
        more = f" (and {e.error_count() - 5} more)" if e.error_count() > 5 else ""
        raise ArtifactError(
            f"{where}: manifest.json does not follow schema {SCHEMA_VERSION}: {problems}{more}. "
            "Re-create the checkpoint with `holoserve compress`, or fix the named fields"
        ) from None
