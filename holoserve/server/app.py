"""The FastAPI application: /predict, /healthz, /readyz, /v1/models, /metrics and the Open Inference
Protocol's /v2 routes (kserve.py).

`create_app` wires the pieces: the settings, the `ClassifierService` (service.py) that holds the
model, the routers (routes.py), the edge middleware (middleware.py: request ids, auth, HTTP
metrics, access log; bodies.py: body limits and decompression) and the error handlers. Bad input always
gets a 4xx JSON error of
one shape: {"error": {"code", "type", "message"}, "request_id"} (protocol.py).
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from holoserve.core.artifact import Artifact, load_artifact
from ..backends.base import Backend
from .config import ServerConfig
from .middleware import EdgeMiddleware
from .kserve import v2_error_body
from .protocol import ApiError, error_body, restrict_request_schema, validation_message
from .routes import ROUTERS
from .service import ClassifierService, open_backend

__all__ = ["ApiError", "ClassifierService", "create_app", "error_body", "open_backend"]

log = logging.getLogger("holoserve.server")

_HTTP_ERROR_TYPES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}


def _no_otel() -> dict[str, Any]:
    """Newer FastAPI wraps every request in OpenTelemetry spans by default: tens of microseconds per
    request that this server, which exports Prometheus metrics, does not need."""
    import inspect

    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    return {}


# ---- error handlers: every error leaves in the ErrorResponse shape


def _error(request: Request, code: int, type_: str, message: str, headers: dict[str, str] | None = None) -> Response:
    rid = getattr(request.state, "request_id", None)
    # The Open Inference Protocol's routes answer errors as {"error": "..."}.
    body = v2_error_body(message) if request.url.path.startswith("/v2") else error_body(code, type_, message, rid)
    return Response(body, status_code=code, headers=headers,
                    media_type="application/json")


async def _api_error(request: Request, exc: ApiError) -> Response:
    return _error(request, exc.code, exc.type, exc.message, exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    if request.url.path == "/predict":
        request.app.state.service.metrics.fail("invalid_request")
    return _error(request, 422, "invalid_request", validation_message(exc.errors()))


def _body_parse_message(cause: BaseException | None) -> str:
    """What FastAPI's generic 'error parsing the body' 400 was about, for the client."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset "
                f"{cause.start}); send JSON encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply to parse; send a flat JSON object such as {\"text\": \"...\"}"
    return "the request body cannot be parsed as JSON; send a JSON object such as {\"text\": \"...\"} in UTF-8"


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    type_ = _HTTP_ERROR_TYPES.get(exc.status_code, "http_error")
    message = str(exc.detail)
    if exc.status_code == 400 and message == "There was an error parsing the body":
        type_, message = "invalid_body", _body_parse_message(exc.__cause__)
        if request.url.path == "/predict":
            request.app.state.service.metrics.fail("invalid_request")
    return _error(request, exc.status_code, type_, message, getattr(exc, "headers", None))


async def _internal(request: Request, exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc, extra={"request_id": getattr(request.state, "request_id", None)})
    return _error(request, 500, "internal", "internal server error; see the server log for this request id")


def create_app(config: ServerConfig, *, artifact: Artifact | None = None, backend: Backend | None = None,
               decision: dict[str, Any] | None = None, shutdown_flag: Callable[[], bool] | None = None) -> FastAPI:
    """Build the app. Without `backend`, the lifespan loads it (the path `--workers N` takes)."""
    config.validate()
    if artifact is None:
        artifact = load_artifact(config.artifact_dir, verify=config.verify)
    service = ClassifierService(config, artifact, backend, decision, shutdown_flag)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        if config.workers > 1 and service.warmup_task is not None:
            # One process alone answers /healthz while it warms up; of several workers sharing one
            # socket, one still warming would take its share of connections and answer them 503
            # not_ready while /readyz (answered by a warm worker) says ready. Until it is warm it
            # accepts nothing, so the kernel hands every connection to a worker that is.
            await service.warmup_task
        try:
            # The connection guard (connections.py) counts the connections it closes in these metrics.
            yield {"holoserve_metrics": service.metrics}
        finally:
            await service.stop()

    app = FastAPI(
        # The routers' routes go straight into the app's route table: include_router() would keep
        # each router as a nested route, matched a second time on every request.
        routes=[route for router in ROUTERS for route in router.routes],
        title="HoloServe",
        version=__version__,
        description="Text classification with 2:4 sparse INT8 BERT-family models. "
                    "Bearer-token auth applies to every route except /healthz, /readyz and the docs "
                    "when the server runs with HOLOSERVE_API_TOKEN set.",
        lifespan=lifespan,
        **_no_otel(),
    )
    app.state.service = service
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """The generated document, with the request schema narrowed to what this server accepts (the
        model's input kind, the item and text limits), so every body it calls valid is served."""
        if app.openapi_schema is None:
            restrict_request_schema(default_openapi(), service.limits)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.add_middleware(EdgeMiddleware, config=config, metrics=service.metrics, service=service)
    return app
