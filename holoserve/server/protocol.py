"""The HTTP protocol: request and response bodies (pydantic, the source of the OpenAPI document),
the rules a request must meet before it reaches the model, and the one error shape every 4xx/5xx
answer has: {"error": {"code", "type", "message"}, "request_id"}.

Rules that need nothing but the body (field types, unknown fields, exactly one input field) are
pydantic validation. Rules that depend on the running server (the byte and item limits, whether
the model takes pairs) are `PredictRequest.inputs(limits)`, called by the service: FastAPI parses
the body without a validation context, and these checks must keep their order (a pair sent to a
single-text model is a 400 before its texts are looked at).

The request's JSON schema says the same as the rules, so a body valid against the OpenAPI document
is served: `oneOf` three closed shapes (text, texts, pairs) with non-blank strings and non-empty lists;
each server narrows it to its model's input kind and its own limits (`restrict_request_schema`).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator
from pydantic_core import PydanticCustomError

INPUT_FIELDS = ("text", "texts", "pairs")
# Error types raised by this module's own validators: their message is written for the client and
# is passed on as it is (pydantic's own messages get the field's location in front).
ONE_INPUT = "one_input"
_OWN_ERRORS = frozenset({ONE_INPUT})

Inputs = Union[list[str], list[tuple[str, str]]]


class ApiError(Exception):
    """An answer other than 200, in the shape of `ErrorResponse`."""

    def __init__(self, code: int, type_: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code, self.type, self.message, self.headers = code, type_, message, headers or {}


@dataclass(frozen=True)
class InputLimits:
    """What one request may hold: the server's limits and the kind of input the model classifies."""

    max_items: int
    max_text_bytes: int
    pair: bool  # the model classifies text pairs
    model: str  # named in the wrong-kind error, with its task
    task: str


# A text the rules accept: at least one character that is not whitespace.
_TEXT_SCHEMA = {"type": "string", "minLength": 1, "pattern": r"\S"}
_EXAMPLES = {"text": {"text": "a gripping, funny film"}, "texts": {"texts": ["loved it", "a dull mess"]},
             "pairs": {"pairs": [["a man is riding a horse", "a man rides a horse"]]}}


def _shape(field: str, title: str, description: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"title": title, "type": "object", "properties": {field: {"description": description, **value}},
            "required": [field], "additionalProperties": False}


def _request_schema(schema: dict[str, Any]) -> None:
    """PredictRequest's JSON schema as the rules have it: exactly one of three closed shapes.

    (The model's own schema, three optional nullable fields, would call `{}` or a body with both
    `text` and `texts` valid, and a schema-driven client or fuzzer would be refused for following it.)
    """
    text = lambda: copy.deepcopy(_TEXT_SCHEMA)  # noqa: E731 - a fresh dict per use: servers edit them
    for key in ("properties", "additionalProperties", "required"):
        schema.pop(key, None)
    schema["type"] = "object"
    schema["oneOf"] = [
        _shape("text", "One text", "one text", text()),
        _shape("texts", "Several texts", "several texts, answered in order",
               {"type": "array", "minItems": 1, "items": text()}),
        _shape("pairs", "Text pairs", "text pairs [[a, b], ...] for sentence-pair tasks",
               {"type": "array", "minItems": 1,
                "items": {"type": "array", "prefixItems": [text(), text()], "minItems": 2, "maxItems": 2}}),
    ]
    schema["examples"] = [_EXAMPLES["text"], _EXAMPLES["texts"]]


def restrict_request_schema(document: dict[str, Any], limits: "InputLimits") -> None:
    """Narrow PredictRequest in an OpenAPI document to one server: its model's input kind (text and
    texts, or pairs), `max_items` per list and `max_text_bytes` per text. JSON Schema counts
    characters, not bytes, so maxLength is the byte limit (a longer text is certainly refused) and the
    description states the limit in bytes."""
    schema = document.get("components", {}).get("schemas", {}).get("PredictRequest")
    if not schema or "oneOf" not in schema:
        return
    keep = ("pairs",) if limits.pair else ("text", "texts")
    schema["oneOf"] = [b for b in schema["oneOf"] if b["required"][0] in keep]
    for branch in schema["oneOf"]:
        field = branch["required"][0]
        prop = branch["properties"][field]
        if field != "text":
            prop["maxItems"] = limits.max_items
        strings = [prop] if field == "text" else [prop["items"]] if field == "texts" else prop["items"]["prefixItems"]
        for st in strings:
            st["maxLength"] = limits.max_text_bytes
    kind = "text pairs: send `pairs`" if limits.pair else "single texts: send `text` or `texts`"
    schema["description"] = (f"Model {limits.model} (task {limits.task}) classifies {kind}. At most "
                             f"{limits.max_items} items per request and {limits.max_text_bytes} bytes of UTF-8 "
                             "per text; texts must not be blank.")
    schema["examples"] = [_EXAMPLES[k] for k in keep]


