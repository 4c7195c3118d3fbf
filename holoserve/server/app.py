"""The FastAPI application: /predict, /healthz, /readyz, /v1/models, /metrics.

Cross-cutting work (request ids, auth, body-size limit, HTTP metrics, JSON access log) lives in
one plain ASGI middleware: Starlette's BaseHTTPMiddleware would cost more than the whole
request's server overhead budget. Bad input always gets a 4xx JSON error of one shape:
{"error": {"code", "type", "message"}, "request_id"}.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Callable

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import HoloServeError, __version__
from holoserve.core.artifact import MANIFEST, Artifact, load_artifact
from ..backends.base import Backend, load_backend
from holoserve.core.tokenizer import TextEncoder
from .batcher import DynamicBatcher, QueueFull, ShuttingDown
from .config import ServerConfig
from .metrics import CONTENT_TYPE, ServerMetrics
from .schemas import ErrorResponse, ModelList, PredictRequest, PredictResponse, Status

log = logging.getLogger("holoserve.server")
access_log = logging.getLogger("holoserve.access")

ROUTES = ("/predict", "/healthz", "/readyz", "/v1/models", "/metrics", "/docs", "/openapi.json", "/redoc")
PUBLIC = frozenset({"/healthz", "/readyz", "/docs", "/openapi.json", "/redoc", "/docs/oauth2-redirect"})
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
_RID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
# Request ids: a random per-process prefix and a counter (uuid4 costs a syscall per request).
_RID_PREFIX = uuid.uuid4().hex[:12]
_rid_counter = itertools.count(1)
# Tokenize in a worker thread only when a request is big enough for it to matter.
_INLINE_TOKENIZE_BYTES = 4096


class ApiError(Exception):
    def __init__(self, code: int, type_: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code, self.type, self.message, self.headers = code, type_, message, headers or {}


def error_body(code: int, type_: str, message: str, request_id: str | None) -> bytes:
    return json.dumps({"error": {"code": code, "type": type_, "message": message}, "request_id": request_id},
                      ensure_ascii=False).encode()


def open_backend(config: ServerConfig, artifact: Artifact) -> tuple[Backend, dict[str, Any]]:
    """Load the configured backend; 'auto' picks the best this machine can run and says why."""
    # Loaders ignore options they do not use; torch-cuda sizes its CUDA graphs by max_batch.
    opts: dict[str, Any] = {"max_batch": config.max_batch_size}
    if config.threads:
        opts["threads"] = config.threads
    if config.backend == "auto":
        from ..backends.auto import select_backend

        return select_backend(artifact, **opts)
    backend = load_backend(config.backend, artifact, **opts)
    return backend, {"picked": config.backend, "reason": "requested with --backend", "skipped": {}}


def _no_otel() -> dict[str, Any]:
    """Newer FastAPI wraps every request in OpenTelemetry spans by default: tens of microseconds per
    request that this server, which exports Prometheus metrics, does not need."""
    import inspect

    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    return {}


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class ServerState:
    def __init__(self, config: ServerConfig, artifact: Artifact, backend: Backend | None,
                 decision: dict[str, Any] | None, shutdown_flag: Callable[[], bool] | None):
        self.config = config
        self.artifact = artifact
        self.backend = backend
        self.decision = decision or {}
        self.shutdown_flag = shutdown_flag or (lambda: False)
        self.name = config.model_name or artifact.path.resolve().name
        self.version = hashlib.sha256((artifact.path / MANIFEST).read_bytes()).hexdigest()[:12]
        self.max_seq = config.max_seq_length or artifact.max_seq_length
        self.encoder = TextEncoder(artifact.path / "tokenizer.json", self.max_seq, pair=artifact.is_pair)
        self.labels = artifact.labels or ["score"]
        self.regression = not artifact.labels
        self.metrics = ServerMetrics(self.name, self.version)
        self.batcher: DynamicBatcher | None = None
        self.status = "loading"
        self.detail: str | None = None
        self.warmup_task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.status == "ready" and not self.shutdown_flag()

    def load_backend(self) -> None:
        self.backend, self.decision = open_backend(self.config, self.artifact)

    def warmup(self) -> None:
        """Run the backend at batch 1 and at the max batch size; check the logits' shape."""
        n = len(self.labels)
        self.encoder.encode(["warm up", "the tokenizer"])
        for batch, seq in ((1, 8), (min(self.config.max_batch_size, 8), min(self.max_seq, 64))):
            ids = np.full((batch, seq), 1, dtype=np.int64)
            ids[:, 0] = 101 if self.encoder.pad_id == 0 else ids[:, 0]
            out = np.asarray(self.backend.infer(ids, np.ones_like(ids), np.zeros_like(ids)))
            if out.shape != (batch, n):
                raise HoloServeError(
                    f"the backend returned logits of shape {out.shape} for a batch of {batch}; the manifest has "
                    f"{n} label(s) ({self.labels}); the export does not match this checkpoint, re-export it")

    def model_info(self) -> dict[str, Any]:
        s = self.artifact.summary()
        info = self.backend.info() if self.backend is not None else {"backend": self.config.backend}
        return {
            "name": self.name,
            "version": self.version,
            "backend": {**info, "selection": self.decision.get("reason")},
            "task": s["task"],
            "labels": self.artifact.labels,
            "max_seq_length": self.max_seq,
            "sparsity": s["sparsity"],
            "precision": s["precision"],
            "metrics": s["metrics"],
            "base_model": s["base_model"],
            "batching": {"max_batch_size": self.config.max_batch_size,
                         "max_queue_delay_ms": self.config.max_queue_delay_ms,
                         "max_queue_size": self.config.max_queue_size,
                         "max_padding_waste": self.config.max_padding_waste,
                         "inline_single": self.config.inline_single},
            "limits": {"max_items": self.config.max_items, "max_text_bytes": self.config.max_text_bytes,
                       "max_body_bytes": self.config.max_body_bytes},
        }


