"""Cross-cutting work for every request: request id, bearer auth, body-size limit, request
decompression, HTTP metrics, the JSON access log, and the last word on errors.

Auth takes exactly one Authorization header: with two, which one a server reads differs from server to
server (this one's header dict kept the last), so a request carrying two is refused with 400.

Compressed request bodies (Content-Encoding: gzip or deflate, which tritonclient sends when asked to
compress requests) are inflated here, to at most the body limit (413 beyond it: a small compressed
body must not inflate to gigabytes); any other encoding gets 415 naming the ones supported.

One plain ASGI middleware: Starlette's BaseHTTPMiddleware would cost more than the whole request's
server overhead budget.

Bodies are bounded before any work: only the inference routes (POST /predict and the v2 infer routes) take
one, so any other request is answered without reading its body (with `Connection: close`, as the unread
rest would otherwise be read and thrown away); a protected route refuses a request without valid
credentials before reading its body; and the bodies being received or held by requests in progress, all
together, are bounded by `max_buffered_body_bytes` (503 + Retry-After beyond it, so many clients sending
large bodies at once cannot add up to more memory than that). What large bodies freed is handed back to
the system once no large body is held (memory.py).

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
import zlib

from . import fastpath
from .config import ServerConfig
from .memory import MemoryReleaser
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


class BodyError(Exception):
    def __init__(self, code: int, type_: str, message: str):
        super().__init__(message)
        self.code, self.type, self.message = code, type_, message


ENCODINGS = ("gzip", "deflate")


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """A gzip or deflate request body, inflated to at most `limit` bytes; BodyError otherwise."""
    coding = encoding.strip().lower()
    if coding == "x-gzip":
        coding = "gzip"
    if coding not in ENCODINGS:
        raise BodyError(415, "unsupported_encoding", f"Content-Encoding {encoding!r} is not supported; send the "
                        "body uncompressed, or compressed with gzip or deflate (one encoding)")
    # gzip: a gzip header; deflate: the zlib format HTTP names so, or bare deflate data, which some clients send.
    tries = (16 + zlib.MAX_WBITS,) if coding == "gzip" else (zlib.MAX_WBITS, -zlib.MAX_WBITS)
    for wbits in tries:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit:
            raise BodyError(413, "body_too_large", f"the {coding} request body inflates to more than the limit "
                            f"of {limit} bytes")
        if not inflater.eof or inflater.unused_data:
            break
        return out
    raise BodyError(400, "invalid_body", f"the request body is not valid {coding} data (Content-Encoding: "
                    f"{encoding}); compress the whole body once, or send it uncompressed")


def is_inference(path: str) -> bool:
    """A request counted in the inference metrics: /predict and the v2 infer routes."""
    return path == "/predict" or (path.endswith("/infer") and path.startswith("/v2/models/"))


def declares_body(headers: dict[bytes, bytes]) -> bool:
    """The request head announces a body (a non-zero Content-Length, or Transfer-Encoding)."""
    cl = headers.get(b"content-length")
    return b"transfer-encoding" in headers or (cl is not None and cl.strip() not in (b"", b"0"))


class EdgeMiddleware:
    """Request id, bearer auth, body-size limits, HTTP metrics and the JSON access log."""

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics, service=None):
        self.app, self.config, self.metrics = app, config, metrics
        self.service = service  # valid JSON /predict requests are answered by fastpath.py through it
        token = config.api_token
        self.token = token.encode() if token else None
        self.buffered = 0  # body bytes held by requests in progress, all together
        self.memory = MemoryReleaser()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        m = self.metrics
        headers = dict(scope.get("headers") or ())
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        if not _RID.match(rid):
            rid = f"{_RID_PREFIX}{next(_rid_counter):08x}"
        scope.setdefault("state", {})["request_id"] = rid
        path, method = scope["path"], scope["method"]
        status = [0]  # 0 until a response starts; 499 in the log when the client left before one

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)

        unread = declares_body(headers)  # until the body has been read whole

        async def reject(code: int, type_: str, msg: str, extra: list[tuple[bytes, bytes]] = ()):
            # The Open Inference Protocol's routes answer errors as {"error": "..."}. A body left unread would
            # still be read (and thrown away) on a kept-alive connection: close it instead.
            body = v2_error_body(msg) if is_v2_path(path) else error_body(code, type_, msg, rid)
            close = [(b"connection", b"close")] if unread and all(k != b"connection" for k, _ in extra) else []
            await send_wrapped({"type": "http.response.start", "status": code, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra,
                *close]})
            await send_wrapped({"type": "http.response.body", "body": body})

        m.in_flight.inc()
        bytes_in = held = 0
        try:
            if self.token is not None and path not in PUBLIC:
                auth = headers.get(b"authorization", b"")
                if auth and sum(k == b"authorization" for k, _ in scope["headers"]) > 1:
                    if is_inference(path):
                        m.fail("unauthorized")
                    return await reject(400, "bad_request", "the request has more than one Authorization header; "
                                        "send one: 'Authorization: Bearer <token>'")
                scheme, _, given = auth.partition(b" ")
                if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.token):
                    if is_inference(path):
                        m.fail("unauthorized")
                    return await reject(401, "unauthorized", "missing or wrong bearer token: send "
                                        "'Authorization: Bearer <token>'", [(b"www-authenticate", b"Bearer")])
            if method != "POST" or not is_inference(path):
                if unread:  # this route takes no body: answer without reading it
                    return await self.app(scope, receive, closing(send_wrapped))
                return await self.app(scope, receive, send_wrapped)
            limit = self.config.max_body_bytes
            cl = headers.get(b"content-length")
            if cl is not None:
                if not cl.strip().isdigit():
                    return await reject(400, "bad_request", "Content-Length is not a number")
                if int(cl) > limit:
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
                    m.fail("body_too_large")
                    return await reject(413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
                if not self._hold(len(chunk)):
                    m.fail("overloaded")
                    return await reject(503, "overloaded", self._budget_message(), [(b"retry-after", b"1")])
                held += len(chunk)
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    unread = False
                    break
            body = b"".join(chunks)
            chunks.clear()
            encoding = headers.get(b"content-encoding")
            if encoding is not None and encoding.strip().lower() != b"identity":
                try:
                    body = inflate(body, encoding.decode("latin-1"), limit)
                except BodyError as e:
                    m.fail(e.type)
                    return await reject(e.code, e.type, e.message)
                if len(body) > held and not self._hold(len(body) - held):
                    m.fail("overloaded")
                    return await reject(503, "overloaded", self._budget_message(), [(b"retry-after", b"1")])
                held = max(held, len(body))
                # The app sees the body as if it had been sent uncompressed.
                scope = {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                              if k not in (b"content-encoding", b"content-length")]
                         + [(b"content-length", str(len(body)).encode())]}
            if path == "/predict" and self.service is not None:
                req = fastpath.parse(headers, body)
                if req is not None:
                    return await fastpath.answer(self.service, req, rid, scope["state"], send_wrapped)
            replayed = False

            async def replay():
                nonlocal replayed, body
                if not replayed:
                    replayed = True
                    message = {"type": "http.request", "body": body, "more_body": False}
                    body = b""
                    return message
                return await receive()

            return await self.app(scope, replay, send_wrapped)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when the graceful-shutdown drain times out.
            if status[0]:
                raise
            log.warning("request cancelled: the shutdown drain timed out", extra={"request_id": rid})
            if is_inference(path):
                m.fail("shutting_down")
            await reject(503, "shutting_down", "the server is shutting down and could not finish this request "
                         "in time; retry it", [(b"retry-after", b"1"), (b"connection", b"close")])
        except Exception as exc:
            if status[0]:
                raise  # the response has started: all that is left is to let the server close the connection
            log.error("unhandled error", exc_info=exc, extra={"request_id": rid})
            await reject(500, "internal", "internal server error; see the server log for this request id")
        finally:
            if held:
                self.buffered -= held
                self.memory.freed(held, idle=self.buffered < self.memory.min_freed_bytes)
            m.in_flight.dec()
            dt = time.perf_counter() - t0
            code = status[0] or 499
            route = route_label(path)
            m.http_duration.labels(route, method if method in METHODS else "other", str(code)).observe(dt)
            if self.config.access_log:
                client = scope.get("client")
                extra = {"request_id": rid, "method": method, "path": route, "status": code,
                         "duration_ms": round(dt * 1000, 3), "bytes_in": bytes_in,
                         "client": f"{client[0]}:{client[1]}" if client else None}
                timing = scope["state"].get("timing")  # the Timing of a /predict answer
                if timing is not None:
                    extra["timing_ms"] = timing.model_dump()
                access_log.info("%s %s %d", method, route, code, extra=extra)

    def _hold(self, nbytes: int) -> bool:
        """Count `nbytes` more of body held, or False (and count nothing) where that passes the budget."""
        if self.buffered + nbytes > self.config.max_buffered_body_bytes:
            return False
        self.buffered += nbytes
        return True

    def _budget_message(self) -> str:
        return (f"the server holds {self.buffered} bytes of request bodies in progress, near its limit of "
                f"{self.config.max_buffered_body_bytes} (--max-buffered-body-bytes); retry shortly")


def closing(send):
    """`send` with `Connection: close` added to the response head."""

    async def send_closing(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await send(message)

    return send_closing