class PredictRequest(BaseModel):
    """Exactly one of `text`, `texts` or `pairs`. Pairs only for pair tasks (e.g. MRPC, QNLI)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_request_schema)
    text: Optional[StrictStr] = Field(None, description="one text")
    texts: Optional[list[StrictStr]] = Field(None, description="several texts, answered in order")
    pairs: Optional[list[tuple[StrictStr, StrictStr]]] = Field(
        None, description="text pairs [[a, b], ...] for sentence-pair tasks")

    @model_validator(mode="after")
    def _exactly_one_input(self) -> "PredictRequest":
        given = [k for k in INPUT_FIELDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise PydanticCustomError(ONE_INPUT, "send exactly one of 'text', 'texts' or 'pairs'"
                                      + (f" (got {', '.join(given)})" if given else ""))
        return self

    @property
    def field(self) -> str:
        """The input field this request uses ('text', 'texts' or 'pairs')."""
        return "text" if self.text is not None else "texts" if self.texts is not None else "pairs"

    def inputs(self, limits: InputLimits) -> tuple[Inputs, int]:
        """The texts (or pairs) to classify and their total UTF-8 size; ApiError when `limits` refuse them.

        Checked in this order: the input kind (400), then the item count, then each text in turn
        (invalid Unicode, blank, too long: 422), so one request always gets the same error.
        """
        field = self.field
        if field == "pairs" and not limits.pair:
            raise ApiError(400, "wrong_input_kind", f"model {limits.model} (task {limits.task}) classifies "
                           "single texts; send 'text' or 'texts', not 'pairs'")
        if field != "pairs" and limits.pair:
            raise ApiError(400, "wrong_input_kind", f"model {limits.model} (task {limits.task}) classifies "
                           "text pairs; send 'pairs': [[first, second], ...]")
        items: list[Any] = [self.text] if field == "text" else list(getattr(self, field))
        if not items:
            raise ApiError(422, "invalid_request", f"'{field}' is empty; send at least one item")
        if len(items) > limits.max_items:
            raise ApiError(422, "too_many_items", f"'{field}' has {len(items)} items; the limit is {limits.max_items}")
        total_bytes = 0
        for i, item in enumerate(items):
            for j, s in enumerate(item if field == "pairs" else (item,)):
                where = field if field == "text" else f"{field}[{i}]" + (f"[{j}]" if field == "pairs" else "")
                total_bytes += text_bytes(s, where, limits.max_text_bytes, lambda code, msg: ApiError(422, code, msg))
        return items, total_bytes


def text_bytes(s: str, where: str, max_text_bytes: int, error: Callable[[str, str], Exception]) -> int:
    """The UTF-8 size of one text under the serving rules (valid Unicode, not blank, within the byte limit);
    `error(code, message)` makes the exception each protocol raises for a text that breaks one."""
    try:
        n = len(s.encode("utf-8"))
    except UnicodeEncodeError:
        raise error("invalid_text", f"{where} is not valid Unicode (unpaired surrogate)") from None
    if not s.strip():
        raise error("empty_text", f"{where} is empty")
    if n > max_text_bytes:
        raise error("text_too_long", f"{where} is {n} bytes of UTF-8; the limit is {max_text_bytes} bytes")
    return n


def validation_message(errors: Sequence[dict[str, Any]]) -> str:
    """One readable line for a body pydantic refused: the first three problems, then a count."""
    parts = []
    for e in errors[:3]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        if e.get("type") in _OWN_ERRORS:
            parts.append(e["msg"])
        elif e.get("type") == "json_invalid":
            why = (e.get("ctx") or {}).get("error")
            loc_ = e.get("loc", ())
            at = f"character {loc_[1]}" if len(loc_) > 1 and isinstance(loc_[1], int) else ""
            why = f"{why}: {at}" if why and at else why or at
            parts.append(f"the request body is not valid JSON ({why})" if why else "the request body is not valid JSON")
        elif tuple(e.get("loc", ())) == ("body",):
            parts.append('the request body must be a JSON object such as {"text": "..."} '
                         "sent with Content-Type: application/json")
        elif e.get("type") == "string_type" and isinstance(e.get("input"), (list, tuple)) and \
                loc.split(".")[0] in ("text", "texts"):  # a list where a text goes: a list of texts, or a pair
            pairs = "text pairs as 'pairs': [[a, b], ...] (to a model trained on pairs)"
            fix = f"send several texts as 'texts': [...], or {pairs}" if loc == "text" else f"send {pairs}"
            parts.append(f"{loc} is a list, not a text; {fix}")
        else:
            parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    more = len(errors) - 3
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


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


def error_body(code: int, type_: str, message: str, request_id: str | None) -> bytes:
    """An `ErrorResponse` as JSON bytes (the middleware answers before FastAPI, so it needs bytes)."""
    return ErrorResponse(error=ErrorBody(code=code, type=type_, message=message),
                         request_id=request_id).model_dump_json().encode()


def v2_error_body(message: str) -> bytes:
    """The Open Inference Protocol's error body, {"error": "..."}: what every answer on a /v2 path
    carries, whichever layer (connection guard, middleware, app) gives it."""
    return json.dumps({"error": message}).encode()


def is_v2_path(path: str | bytes) -> bool:
    return path.startswith(b"/v2" if isinstance(path, bytes) else "/v2")


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
