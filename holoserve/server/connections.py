"""Connection limits: what one client can hold of the server before a request reaches the app.

uvicorn's HTTP/1.1 protocol (httptools) bounds none of these: the size of a request head (a 32 MB
header is read whole into memory), the time a client may take to send its head (a connection that
trickles a header byte every few seconds, "slowloris", stays open for ever), the time to send a
declared body, or the number of open connections (past the open-file limit accept() fails, and
legitimate clients can no longer connect at all). `GuardedHttpToolsProtocol` adds each bound:

- request line + headers larger than `max_header_bytes`: 431 and the connection is closed;
- a head not complete `header_timeout_s` after its first byte (or after connect): 408 and close
  (a connection that sent nothing is closed without an answer, as an idle keep-alive one is);
- a body not complete `body_timeout_s` after its head: 408 and close (the app sees a disconnect);
- bytes that are not HTTP/1.1: 400 in the API's JSON error shape, and close;
- a response the client does not read: the transport's write buffer pauses the sender past its
  high-water mark (64 KiB), so the app holds at most the response it is writing (whose size the
  routes bound); when the client has taken nothing of it for `send_timeout_s` the connection is
  aborted, which drops what was buffered for it (a client that reads, however slowly, is not);
  and while the answers waiting on stalled connections together pass `SEND_BUDGET_BODIES` times the
  body limit, the connection stalled longest is aborted, so many such clients at once cannot add up
  to more memory than that before their timeouts; a request that arrives while the client has not
  taken the last answer waits until it has;
- more than `max_connections` open: the connection that has waited longest for its client (idle,
  a head or a body still arriving) is closed to make room; a connection whose request the app is
  working on is never dropped. When every connection is busy, the new one gets 503 and is closed.

Per request this costs a few attribute checks: timers are armed only when a head or a body spans
several reads, which a well-behaved client's small request never does.

Errors on a /v2 path carry the Open Inference Protocol's body, {"error": "..."}, as the app's do.

Shutdown (SIGTERM): a connection whose request is on its way (a head or a body arriving) is read and
answered, then closed; an idle one is closed after DRAIN_GRACE_S, so that a request already sent when the
signal came is answered too, with `Connection: close`. uvicorn waits for these (up to the graceful timeout).

A client that closes its connection while the app answers one request and a pipelined one waits:
uvicorn marks only the newest request disconnected, and the running one would write to the closed
transport and log an error; here every request of the connection is told the client is gone.

Closures are counted in `holoserve_http_connections_closed_total{reason}` (header_too_large, header_timeout,
body_timeout, send_timeout, send_budget, bad_request, evicted, refused; the app's lifespan hands its
metrics to the protocol through the lifespan state) and logged at most once per reason every 10 s.
"""
from __future__ import annotations

import errno
import http
import logging
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import HoloServeError
from .config import ServerConfig
from .protocol import error_body, is_v2_path, v2_error_body

log = logging.getLogger("holoserve.server")

try:  # the ioctl that tells how many bytes wait in a socket's send queue (Linux: SIOCOUTQ)
    import fcntl
    import termios

    _OUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # pragma: no cover - not on this system
    fcntl = None  # type: ignore[assignment]
    _OUTQ = None

# Answers waiting in the buffers of connections whose clients do not read, all together, in request
# bodies' worth (--max-body-bytes): legitimate answers are a few kB and never wait there.
SEND_BUDGET_BODIES = 32

# How long an idle connection stays open once shutdown begins: a request already on the wire is answered.
DRAIN_GRACE_S = 0.5

# File descriptors kept free for everything but client connections (model files, logs, pipes).
FD_HEADROOM = 128
_WARN_EVERY_S = 10.0
_last_warning: dict[str, float] = {}


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int = ServerConfig.max_header_bytes
    header_timeout_s: float = ServerConfig.header_timeout_s
    body_timeout_s: float = ServerConfig.body_timeout_s
    max_connections: int = ServerConfig.max_connections
    send_timeout_s: float = ServerConfig.send_timeout_s
    send_budget_bytes: int = SEND_BUDGET_BODIES * ServerConfig.max_body_bytes

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> "ConnectionLimits":
        return cls(cfg.max_header_bytes, cfg.header_timeout_s, cfg.body_timeout_s, cfg.max_connections,
                   cfg.send_timeout_s, SEND_BUDGET_BODIES * cfg.max_body_bytes)


