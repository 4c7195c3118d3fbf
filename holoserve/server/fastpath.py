"""POST /predict without the web framework's per-request machinery.

Routing, dependency solving and the framework's own validation and serialization cost more per request than
tokenizing a sentence. A request whose body is JSON (`Content-Type: application/json`) that the same
`PredictRequest` model accepts is answered here, by the same service call and the same response model; any
other request (another content type, a body the model refuses) goes on to FastAPI, so every error keeps its
one shape and message and the OpenAPI document still describes the route.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .protocol import ApiError, PredictRequest, error_body

_JSON = b"application/json"


def parse(headers: dict[bytes, bytes], body: bytes) -> PredictRequest | None:
    """The request, or None where FastAPI should answer it (not JSON, or refused by the model)."""
    ctype = headers.get(b"content-type", b"")
    if ctype.split(b";", 1)[0].strip().lower() != _JSON:
        return None
    try:
        return PredictRequest.model_validate_json(body)
    except ValidationError:
        return None


async def answer(service: Any, req: PredictRequest, request_id: str, state: dict, send) -> None:
    """Classify and send the answer as the /predict route would (ApiError as the app's error handler does)."""
    try:
        resp = await service.predict(req, request_id)
    except ApiError as e:
        status, body, extra = e.code, error_body(e.code, e.type, e.message, request_id), e.headers or {}
    else:
        state["timing"] = resp.timing_ms  # the access log line carries it too
        status, body, extra = 200, resp.model_dump_json().encode(), {}
    headers = [(b"content-length", str(len(body)).encode()), (b"content-type", _JSON),
               *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
