"""A minimal asyncio HTTP/1.1 keep-alive client and the helpers around it (a free port, raw request bytes,
a server's Prometheus metrics).

Hand-written on purpose: a general-purpose client library costs more CPU per request than the server under
test does, and both share the machine's cores; and the hostile benchmark needs to send bytes no library
would (split heads, pipelined requests, bodies that never finish)."""
from __future__ import annotations

import asyncio
import json
import socket
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(body: bytes, path: str = "/predict", ctype: str = "application/json", extra: str = "") -> bytes:
    """A whole POST request's bytes; `extra` holds further header lines, each ending in CRLF."""
    return (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


def get(path: str, extra: str = "", version: str = "1.1") -> bytes:
    """A whole GET request's bytes."""
    return f"GET {path} HTTP/{version}\r\nHost: bench\r\n{extra}\r\n".encode()


class Conn:
    """One keep-alive connection to 127.0.0.1:`port` (or `host`)."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    async def send(self, data: bytes) -> None:
        if self.writer is None:
            raise ConnectionError("not connected")
        self.writer.write(data)
        await self.writer.drain()

    async def _read(self) -> tuple[int, dict[str, str], bytes]:
        line = await self.reader.readline()
        if not line:
            raise ConnectionError("closed")
        status = int(line.split()[1])
        headers = {}
        while True:
            h = await self.reader.readline()
            if h in (b"\r\n", b""):
                break
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", 0))
        body = await self.reader.readexactly(n) if n else b""
        return status, headers, body

    async def response(self, timeout: float | None = 10.0) -> tuple[int, dict[str, str], bytes]:
        """One response (status, lower-cased headers, body); raises ConnectionError when the server closed
        without (finishing) one, asyncio.TimeoutError after `timeout` s (None: no limit)."""
        try:
            if timeout is None:
                return await self._read()
            return await asyncio.wait_for(self._read(), timeout)
        except asyncio.IncompleteReadError:
            raise ConnectionError("closed mid-response") from None

    async def request(self, path: str, body: bytes | None = None,
                      timeout: float | None = None) -> tuple[int, bytes]:
        """POST `body` (JSON) to `path`, or GET it when `body` is None, connecting first where needed; returns
        (status, body) and closes this side when the server answered `Connection: close`."""
        if self.writer is None:
            await self.open()
        await self.send(get(path) if body is None else post(body, path))
        status, headers, data = await self.response(timeout)
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, data

    async def closed(self, wait: float = 0.05) -> bool:
        """Whether the server has closed this connection (reading whatever it sent before closing)."""
        if self.reader is None:
            return True
        try:
            while True:
                data = await asyncio.wait_for(self.reader.read(65536), wait)
                if not data:
                    return True
        except asyncio.TimeoutError:
            return False
        except (ConnectionError, OSError):
            return True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def tally(self, request: bytes, statuses: dict[str, int], timeout: float) -> None:
        """Send `request` (connecting first where needed) and count its status, or the error that ended the
        connection, in `statuses`; a `Connection: close` answer closes this side too."""
        try:
            if self.writer is None:
                await self.open()
            await self.send(request)
            status, headers, _ = await self.response(timeout)
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if headers.get("connection", "").lower() == "close":
                self.close()
        except (ConnectionError, OSError, asyncio.TimeoutError) as e:
            statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
            self.close()


def _get(url: str, token: str = "", timeout: float = 10) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def metrics(url: str, token: str = "") -> dict[str, float]:
    """The server's Prometheus samples, `name{labels}` (as the exposition writes them) -> value."""
    out: dict[str, float] = {}
    for line in _get(url + "/metrics", token).decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric_sum(samples: dict[str, float], name: str) -> float | None:
    """The sum of `name`'s samples over all label sets (None where the server has no such metric)."""
    vals = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    return sum(vals) if vals else None


def model_name(url: str, token: str = "") -> str:
    """The name the server lists its model under (/v1/models)."""
    return json.loads(_get(url + "/v1/models", token))["models"][0]["name"]


def readyz(url: str) -> int:
    """/readyz's status, 0 where nothing answered."""
    try:
        return urllib.request.urlopen(url + "/readyz", timeout=10).status
    except Exception:
        return 0


def closed_connections(url: str, token: str = "") -> dict[str, float]:
    """holoserve_http_connections_closed_total by reason ({} where the server has no such counter)."""
    try:
        samples = metrics(url, token)
    except Exception:
        return {}
    prefix = "holoserve_http_connections_closed_total{"
    return {k.split('reason="', 1)[1].split('"', 1)[0]: v for k, v in samples.items() if k.startswith(prefix)}