class EdgeMiddleware:
    """Request id, bearer auth, body-size limit, HTTP metrics and the JSON access log."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        token = state.config.api_token
        self.token = token.encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        m = self.state.metrics
        headers = dict(scope.get("headers") or ())
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        if not _RID.match(rid):
            rid = f"{_RID_PREFIX}{next(_rid_counter):08x}"
        scope.setdefault("state", {})["request_id"] = rid
        path, method = scope["path"], scope["method"]
        status = [500]

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)

        async def reject(code: int, type_: str, msg: str, extra: list[tuple[bytes, bytes]] = ()):
            body = error_body(code, type_, msg, rid)
            await send_wrapped({"type": "http.response.start", "status": code, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]})
            await send_wrapped({"type": "http.response.body", "body": body})

        m.in_flight.inc()
        bytes_in = 0
        try:
            if self.token is not None and path not in PUBLIC:
                auth = headers.get(b"authorization", b"")
                scheme, _, given = auth.partition(b" ")
                if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.token):
                    if path == "/predict":
                        m.fail("unauthorized")
                    return await reject(401, "unauthorized", "missing or wrong bearer token: send "
                                        "'Authorization: Bearer <token>'", [(b"www-authenticate", b"Bearer")])
            if method in ("POST", "PUT", "PATCH"):
                limit = self.state.config.max_body_bytes
                cl = headers.get(b"content-length")
                if cl is not None:
                    if not cl.strip().isdigit():
                        return await reject(400, "bad_request", "Content-Length is not a number")
                    if int(cl) > limit:
                        if path == "/predict":
                            m.fail("body_too_large")
                        return await reject(413, "body_too_large",
                                            f"request body is {int(cl)} bytes; the limit is {limit} bytes")
                chunks = []
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    chunk = msg.get("body", b"")
                    bytes_in += len(chunk)
                    if bytes_in > limit:
                        if path == "/predict":
                            m.fail("body_too_large")
                        return await reject(413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
                    chunks.append(chunk)
                    if not msg.get("more_body", False):
                        break
                body = b"".join(chunks)
                replayed = False

                async def replay():
                    nonlocal replayed
                    if not replayed:
                        replayed = True
                        return {"type": "http.request", "body": body, "more_body": False}
                    return await receive()

                return await self.app(scope, replay, send_wrapped)
            return await self.app(scope, receive, send_wrapped)
        finally:
            m.in_flight.dec()
            dt = time.perf_counter() - t0
            route = path if path in ROUTES else "other"
            m.http_duration.labels(route, method if method in METHODS else "other", str(status[0])).observe(dt)
            if self.state.config.access_log:
                client = scope.get("client")
                extra = {"request_id": rid, "method": method, "path": route, "status": status[0],
                         "duration_ms": round(dt * 1000, 3), "bytes_in": bytes_in,
                         "client": f"{client[0]}:{client[1]}" if client else None}
                timing = scope["state"].get("timing")
                if timing is not None:
                    extra["timing_ms"] = timing
                access_log.info("%s %s %d", method, route, status[0], extra=extra)


def create_app(config: ServerConfig, *, artifact: Artifact | None = None, backend: Backend | None = None,
               decision: dict[str, Any] | None = None, shutdown_flag: Callable[[], bool] | None = None) -> FastAPI:
    """Build the app. Without `backend`, the lifespan loads it (the path `--workers N` takes)."""
    config.validate()
    if artifact is None:
        artifact = load_artifact(config.artifact_dir, verify=config.verify, check_weights=False)
    st = ServerState(config, artifact, backend, decision, shutdown_flag)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if st.backend is None:
            await asyncio.to_thread(st.load_backend)
        log.info("serving %s (version %s) with backend %s", st.name, st.version, st.backend.name,
                 extra={"backend": st.backend.info(), "selection": st.decision})
        st.batcher = DynamicBatcher(st.backend.infer, max_batch_size=config.max_batch_size,
                                    max_queue_delay_ms=config.max_queue_delay_ms,
                                    max_queue_size=config.max_queue_size, pad_id=st.encoder.pad_id,
                                    max_padding_waste=config.max_padding_waste,
                                    metrics=st.metrics, inline_single=config.inline_single)
        st.batcher.start()

        async def warm():
            try:
                if config.warmup:
                    await asyncio.to_thread(st.warmup)
                st.status = "ready"
                st.metrics.ready_l.set(1)
                log.info("ready")
            except Exception as e:  # surfaced on /readyz; the process stays up for inspection
                st.status, st.detail = "failed", f"warm-up failed: {e}"
                log.error(st.detail, exc_info=not isinstance(e, HoloServeError))

        st.warmup_task = asyncio.get_running_loop().create_task(warm())
        try:
            yield
        finally:
            st.status = "shutting_down"
            st.metrics.ready_l.set(0)
            await st.warmup_task
            await st.batcher.stop(config.graceful_timeout_s)
            log.info("stopped")

    app = FastAPI(
        title="HoloServe",
        version=__version__,
        description="Text classification with 2:4 sparse INT8 BERT-family models. "
                    "Bearer-token auth applies to every route except /healthz, /readyz and the docs "
                    "when the server runs with HOLOSERVE_API_TOKEN set.",
        lifespan=lifespan,
        **_no_otel(),
    )
    app.state.hs = st

    def err(request: Request, code: int, type_: str, message: str, headers: dict[str, str] | None = None) -> Response:
        rid = getattr(request.state, "request_id", None)
        return Response(error_body(code, type_, message, rid), status_code=code, headers=headers,
                        media_type="application/json")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return err(request, exc.code, exc.type, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        if request.url.path == "/predict":
            st.metrics.fail("invalid_request")
        parts = []
        for e in exc.errors()[:3]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            if e.get("type") == "json_invalid":
                parts.append("the request body is not valid JSON")
            elif tuple(e.get("loc", ())) == ("body",):
                parts.append('the request body must be a JSON object such as {"text": "..."} '
                             "sent with Content-Type: application/json")
            else:
                parts.append(f"{loc}: {e.get('msg', 'invalid')}")
        more = len(exc.errors()) - 3
        msg = "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
        return err(request, 422, "invalid_request", msg)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return err(request, exc.status_code, type_, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.error("unhandled error", exc_info=exc, extra={"request_id": getattr(request.state, "request_id", None)})
        return err(request, 500, "internal", "internal server error; see the server log for this request id")

    errors = {c: {"model": ErrorResponse} for c in (400, 401, 413, 422, 503)}

    @app.post("/predict", response_model=PredictResponse, responses=errors,
              summary="Classify one text, several texts, or text pairs")
    async def predict(req: PredictRequest, request: Request):
        t0 = time.perf_counter()
        m = st.metrics
        try:
            return await _predict(req, request, t0)
        except ApiError as e:
            m.fail(e.type)
            raise
        finally:
            m.request_duration_l.observe(time.perf_counter() - t0)

    async def _predict(req: PredictRequest, request: Request, t0: float) -> Response:
        cfg, m = st.config, st.metrics
        given = [k for k in ("text", "texts", "pairs") if getattr(req, k) is not None]
        if len(given) != 1:
            raise ApiError(422, "invalid_request", "send exactly one of 'text', 'texts' or 'pairs'"
                           + (f" (got {', '.join(given)})" if given else ""))
        field = given[0]
        if field == "pairs" and not st.artifact.is_pair:
            raise ApiError(400, "wrong_input_kind", f"model {st.name} (task {st.artifact.task_name}) classifies "
                           "single texts; send 'text' or 'texts', not 'pairs'")
        if field != "pairs" and st.artifact.is_pair:
            raise ApiError(400, "wrong_input_kind", f"model {st.name} (task {st.artifact.task_name}) classifies "
                           "text pairs; send 'pairs': [[first, second], ...]")
        items: list[Any] = [req.text] if field == "text" else list(getattr(req, field))
        if not items:
            raise ApiError(422, "invalid_request", f"'{field}' is empty; send at least one item")
        if len(items) > cfg.max_items:
            raise ApiError(422, "too_many_items", f"'{field}' has {len(items)} items; the limit is {cfg.max_items}")
        total_bytes = 0
        for i, item in enumerate(items):
            for j, s in enumerate(item if field == "pairs" else (item,)):
                where = field if field == "text" else f"{field}[{i}]" + (f"[{j}]" if field == "pairs" else "")
                try:
                    n = len(s.encode("utf-8"))
                except UnicodeEncodeError:
                    raise ApiError(422, "invalid_text", f"{where} is not valid Unicode (unpaired surrogate)") from None
                if not s.strip():
                    raise ApiError(422, "empty_text", f"{where} is empty")
                if n > cfg.max_text_bytes:
                    raise ApiError(422, "text_too_long",
                                   f"{where} is {n} bytes of UTF-8; the limit is {cfg.max_text_bytes} bytes")
                total_bytes += n
        if not st.ready:
            m.fail("not_ready")
            raise ApiError(503, "not_ready", f"the model is {st.status.replace('_', ' ')}; retry shortly",
                           {"Retry-After": "1"})
        if total_bytes > _INLINE_TOKENIZE_BYTES:
            encs = await asyncio.to_thread(st.encoder.encode, items)
        else:
            encs = st.encoder.encode(items)
        t1 = time.perf_counter()
        m.input_duration_l.observe(t1 - t0)
        try:
            results = await st.batcher.submit(encs)
        except QueueFull as e:
            raise ApiError(503, "overloaded", str(e), {"Retry-After": str(e.retry_after_s)}) from None
        except ShuttingDown as e:
            raise ApiError(503, "shutting_down", str(e), {"Retry-After": "1"}) from None
        except Exception:
            m.fail("backend")
            raise
        preds = []
        for enc, r in zip(encs, results):
            if st.regression:
                v = float(r.logits[0])
                preds.append({"label": "score", "score": v, "scores": {"score": v},
                              "num_tokens": enc.length, "truncated": enc.truncated})
                continue
            p = _softmax(r.logits.astype(np.float64))
            k = int(p.argmax())
            preds.append({"label": st.labels[k], "score": float(p[k]),
                          "scores": {lab: float(x) for lab, x in zip(st.labels, p)},
                          "num_tokens": enc.length, "truncated": enc.truncated})
        queue_s = max(r.queue_s for r in results)
        infer_s = sum({r.batch_id: r.infer_s for r in results}.values())
        m.queue_duration_l.observe(queue_s)
        m.success_l.inc()
        timing = {"tokenize": round((t1 - t0) * 1000, 3), "queue": round(queue_s * 1000, 3),
                  "inference": round(infer_s * 1000, 3), "total": round((time.perf_counter() - t0) * 1000, 3)}
        request.state.timing = timing  # the access log line carries it too
        body = {
            "model": {"name": st.name, "version": st.version, "backend": st.backend.name},
            "predictions": preds,
            "timing_ms": timing,
            "request_id": request.state.request_id,
        }
        return Response(json.dumps(body, ensure_ascii=False).encode(), media_type="application/json")

    @app.get("/healthz", response_model=Status, summary="Liveness: the process is up")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz", response_model=Status, responses={503: {"model": Status}},
             summary="Readiness: the model is loaded and warmed up")
    async def readyz():
        if st.ready:
            return {"status": "ready"}
        status = "shutting_down" if st.shutdown_flag() else st.status
        return Response(json.dumps({"status": status, "detail": st.detail}).encode(), status_code=503,
                        media_type="application/json")

    @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorResponse}},
             summary="The served model: task, labels, sparsity, precision, backend, dev metrics")
    async def models():
        return {"models": [st.model_info()]}

    @app.get("/metrics", summary="Prometheus metrics", responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, 401: {"model": ErrorResponse}})
    async def metrics():
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(EdgeMiddleware, state=st)
    return app
