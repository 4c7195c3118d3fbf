"""Request bodies at the edge: how large one may be, how many bytes all requests in progress may hold
together, and compressed bodies. The edge middleware (middleware.py) reads a body through `BodyGate` only
for the inference routes, after the credentials have been checked.

A body is refused before it is read where its Content-Length passes the body limit (413), and while it is
read where the bytes received do. The bodies being received or held by requests in progress, all together,
are bounded by `max_buffered_body_bytes` (503 + Retry-After beyond it, so many clients sending large
bodies at once cannot add up to more memory than that). What large bodies freed is handed back to the
system once no large body is held (memory.py).

Compressed request bodies (Content-Encoding: gzip or deflate, which tritonclient sends when asked to
compress requests) are inflated here, to at most the body limit (413 beyond it: a small compressed
body must not inflate to gigabytes); any other encoding gets 415 naming the ones supported. The app
sees an inflated body as if it had been sent uncompressed.
"""
from __future__ import annotations

import zlib

from .config import ServerConfig
from .memory import MemoryReleaser


class BodyError(Exception):
    """A body refused: the error answer's status, type and message, and headers it adds. `counted`: the
    refusal counts as a failed inference request, under its type."""

    def __init__(self, code: int, type_: str, message: str, headers=(), counted: bool = True):
        super().__init__(message)
        self.code, self.type, self.message = code, type_, message
        self.headers, self.counted = headers, counted


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


def declares_body(headers: dict[bytes, bytes]) -> bool:
    """The request head announces a body (a non-zero Content-Length, or Transfer-Encoding)."""
    cl = headers.get(b"content-length")
    return b"transfer-encoding" in headers or (cl is not None and cl.strip() not in (b"", b"0"))


def as_uncompressed(scope: dict, length: int) -> dict:
    """The scope the app gets with an inflated body of `length` bytes: no Content-Encoding, and that length."""
    kept = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
    return {**scope, "headers": kept + [(b"content-length", str(length).encode())]}


class BodyGate:
    """Reads request bodies within the body limit and the budget of body bytes that all requests in progress
    may hold together; `buffered` is what they hold now.

    Each request's `tally` (the edge middleware's record of it) counts the bytes received (`bytes_in`) and
    held (`held`, to give back through `release` when the request ends), and `unread` turns False once its
    body has been read whole."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.buffered = 0  # body bytes held by requests in progress, all together
        self.memory = MemoryReleaser()

    async def read(self, scope: dict, receive, headers: dict[bytes, bytes], tally) -> tuple[dict, bytes] | None:
        """The scope the app is to get and the whole body, inflated where it was compressed; None where the
        client left before sending it all; BodyError where it is refused."""
        limit = self.config.max_body_bytes
        cl = headers.get(b"content-length")
        if cl is not None:
            if not cl.strip().isdigit():
                raise BodyError(400, "bad_request", "Content-Length is not a number", counted=False)
            if int(cl) > limit:
                raise BodyError(413, "body_too_large", f"request body is {int(cl)} bytes; the limit is {limit} bytes")
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            tally.bytes_in += len(chunk)
            if tally.bytes_in > limit:
                raise BodyError(413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
            self._hold(tally, len(chunk))
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        tally.unread = False
        body = b"".join(chunks)
        encoding = headers.get(b"content-encoding")
        if encoding is not None and encoding.strip().lower() != b"identity":
            return self._inflated(scope, body, encoding.decode("latin-1"), tally)
        return scope, body

    def _inflated(self, scope: dict, body: bytes, encoding: str, tally) -> tuple[dict, bytes]:
        """A compressed body inflated, the bytes it grew by held too, and the scope of an uncompressed one."""
        body = inflate(body, encoding, self.config.max_body_bytes)
        if len(body) > tally.held:
            self._hold(tally, len(body) - tally.held)
        return as_uncompressed(scope, len(body)), body

    def _hold(self, tally, nbytes: int) -> None:
        """Count `nbytes` more of body held by the request `tally`; BodyError (503, and nothing counted) where
        that passes the budget."""
        if self.buffered + nbytes > self.config.max_buffered_body_bytes:
            raise BodyError(503, "overloaded", self._budget_message(), [(b"retry-after", b"1")])
        self.buffered += nbytes
        tally.held += nbytes

    def release(self, nbytes: int) -> None:
        """A request that held `nbytes` of body has ended."""
        self.buffered -= nbytes
        self.memory.freed(nbytes, idle=self.buffered < self.memory.min_freed_bytes)

    def _budget_message(self) -> str:
        return (f"the server holds {self.buffered} bytes of request bodies in progress, near its limit of "
                f"{self.config.max_buffered_body_bytes} (--max-buffered-body-bytes); retry shortly")
