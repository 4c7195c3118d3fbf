"""Request and response bodies (pydantic), the source of the OpenAPI document."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictStr


class PredictRequest(BaseModel):
    """Exactly one of `text`, `texts` or `pairs`. Pairs only for pair tasks (e.g. MRPC, QNLI)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"text": "a gripping, funny film"},
                                        {"texts": ["loved it", "a dull mess"]}]},
    )
    text: Optional[StrictStr] = Field(None, description="one text")
    texts: Optional[list[StrictStr]] = Field(None, description="several texts, answered in order")
    pairs: Optional[list[tuple[StrictStr, StrictStr]]] = Field(
        None, description="text pairs [[a, b], ...] for sentence-pair tasks")


class Prediction(BaseModel):
    label: str = Field(description="the highest-scoring label ('score' for regression tasks)")
    score: float = Field(description="probability of `label` (the raw value for regression)")
    scores: dict[str, float] = Field(description="probability of every label")
    num_tokens: int = Field(description="tokens fed to the model, special tokens included")
    truncated: bool = Field(description="true when the input was cut to the maximum sequence length")


class Timing(BaseModel):
    tokenize: float
    queue: float
    inference: float
    total: float


class ModelRef(BaseModel):
    name: str
    version: str
    backend: str


class PredictResponse(BaseModel):
    model: ModelRef
    predictions: list[Prediction]
    timing_ms: Timing
    request_id: str


class ErrorBody(BaseModel):
    code: int
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody
    request_id: Optional[str] = None


class Status(BaseModel):
    status: str
    detail: Optional[str] = None


class ModelInfo(BaseModel):
    name: str
    version: str
    backend: dict[str, Any]
    task: dict[str, Any]
    labels: list[str]
    max_seq_length: int
    sparsity: Optional[dict[str, Any]] = None
    precision: str
    metrics: dict[str, Any]
    base_model: Optional[str] = None
    batching: dict[str, Any]
    limits: dict[str, Any]


class ModelList(BaseModel):
    models: list[ModelInfo]