def _note(reason: str, message: str) -> None:
    """Log a connection closure, at most once per reason every 10 s (an attack would flood the log)."""
    now = time.monotonic()
    if now - _last_warning.get(reason, -_WARN_EVERY_S) >= _WARN_EVERY_S:
        _last_warning[reason] = now
        log.warning("%s (further closures for this reason are counted in "
                    "holoserve_http_connections_closed_total, logged again in %.0f s)", message, _WARN_EVERY_S)


def raw_error(code: int, type_: str, message: str, extra: bytes = b"", v2: bool = False) -> bytes:
    """A whole HTTP/1.1 error response in the API's JSON error shape (the Open Inference Protocol's
    with `v2`), ending the connection."""
    body = v2_error_body(message) if v2 else error_body(code, type_, message, None)
    return (f"HTTP/1.1 {code} {http.HTTPStatus(code).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n").encode() + extra + b"\r\n" + body


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools missing: server_options() falls back to h11 with its header limit
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


if HttpToolsProtocol is not None:

    class GuardedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's httptools protocol with the limits above. `limits` None: read from HOLOSERVE_*
        variables (the worker processes of `--workers N`, which import this class by name)."""

        limits: ClassVar[ConnectionLimits | None] = None
        _env_limits: ClassVar[ConnectionLimits | None] = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            lim = type(self).limits
            if lim is None:
                if GuardedHttpToolsProtocol._env_limits is None:
                    GuardedHttpToolsProtocol._env_limits = ConnectionLimits.from_config(ServerConfig.from_env())
                lim = GuardedHttpToolsProtocol._env_limits
            self._max_head = lim.max_header_bytes
            self._head_timeout = lim.header_timeout_s
            self._body_timeout = lim.body_timeout_s
            self._max_connections = lim.max_connections
            self._send_timeout = lim.send_timeout_s
            self._send_budget = lim.send_budget_bytes
            self._stalled_since = 0.0  # when writing last paused
            self._timer: Any = None
            self._send_timer: Any = None  # armed while the transport's write buffer is over its high-water mark
            self._send_left = 0  # bytes buffered when the send timer was armed
            self._running: Any = None  # the request cycle the app is answering (pipelined ones wait behind it)
            self._deferred: Any = None  # (cycle, app) of a request held until the client takes the last answer
            self._head_started = False  # bytes of a request head have arrived, the head is not complete
            self._in_body = False  # the head is complete, the body is not
            self._head_bytes = 0  # bytes of earlier reads of the head in progress
            self._heads = 0  # request heads begun on this connection
            self._body_in_read = False  # body bytes were parsed in the read being handled
            self._closed = False  # _close has run: one closure, counted once
            self._draining = False  # the server is shutting down: answer what is on its way, then close
            self._chunk = 0  # size of the read being parsed
            self._refused: tuple[int, str, str] | None = None
            self._v2_head = False  # the request whose body is arriving is on a /v2 path
            # When the connection began waiting for its client (connect, or its last answer); None while
            # the app holds a whole request. The longest waiting is the first dropped at the cap.
            self._idle_since: float | None = None
            self._metrics = None

        # ---- asyncio.Protocol
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._metrics = self.app_state.get("holoserve_metrics")
            if self._metrics is not None:
                self._metrics.connections.inc()
            self._idle_since = self.loop.time()
            self._timer = self.loop.call_later(self._head_timeout, self._on_head_timeout)
            if len(self.connections) > self._max_connections:
                self._make_room()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timer()
            self._cancel_send_timer()
            self._idle_since = None
            # uvicorn marks only its newest cycle (a pipelined request still waiting) disconnected: the
            # one the app is answering must stop writing too, and the waiting ones will never run.
            deferred = (self._deferred[0],) if self._deferred is not None else ()
            self._deferred = None
            for cycle in (self._running, *deferred, *(c for c, _ in self.pipeline)):
                if cycle is not None and not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()
            self.pipeline.clear()
            if self._metrics is not None:
                self._metrics.connections.dec()
                self._metrics = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._chunk = len(data)
            self._body_in_read = False
            continuing, heads = self._head_started, self._heads
            super().data_received(data)
            if self._refused is not None:
                code, type_, message = self._refused
                return self._close("header_too_large", message, raw_error(code, type_, message, v2=self._v2_head))
            if self.transport.is_closing():
                return
            if self._head_started:  # a head spans reads: bound its size and its time
                if continuing and heads == self._heads:  # the whole read belongs to the head in progress
                    self._head_bytes += self._chunk
                elif self._body_in_read:  # the head began after a body in this read: its part parsed so far
                    self._head_bytes = self._parsed_head_bytes()
                else:  # the head began in this read: what follows the last complete head in it, if any
                    end = data.rfind(b"\r\n\r\n")
                    self._head_bytes = len(data) - (end + 4 if end >= 0 else 0)
                if self._head_bytes > self._max_head:
                    msg = f"the request line and headers exceed {self._max_head} bytes"
                    return self._close("header_too_large", msg,
                                       raw_error(431, "header_too_large", msg, v2=self._v2()))
                if self._timer is None:
                    self._timer = self.loop.call_later(self._head_timeout, self._on_head_timeout)
            elif self._in_body and self._timer is None:
                self._timer = self.loop.call_later(self._body_timeout, self._on_body_timeout)

        def _parsed_head_bytes(self) -> int:
            """About the size of the request head parsed so far (request line and the complete headers)."""
            return len(getattr(self, "url", b"") or b"") + sum(len(k) + len(v) + 4 for k, v in self.headers) + 16

        # ---- httptools parser callbacks
        def on_message_begin(self) -> None:
            self._head_started = True
            self._heads += 1
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._v2_head = self._v2()
            self._head_started = False
            self._cancel_timer()
            if self._refused is not None:  # a pipelined head after a refused one: the connection is closing
                return
            size = self._head_bytes + self._chunk
            self._head_bytes = 0
            if size > self._max_head:  # the reads were larger than the limit: measure the head itself
                size = self._parsed_head_bytes()
                if size > self._max_head:
                    self._refused = (431, "header_too_large",
                                     f"the request line and headers are {size} bytes; the limit is {self._max_head}")
                    return
            self._in_body = True
            super().on_headers_complete()
            if self._draining and self.cycle is not None:  # answered, then the connection closes
                self.cycle.keep_alive = False

        def on_body(self, body: bytes) -> None:
            self._body_in_read = True
            if self._refused is None:
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._in_body = False
            self._cancel_timer()
            if self._refused is None:
                self._idle_since = None
                super().on_message_complete()

        def on_response_complete(self) -> None:
            self._idle_since = self.loop.time()
            self._running = None
            super().on_response_complete()

        def _start_asgi_task(self, cycle, app) -> None:
            if self.flow.write_paused:
                # The client has not taken the last answer: the next request waits, so that a client
                # that pipelines requests and reads nothing holds one answer, not a second one built
                # and waiting to be written (with its request body and parsed request).
                self._deferred = (cycle, app)
                return
            self._running = cycle
            super()._start_asgi_task(cycle, app)

        def shutdown(self) -> None:
            self._draining = True
            if self._deferred is not None:  # a client that does not read: nothing more will be answered
                self._close("send_timeout", "the server is shutting down and the client reads nothing", abort=True)
                return
            if self._head_started or self._in_body:  # a request on its way: read and answer it, then close
                if self.cycle is not None and not self.cycle.response_complete:
                    self.cycle.keep_alive = False
                return
            if self.cycle is None or self.cycle.response_complete:  # idle: a request may already be on the wire
                self._cancel_timer()
                self._timer = self.loop.call_later(DRAIN_GRACE_S, self._on_drain_grace)
                return
            super().shutdown()

        def _on_drain_grace(self) -> None:
            self._timer = None
            if self._head_started:  # a head is arriving: its own time limit applies again
                self._timer = self.loop.call_later(self._head_timeout, self._on_head_timeout)
                return
            if self._in_body or (self.cycle is not None and not self.cycle.response_complete):
                return  # a request arrived: its answer closes the connection
            if not self.transport.is_closing():
                self.transport.close()

        # ---- asyncio write flow control: a client that does not read its response
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._stalled_since = self.loop.time()
                self._arm_send_timer()
                self._keep_send_budget()

        def _keep_send_budget(self) -> None:
            """Abort the longest-stalled connections while the stalled ones' buffers pass the budget."""
            stalled = [c for c in self.connections if getattr(c, "_send_timer", None) is not None]
            total = sum(c.transport.get_write_buffer_size() for c in stalled)
            if total <= self._send_budget:
                return
            for conn in sorted(stalled, key=lambda c: c._stalled_since):
                if total <= self._send_budget or conn is self:
                    break
                size = conn.transport.get_write_buffer_size()
                total -= size
                conn._close("send_budget", f"{len(stalled)} clients do not read their answers, which hold more "
                            f"than {self._send_budget} bytes together; dropped the one stalled longest "
                            f"({size} bytes waiting)", abort=True)

        def resume_writing(self) -> None:
            self._cancel_send_timer()
            super().resume_writing()
            if self._deferred is not None and not self.transport.is_closing():
                cycle, app = self._deferred
                self._deferred = None
                self._start_asgi_task(cycle, app)

        def _unsent(self) -> int:
            """Bytes of answers not yet taken by the client: the transport's buffer and, where the system
            says, the socket's send queue (a reading client drains that first, and the transport's
            buffer moves only when a third of the socket's buffer is free)."""
            n = self.transport.get_write_buffer_size()
            sock = self.transport.get_extra_info("socket")
            if _OUTQ is not None and sock is not None:
                try:
                    n += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
                except (OSError, ValueError):
                    pass
            return n

        def _arm_send_timer(self) -> None:
            self._send_left = self._unsent()
            self._send_timer = self.loop.call_later(self._send_timeout, self._on_send_timeout)

        def _cancel_send_timer(self) -> None:
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _on_send_timeout(self) -> None:
            """Writing has been paused for send_timeout_s: a client that took some of the buffer meanwhile is
            reading slowly and gets another period; one that took nothing is cut off."""
            self._send_timer = None
            if self._unsent() < self._send_left:
                return self._arm_send_timer()
            buffered = self.transport.get_write_buffer_size()
            self._close("send_timeout", f"the client read nothing of its response for {self._send_timeout:g} s "
                        f"({buffered} bytes waiting)", abort=True)

        def _v2(self) -> bool:
            """The request being read is on a /v2 path (its URL so far says so)."""
            if self._in_body:
                return self._v2_head
            url = getattr(self, "url", None)
            return bool(self._head_started and url and is_v2_path(url))

        # ---- limits
        def _cancel_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def send_400_response(self, msg: str) -> None:
            """Bytes that are not HTTP/1.1: the JSON error shape instead of uvicorn's plain text."""
            text = "the request is not valid HTTP/1.1"
            self._close("bad_request", text, raw_error(400, "bad_request", text, v2=self._v2()))

        def _close(self, reason: str, message: str, response: bytes = b"", abort: bool = False) -> None:
            self._cancel_timer()
            self._idle_since = None  # not a candidate for eviction any more
            if self._closed:  # closed already (and counted): a later limit can only make it an abort
                if abort:
                    self._cancel_send_timer()
                    self.transport.abort()
                return
            self._closed = True
            if abort or (not response and self.transport.get_write_buffer_size()):
                # close() would wait for the client to take what is buffered, which it may never do.
                self._cancel_send_timer()
                self.transport.abort()
            else:
                if self.transport.is_closing():
                    return
                if response:
                    self.transport.write(response)
                self.transport.close()
            if self._metrics is not None:
                self._metrics.connections_closed.labels(reason).inc()
            client = "%s:%d" % self.client if self.client else "a client"
            _note(reason, f"closed the connection of {client}: {message}")

        def _on_head_timeout(self) -> None:
            self._timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                # A pipelined head started while the app answers the previous request: wait for it.
                self._timer = self.loop.call_later(self._head_timeout, self._on_head_timeout)
                return
            if self._head_started:
                msg = f"the request head did not arrive within {self._head_timeout:g} s"
                self._close("header_timeout", msg, raw_error(408, "request_timeout", msg, v2=self._v2()))
            else:
                self._close("header_timeout", f"no request within {self._head_timeout:g} s of connecting")

        def _on_body_timeout(self) -> None:
            self._timer = None
            cycle = self.cycle
            msg = f"the request body did not arrive within {self._body_timeout:g} s of its headers"
            response = b""
            if cycle is not None and not cycle.response_started:
                cycle.disconnected = True  # the app's next receive() answers http.disconnect
                cycle.message_event.set()
                response = raw_error(408, "request_timeout", msg, v2=self._v2())
            self._close("body_timeout", msg, response)

        def _make_room(self) -> None:
            """Over the connection cap: drop the connection that has waited longest for its client,
            or refuse this one when every other connection has a request in the app."""
            victim, oldest = None, None
            for conn in self.connections:
                since = getattr(conn, "_idle_since", None)
                if conn is not self and since is not None and (oldest is None or since < oldest):
                    victim, oldest = conn, since
            if victim is not None:
                victim._close("evicted", f"{self._max_connections} connections are open; dropped the one "
                              "waiting longest for its client")
            else:
                msg = (f"the server has {self._max_connections} open connections, all with a request in "
                       "progress; retry shortly")
                self._close("refused", msg, raw_error(503, "overloaded", msg, b"retry-after: 1\r\n"))

