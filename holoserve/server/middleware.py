"""Cross-cutting work for every request, one concern at a time: the request id, bearer auth, the body
(bodies.py: size limits, the budget of body bytes held, request decompression), HTTP metrics and the JSON
access log, and the last word on errors.

One plain ASGI middleware: Starlette's BaseHTTPMiddleware would cost more than the whole request's
server overhead budget. For the same reason the concerns are not a stack of middlewares, each wrapping
`send` and `receive` once more: `EdgeMiddleware` is the one entry point, and calls each concern's piece
in turn with `_Exchange`, its record of the request.

Auth takes exactly one Authorization header: with two, which one a server reads differs from server to
server (this one's header dict kept the last), so a request carrying two is refused with 400.

Bodies are bounded before any work: only the inference routes (POST /predict and the v2 infer routes) take
one, so any other request is answered without reading its body (with `Connection: close`, as the unread
rest would otherwise be read and thrown away); a protected route refuses a request without valid
credentials before reading its body; and the body of an inference request is read within the limits of
bodies.py. Valid JSON /predict requests are then answered by fastpath.py, the rest by the app.

Errors: an exception that escapes the app is answered here with a JSON 500 and not raised further.
Starlette's outermost error middleware would re-raise it after answering, and uvicorn then closes the
connection, so every other request a client had queued on that keep-alive connection would fail too.
A request still waiting when the graceful-shutdown drain runs out is cancelled by uvicorn; it gets
the documented 503 + Retry-After here instead of uvicorn's plain-text 500.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import re
import time
import uuid

from . import fastpath
from .bodies import BodyError, BodyGate, declares_body
from .config import ServerConfig
from .metrics import ServerMetrics
from .protocol import error_body, is_v2_path, v2_error_body

access_log = logging.getLogger("holoserve.access")
log = logging.getLogger("holoserve.server")

ROUTES = ("/predict", "/healthz", "/readyz", "/v1/models", "/metrics", "/docs", "/openapi.json", "/redoc")
PUBLIC = frozenset({"/healthz", "/readyz", "/docs", "/openapi.json", "/redoc", "/docs/oauth2-redirect",
                    "/v2/health/live", "/v2/health/ready"})
V2_ROUTES = frozenset({"/v2", "/v2/health/live", "/v2/health/ready"})
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
_RID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
# Request ids: a random per-process prefix and a counter (uuid4 costs a syscall per request).
_RID_PREFIX = uuid.uuid4().hex[:12]
_rid_counter = itertools.count(1)


def route_label(path: str) -> str:
    """The bounded `route` label of the HTTP metrics and the access log for a request path."""
    if path in ROUTES:
        return path
    if path.startswith("/v2"):
        if path in V2_ROUTES:
            return path
        if path.startswith("/v2/models/"):
            for tail in ("/infer", "/ready"):
                if path.endswith(tail):
                    return "/v2/models/{name}" + tail
            return "/v2/models/{name}"
    return "other"


def is_inference(path: str) -> bool:
    """A request counted in the inference metrics: /predict and the v2 infer routes."""
    return path == "/predict" or (path.endswith("/infer") and path.startswith("/v2/models/"))


class EdgeMiddleware:
    """The one ASGI entry point. Per request: the id (`_identify`), credentials (`_authorize`), the body
    (bodies.BodyGate), the answer (the app's, or fastpath.py's), errors (`_answer_error`,
    `_answer_cancelled`), then the HTTP metric and the access-log line (`_observe`)."""

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics, service=None):
        self.app, self.config, self.metrics = app, config, metrics
        self.service = service  # valid JSON /predict requests are answered by fastpath.py through it
        token = config.api_token
        self.token = token.encode() if token else None
        self.gate = BodyGate(config)

    @property
    def buffered(self) -> int:
        """Body bytes held by requests in progress, all together."""
        return self.gate.buffered

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        headers = dict(scope.get("headers") or ())
        ex = _Exchange(scope, _identify(scope, headers), send, declares_body(headers))
        self.metrics.in_flight.inc()
        try:
            await self._handle(scope, receive, headers, ex)
        except asyncio.CancelledError:
            if ex.status:
                raise
            await self._answer_cancelled(ex)
        except Exception as exc:
            if ex.status:
                raise  # the response has started: all that is left is to let the server close the connection
            await self._answer_error(ex, exc)
        finally:
            if ex.held:
                self.gate.release(ex.held)
            self.metrics.in_flight.dec()
            self._observe(scope, ex, time.perf_counter() - t0)

    async def _handle(self, scope, receive, headers: dict[bytes, bytes], ex: _Exchange) -> None:
        """Credentials first, then the body (inference routes only), then the answer: fastpath.py's or the app's."""
        path = ex.path
        if self.token is not None and path not in PUBLIC:
            refusal = self._authorize(headers, scope["headers"])
            if refusal is not None:
                if is_inference(path):
                    self.metrics.fail("unauthorized")
                return await ex.reject(*refusal)
        if ex.method != "POST" or not is_inference(path):
            # This route takes no body: a body the request declares is left unread.
            return await self.app(scope, receive, closing(ex.send) if ex.unread else ex.send)
        try:
            got = await self.gate.read(scope, receive, headers, ex)
        except BodyError as e:
            if e.counted:
                self.metrics.fail(e.type)
            return await ex.reject(e.code, e.type, e.message, e.headers)
        if got is None:
            return  # the client left before sending the whole body
        scope, body = got
        if path == "/predict" and self.service is not None:
            req = fastpath.parse(headers, body)
            if req is not None:
                return await fastpath.answer(self.service, req, ex.rid, scope["state"], ex.send)
        replay = _Replay(body, receive)
        del got, body  # the app's first receive() takes the body, and it is not held here after that
        return await self.app(scope, replay, ex.send)

    def _authorize(self, headers: dict[bytes, bytes], raw_headers) -> tuple | None:
        """None where the request carries the bearer token (in one Authorization header); otherwise the
        refusal's status, type, message and headers."""
        auth = headers.get(b"authorization", b"")
        if auth and sum(k == b"authorization" for k, _ in raw_headers) > 1:
            return (400, "bad_request", "the request has more than one Authorization header; send one: "
                    "'Authorization: Bearer <token>'", ())
        scheme, _, given = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.token):
            return (401, "unauthorized", "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                    [(b"www-authenticate", b"Bearer")])
        return None

    async def _answer_cancelled(self, ex: _Exchange) -> None:
        """uvicorn cancels the requests still running when the graceful-shutdown drain times out: one that
        has not started its answer gets 503 + Retry-After, and its connection is closed."""
        log.warning("request cancelled: the shutdown drain timed out", extra={"request_id": ex.rid})
        if is_inference(ex.path):
            self.metrics.fail("shutting_down")
        await ex.reject(503, "shutting_down", "the server is shutting down and could not finish this request "
                        "in time; retry it", [(b"retry-after", b"1"), (b"connection", b"close")])

    async def _answer_error(self, ex: _Exchange, exc: Exception) -> None:
        """An exception that escaped before the answer started: logged, and answered with a JSON 500."""
        log.error("unhandled error", exc_info=exc, extra={"request_id": ex.rid})
        await ex.reject(500, "internal", "internal server error; see the server log for this request id")

    def _observe(self, scope, ex: _Exchange, seconds: float) -> None:
        """The request's HTTP duration metric and, where enabled, its access-log line."""
        code = ex.status or 499
        route = route_label(ex.path)
        method = ex.method
        self.metrics.http_duration.labels(route, method if method in METHODS else "other", str(code)).observe(seconds)
        if self.config.access_log:
            _log_access(scope, ex, route, code, seconds)


def _identify(scope, headers: dict[bytes, bytes]) -> str:
    """The request's id, kept in the scope's state: the client's X-Request-Id where it is a plain one, else a
    fresh one."""
    rid = headers.get(b"x-request-id", b"").decode("latin-1")
    if not _RID.match(rid):
        rid = f"{_RID_PREFIX}{next(_rid_counter):08x}"
    scope.setdefault("state", {})["request_id"] = rid
    return rid


class _Exchange:
    """One request as the edge sees it: its id, path and method; `status`, the status its answer started with;
    whether its body is still unread; and the body bytes received and held (counted by bodies.BodyGate)."""

    __slots__ = ("rid", "path", "method", "status", "unread", "bytes_in", "held", "_send")

    def __init__(self, scope, rid: str, send, unread: bool):
        self.rid, self.path, self.method, self._send = rid, scope["path"], scope["method"], send
        self.status = 0  # 0 until a response starts; 499 in the log when the client left before one
        self.unread = unread  # until the body has been read whole
        self.bytes_in = self.held = 0

    async def send(self, message) -> None:
        """The server's `send`, noting the answer's status and adding X-Request-Id to it."""
        if message["type"] == "http.response.start":
            self.status = message["status"]
            message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", self.rid.encode())]}
        await self._send(message)

    async def reject(self, code: int, type_: str, msg: str, extra: list[tuple[bytes, bytes]] = ()) -> None:
        """Answer with a JSON error: the Open Inference Protocol's routes as {"error": "..."}. A body left
        unread would still be read (and thrown away) on a kept-alive connection: the connection is closed instead."""
        body = v2_error_body(msg) if is_v2_path(self.path) else error_body(code, type_, msg, self.rid)
        close = [(b"connection", b"close")] if self.unread and all(k != b"connection" for k, _ in extra) else []
        await self.send({"type": "http.response.start", "status": code, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra, *close]})
        await self.send({"type": "http.response.body", "body": body})


class _Replay:
    """The `receive` the app gets once the edge has read the body: the body as one message, then the
    server's own `receive` (for the disconnect)."""

    __slots__ = ("body", "receive")

    def __init__(self, body: bytes, receive):
        self.body, self.receive = body, receive

    async def __call__(self):
        body = self.body
        if body is None:
            return await self.receive()
        self.body = None
        return {"type": "http.request", "body": body, "more_body": False}


def _log_access(scope, ex: _Exchange, route: str, code: int, seconds: float) -> None:
    """The request's JSON access-log line."""
    client = scope.get("client")
    extra = {"request_id": ex.rid, "method": ex.method, "path": route, "status": code,
             "duration_ms": round(seconds * 1000, 3), "bytes_in": ex.bytes_in,
             "client": f"{client[0]}:{client[1]}" if client else None}
    timing = scope["state"].get("timing")  # the Timing of a /predict answer
    if timing is not None:
        extra["timing_ms"] = timing.model_dump()
    access_log.info("%s %s %d", ex.method, route, code, extra=extra)


def closing(send):
    """`send` with `Connection: close` added to the response head."""

    async def send_closing(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await send(message)

    return send_closing