else:  # pragma: no cover - httptools is a dependency
    GuardedHttpToolsProtocol = None  # type: ignore[assignment,misc]


def guarded_protocol(cfg: ServerConfig) -> type:
    """The guarded protocol class bound to `cfg`'s limits (one process; several apps may share it)."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"limits": ConnectionLimits.from_config(cfg)})


def server_options(cfg: ServerConfig, *, by_name: bool = False) -> dict[str, Any]:
    """uvicorn.Config options that apply `cfg`'s connection limits. `by_name`: name the protocol class
    instead of passing it (worker processes import it and read their limits from HOLOSERVE_*)."""
    opts: dict[str, Any] = {"ws": "none", "timeout_keep_alive": cfg.keep_alive_timeout_s,
                            "h11_max_incomplete_event_size": cfg.max_header_bytes}
    if GuardedHttpToolsProtocol is None:  # pragma: no cover
        log.warning("httptools is not installed: serving with h11, which bounds header size but not the "
                    "time to send a request (pip install httptools)")
        opts["http"] = "h11"
    else:
        opts["http"] = ("holoserve.server.connections:GuardedHttpToolsProtocol" if by_name
                        else guarded_protocol(cfg))
    return opts


def fit_open_files(max_connections: int) -> int:
    """Raise the soft open-file limit (up to the hard one) so `max_connections` client sockets fit;
    returns how many connections fit (lower than asked when the hard limit is too low)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_HEADROOM
    inf = resource.RLIM_INFINITY
    if soft != inf and soft < need:
        target = need if hard == inf else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != inf and soft < need:
        return max(1, soft - FD_HEADROOM)
    return max_connections


def check_listen(host: str, port: int) -> None:
    """Raises HoloServeError, naming the fix, where the server could not listen on host:port: binds as uvicorn
    will (SO_REUSEADDR, IPv6 for a host with a colon) and lets go. Run before the model loads, so that a
    taken port or a wrong --host fails in a moment instead of after the load, warm-up and timing."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family=family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except socket.gaierror as e:
        raise HoloServeError(f"cannot listen on {where}: --host {host!r} is not an address ({e.strerror}); use "
                             "0.0.0.0 for every interface, 127.0.0.1 for this machine only, or one of its "
                             "addresses") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            fix = ("another process is listening there (another server, or an earlier holoserve still "
                   "running): stop it, or pass another --port (HOLOSERVE_PORT)")
        elif e.errno == errno.EACCES:
            fix = ("ports below 1024 need root or CAP_NET_BIND_SERVICE: use --port 8000 or another port from "
                   "1024 up")
        elif e.errno == errno.EADDRNOTAVAIL:
            fix = (f"{host} is not an address of this machine: use 0.0.0.0 for every interface, 127.0.0.1 for "
                   "this machine only, or one of its addresses (--host, HOLOSERVE_HOST)")
        else:
            fix = "check --host and --port (HOLOSERVE_HOST, HOLOSERVE_PORT)"
        why = e.strerror or str(e)
        why = why[:1].lower() + why[1:]
        raise HoloServeError(f"cannot listen on {where}: {why}; {fix}") from None
