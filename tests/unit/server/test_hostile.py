"""Hostile and failing clients on real HTTP: a request the model cannot run fails alone, connection-level
abuse (huge headers, slow heads and bodies, connection floods) is bounded, and the edges of the protocol
(shutdown drain, the request schema, undecodable bodies, the auth token) answer as documented."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from holoserve import HoloServeError
from holoserve.backends.onnxruntime import OrtBackend
from holoserve.core.artifact import load_artifact
from holoserve.core.tokenizer import TextEncoder
from holoserve.server.app import create_app
from holoserve.server.config import ServerConfig
from tests.helpers.serving import running, metric, REPO, RawHTTP, server_env, tiny_checkpoint, wait_metric

os.environ.setdefault("OMP_NUM_THREADS", "1")





def serve_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`holoserve serve ...` expected to refuse to start: it must exit (with 2) well before `timeout`."""
    return subprocess.run([sys.executable, "-m", "holoserve", "serve", *args], env=server_env(**(env or {})),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- 1. a failing request fails alone


def test_a_max_seq_length_the_model_cannot_take_is_refused_at_start(sst2):
    # The tiny model's position table holds 128 tokens; its manifest contract is 32.
    r = serve_cli([str(sst2), "--max-seq-length", "1000", "--backend", "onnxruntime"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "position table holds 128 tokens" in r.stderr and "max_seq_length" in r.stderr
    assert "use at most 32" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(HoloServeError, match="calibrated and exported for 32 tokens"):
        create_app(ServerConfig(artifact_dir=str(sst2), threads=1, max_seq_length=64))
    app = create_app(ServerConfig(artifact_dir=str(sst2), threads=1, max_seq_length=16))  # shorter is fine
    assert app.state.service.max_seq == 16


def test_position_table_reads_config_json(tmp_path):
    from types import SimpleNamespace

    from holoserve.server.service import position_table

    art = SimpleNamespace(path=tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "max_position_embeddings": 512}))
    assert position_table(art) == 512
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta", "max_position_embeddings": 514,
                                                      "pad_token_id": 1}))
    assert position_table(art) == 512  # positions start after the padding index
    (tmp_path / "config.json").write_text("not json")
    assert position_table(art) is None


class PoisonedBackend:
    """The real ONNX Runtime backend, except that a batch holding `poison` fails the way ORT does when
    a sequence is longer than the position table."""

    name = "onnxruntime"

    def __init__(self, ckpt, poison: int):
        self.inner = OrtBackend(load_artifact(ckpt), threads=1)
        self.poison = poison
        self.batches: list[int] = []

    def info(self):
        return self.inner.info()

    def infer(self, ids, mask, types):
        self.batches.append(ids.shape[0])
        if (ids == self.poison).any():
            raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code returned while "
                               "running Gather node. indices element out of data bounds, idx=900 must be within "
                               "the inclusive range [-128,127]")
        return self.inner.infer(ids, mask, types)


def test_a_request_the_model_cannot_run_fails_alone_and_keeps_its_connection(sst2):
    art = load_artifact(sst2)
    horse = TextEncoder(sst2 / "tokenizer.json", art.max_seq_length).encode(["horse"])[0].input_ids[1]
    backend = PoisonedBackend(sst2, int(horse))
    good = [f"the movie was {w}" for w in ("good", "bad", "fine", "dull", "great", "awful", "fun", "sad")] * 2
    bad = ["a horse", "the horse is riding", "horse"]
    with running(sst2, backend=backend, max_batch_size=32, max_queue_delay_ms=300) as srv:
        async def go():
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as c:
                return await asyncio.gather(*(c.post(srv.url + "/predict", json={"text": t}) for t in good + bad))

        resps = asyncio.run(go())
        assert max(backend.batches) > 1, backend.batches  # good and bad requests did share a batch
        for r in resps[:len(good)]:
            assert r.status_code == 200, r.text
        for r in resps[len(good):]:
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "inference_failed" and "RuntimeError" in err["message"]
            assert "Traceback" not in r.text and r.json()["request_id"] == r.headers["x-request-id"]
        # The 500 is an answer, not a dropped connection: the next request on it is served.
        with RawHTTP(srv.url) as conn:
            conn.request("POST", "/predict", json.dumps({"text": "horse"}).encode())
            status, headers, body = conn.response()
            assert status == 500 and headers.get("connection") != "close"
            conn.request("POST", "/predict", json.dumps({"text": "good"}).encode())
            status, _, body = conn.response()
            assert status == 200 and json.loads(body)["predictions"][0]["label"] in ("positive", "negative")
        m = httpx.get(srv.url + "/metrics").text
        assert metric(m, "holoserve_inference_request_failure_total", reason="inference_failed") == len(bad) + 1
        assert metric(m, "holoserve_inference_request_failure_total") == len(bad) + 1  # counted once each


def test_an_unhandled_error_is_a_json_500_on_a_kept_connection(sst2):
    with running(sst2) as srv:
        def broken():
            raise ValueError("a bug")

        srv.app.state.service.model_info = broken
        with RawHTTP(srv.url) as conn:
            conn.request("GET", "/v1/models")
            status, headers, body = conn.response()
            assert status == 500 and headers["content-type"] == "application/json"
            assert json.loads(body)["error"]["type"] == "internal" and "a bug" not in body.decode()
            assert headers.get("connection") != "close"
            conn.request("GET", "/healthz")
            assert conn.response()[0] == 200


# --------------------------------------------------------------------------- 2. connection-level limits


@pytest.fixture(scope="module")
def guarded(sst2):
    with running(sst2, max_header_bytes=4096, header_timeout_s=1.0, body_timeout_s=1.0) as srv:
        yield srv


def test_a_header_over_the_limit_gets_431_and_is_not_read_whole(guarded):
    with RawHTTP(guarded.url) as conn:  # just under the limit: served
        conn.request("GET", "/healthz", headers={"X-Pad": "a" * 3000})
        assert conn.response()[0] == 200
    with RawHTTP(guarded.url) as conn:  # a whole head over the limit, in one write
        conn.request("GET", "/healthz", headers={"X-Pad": "a" * 20000})
        status, headers, body = conn.response()
        assert status == 431 and json.loads(body)["error"]["type"] == "header_too_large"
        assert conn.closed_within(2)
    with RawHTTP(guarded.url) as conn:  # a header that never ends: cut at the limit, not at the timeout
        t0 = time.monotonic()
        conn.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        with contextlib.suppress(ConnectionError, OSError):
            for _ in range(64):
                conn.send(b"b" * 1024)
                time.sleep(0.002)
        assert conn.closed_within(2) and time.monotonic() - t0 < 0.9
        assert conn.response()[0] == 431


def test_slow_heads_and_idle_connections_are_closed(guarded):
    with RawHTTP(guarded.url) as idle, RawHTTP(guarded.url) as slow:
        slow.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < 4 and not closed:  # one header line every 0.2 s, never the end
            with contextlib.suppress(OSError):
                slow.send(b"X-Slow: 1\r\n")
            closed = slow.closed_within(0.2)
        assert closed and time.monotonic() - t0 < 2.5
        status, _, body = slow.response()
        assert status == 408 and json.loads(body)["error"]["type"] == "request_timeout"
        assert idle.closed_within(2)  # connected, sent nothing
    m = httpx.get(guarded.url + "/metrics").text
    assert metric(m, "holoserve_http_connections_closed_total", reason="header_timeout") >= 2


def test_a_slow_body_is_cut_off_with_408(guarded):
    with RawHTTP(guarded.url) as conn:
        conn.send(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                  b'{"text": ')
        t0 = time.monotonic()
        assert conn.closed_within(3) and time.monotonic() - t0 < 2.5
        status, _, body = conn.response()
        assert status == 408 and "body" in json.loads(body)["error"]["message"]
    assert httpx.post(guarded.url + "/predict", json={"text": "still serving"}).status_code == 200


def test_a_connection_flood_drops_the_stalled_connections_not_the_clients(sst2):
    with running(sst2, max_connections=30, header_timeout_s=30.0) as srv:
        stalled = [RawHTTP(srv.url) for _ in range(60)]
        try:
            for c in stalled:
                c.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
            ok = 0
            for _ in range(10):
                with contextlib.suppress(httpx.HTTPError):
                    ok += httpx.post(srv.url + "/predict", json={"text": "good"}, timeout=5).status_code == 200
            assert ok == 10
            closed = sum(c.closed_within(0.05) for c in stalled)
            assert closed >= 30, closed  # the cap held: the oldest stalled connections were dropped
            m = httpx.get(srv.url + "/metrics").text
            assert metric(m, "holoserve_http_connections_closed_total", reason="evicted") >= 30
            assert metric(m, "holoserve_http_connections") <= 30
        finally:
            for c in stalled:
                c.close()


def test_garbage_bytes_get_a_json_400(guarded):
    with RawHTTP(guarded.url) as conn:
        conn.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n")  # e.g. TLS to a plain port
        status, headers, body = conn.response()
        assert status == 400 and json.loads(body)["error"]["type"] == "bad_request"


def test_connection_level_errors_on_v2_paths_have_the_v2_body(guarded):
    """431, 408 and 400 answered by the connection guard carry {"error": "..."} on /v2 paths, as the app's
    answers there do, and the API's error object elsewhere."""
    infer = "/v2/models/any/infer"
    with RawHTTP(guarded.url) as conn:  # a head over the limit
        conn.request("POST", infer, body=b"{}", headers={"X-Pad": "a" * 20000})
        status, _, body = conn.response()
        assert status == 431 and set(json.loads(body)) == {"error"} and "the limit is 4096" in json.loads(body)["error"]
    with RawHTTP(guarded.url) as conn:  # a head over the limit, arriving in pieces
        conn.send(f"POST {infer} HTTP/1.1\r\nHost: x\r\nX-Big: ".encode())
        with contextlib.suppress(ConnectionError, OSError):
            for _ in range(8):
                conn.send(b"b" * 1024)
        assert conn.closed_within(3)
        status, _, body = conn.response()
        assert status == 431 and isinstance(json.loads(body)["error"], str)
    with RawHTTP(guarded.url) as conn:  # a head that never ends
        conn.send(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        assert conn.closed_within(5)
        status, _, body = conn.response()
        assert status == 408 and "did not arrive" in json.loads(body)["error"]
    with RawHTTP(guarded.url) as conn:  # a body that never ends
        conn.send(f"POST {infer} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{".encode())
        assert conn.closed_within(5)
        status, _, body = conn.response()
        assert status == 408 and "body did not arrive" in json.loads(body)["error"]
    with RawHTTP(guarded.url) as conn:  # not HTTP/1.1
        conn.send(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n")
        status, _, body = conn.response()
        assert status == 400 and json.loads(body) == {"error": "the request is not valid HTTP/1.1"}
    with RawHTTP(guarded.url) as conn:  # the same on /predict: the API's error object
        conn.send(b"GET /predict HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n")
        status, _, body = conn.response()
        assert status == 400 and json.loads(body)["error"]["type"] == "bad_request"


def test_a_client_leaving_during_pipelined_requests_logs_no_error(guarded, caplog):
    """uvicorn marks only the newest pipelined request of a lost connection disconnected; the one being
    answered wrote to the closed transport and logged two error tracebacks."""
    import socket
    import struct

    body = json.dumps({"texts": ["a fun film"] * 64}).encode()
    req = (f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
           "\r\n\r\n").encode() + body
    before = metric(httpx.get(guarded.url + "/metrics").text, "holoserve_http_request_duration_seconds_count",
                    route="/predict")
    loggers = [logging.getLogger(n) for n in ("holoserve", "uvicorn.error")]
    for lg in loggers:  # whether or not they propagate to the root logger (setup_logging stops that)
        lg.addHandler(caplog.handler)
    try:
        for _ in range(6):
            s = socket.create_connection(("127.0.0.1", int(guarded.url.rsplit(":", 1)[1])))
            s.sendall(req * 3)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # leave with a reset
            s.close()
        # Every first request of the six was taken by the app: wait until each has finished.
        wait_metric(guarded.url, "holoserve_http_request_duration_seconds_count", lambda v: v >= before + 6,
                    route="/predict")
        wait_metric(guarded.url, "holoserve_http_requests_in_flight", lambda v: v == 1)
    finally:
        for lg in loggers:
            lg.removeHandler(caplog.handler)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert httpx.post(guarded.url + "/predict", json={"text": "still serving"}).status_code == 200


def test_a_response_the_client_does_not_read_is_dropped_after_the_send_timeout(sst2):
    """Pipelined requests whose ~0.9 MB answers the client never reads: once the kernel's buffers are
    full the app stops writing, and after send_timeout_s the connection is aborted, freeing what was
    buffered; other clients are served meanwhile."""
    import socket

    with running(sst2, send_timeout_s=1.0) as srv:
        name = httpx.get(srv.url + "/v1/models").json()["models"][0]["name"]
        body = json.dumps({"id": "r" * 900_000, "inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES",
                                                           "data": ["x"]}]}).encode()
        req = f"POST /v2/models/{name}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))

        def push():
            with contextlib.suppress(OSError):
                s.sendall((req + body) * 6)

        sender = threading.Thread(target=push, daemon=True)
        sender.start()
        try:
            assert httpx.post(srv.url + "/predict", json={"text": "a neighbour"}).status_code == 200
            wait_metric(srv.url, "holoserve_http_connections_closed_total", lambda v: v == 1, timeout=30,
                        reason="send_timeout")
            got = b""
            with contextlib.suppress(OSError):
                while chunk := s.recv(1 << 20):
                    got += chunk
            assert len(got) < 6 * len(body)  # the connection ended before the client took its answers
            assert httpx.post(srv.url + "/predict", json={"text": "a neighbour"}).status_code == 200
            wait_metric(srv.url, "holoserve_http_connections", lambda v: v == 1)  # just this scrape
        finally:
            s.close()
            sender.join(10)


def test_the_next_request_waits_until_the_client_takes_the_last_answer(sst2, monkeypatch):
    """A client that pipelines requests and reads nothing gets one answer built, not a second one held
    (with its body and parsed request) while waiting to be written; once it reads, the rest are served."""
    import socket

    from holoserve.server import connections

    made = connections.GuardedHttpToolsProtocol.connection_made

    def small_send_buffer(self, transport):  # so that the first 0.9 MB answer surely stalls
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        made(self, transport)

    monkeypatch.setattr(connections.GuardedHttpToolsProtocol, "connection_made", small_send_buffer)
    with running(sst2, send_timeout_s=120.0) as srv:
        name = httpx.get(srv.url + "/v1/models").json()["models"][0]["name"]
        body = json.dumps({"id": "r" * 900_000, "inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES",
                                                           "data": ["x"]}]}).encode()
        req = f"POST /v2/models/{name}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        ok = "holoserve_inference_request_success_total"
        before = metric(httpx.get(srv.url + "/metrics").text, ok)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", srv.port))
            sender = threading.Thread(target=_push, args=(s, (req + body) * 4), daemon=True)
            sender.start()
            wait_metric(srv.url, ok, lambda v: v >= before + 1)
            for _ in range(20):  # 2 s: the second request stays unanswered while the first answer waits
                assert metric(httpx.get(srv.url + "/metrics").text, ok) == before + 1
                time.sleep(0.1)
            got = b""
            s.settimeout(30)
            while got.count(b'"model_name"') < 4 or not got.endswith(b"}"):
                chunk = s.recv(1 << 20)
                assert chunk, f"the server closed the connection after {len(got)} bytes"
                got += chunk
            sender.join(10)
        assert got.count(b"HTTP/1.1 200 OK") == 4
        assert metric(httpx.get(srv.url + "/metrics").text, ok) == before + 4


def _push(sock, data: bytes) -> None:
    """Send `data` until the server stops reading or closes (a client that never reads its answers)."""
    with contextlib.suppress(OSError):
        sock.sendall(data)


def test_answers_nobody_reads_are_bounded_together(sst2, monkeypatch):
    """Before their send timeouts, stalled connections together hold at most a budget of buffered
    answers (SEND_BUDGET_BODIES x the body limit): past it the one stalled longest is aborted."""
    import socket

    from holoserve.server import connections

    monkeypatch.setattr(connections, "SEND_BUDGET_BODIES", 2)  # 2 MB with the 1 MB body limit
    with running(sst2, send_timeout_s=120.0) as srv:
        name = httpx.get(srv.url + "/v1/models").json()["models"][0]["name"]
        body = json.dumps({"id": "r" * 900_000, "inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES",
                                                           "data": ["x"]}]}).encode()
        req = f"POST /v2/models/{name}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        socks, senders = [], []
        try:
            for _ in range(6):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(("127.0.0.1", srv.port))
                socks.append(s)
                senders.append(threading.Thread(target=_push, args=(s, (req + body) * 4), daemon=True))
                senders[-1].start()
            wait_metric(srv.url, "holoserve_http_connections_closed_total", lambda v: v >= 1, timeout=60,
                        reason="send_budget")
            assert httpx.post(srv.url + "/predict", json={"text": "a neighbour"}).status_code == 200
            m = httpx.get(srv.url + "/metrics").text
            assert metric(m, "holoserve_http_connections_closed_total", reason="send_timeout") == 0
        finally:
            for s in socks:
                s.close()


def test_a_client_that_reads_slowly_is_not_cut_off(sst2):
    """The send timeout ends connections that take nothing; one that keeps reading, however slowly
    (here ~1 MB/s with a 4 kB receive buffer: the server's writes pause for longer than the timeout while
    the client drains the socket's send queue), gets every answer."""
    import socket

    with running(sst2, send_timeout_s=1.0) as srv:
        name = httpx.get(srv.url + "/v1/models").json()["models"][0]["name"]
        body = json.dumps({"id": "r" * 900_000, "inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES",
                                                           "data": ["x"]}]}).encode()
        req = f"POST /v2/models/{name}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", srv.port))
            sender = threading.Thread(target=lambda: s.sendall((req + body) * 2), daemon=True)
            sender.start()
            got = b""
            s.settimeout(10)
            while got.count(b"HTTP/1.1 200") < 2 or not got.endswith(b"}"):
                time.sleep(0.05)
                chunk = s.recv(64 * 1024)  # at most ~1.3 MB/s
                assert chunk, (f"the server closed the connection after {len(got)} bytes",
                               [x for x in httpx.get(srv.url + "/metrics").text.splitlines() if "closed_total{" in x])
                got += chunk
            sender.join(10)
        assert got.count(b'"id":"' + b"r" * 900_000 + b'"') == 2
        m = httpx.get(srv.url + "/metrics").text
        assert metric(m, "holoserve_http_connections_closed_total", reason="send_timeout") == 0


# --------------------------------------------------------------------------- 6. protocol edges


def test_requests_left_when_the_drain_times_out_get_503_with_retry_after(sst2):
    # A long queue delay keeps the request waiting past the 0.5 s drain.
    with running(sst2, graceful_timeout_s=0.5, max_batch_size=8, max_queue_delay_ms=20000) as srv:
        out: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: out.setdefault(
            "r", httpx.post(srv.url + "/predict", json={"text": "the movie was good"}, timeout=30)))
        t.start()
        wait_metric(srv.url, "holoserve_inference_pending_request_count", lambda v: v >= 1)
        srv.server.should_exit = True
        t.join(30)
    r = out["r"]
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "shutting_down"


def test_the_request_schema_says_exactly_one_input(sst2):
    from holoserve.server.protocol import PredictRequest

    shapes = PredictRequest.model_json_schema()["oneOf"]
    assert [s["required"] for s in shapes] == [["text"], ["texts"], ["pairs"]]
    assert all(s["additionalProperties"] is False and len(s["properties"]) == 1 for s in shapes)
    with running(sst2, max_items=8, max_text_bytes=200) as srv:
        spec = httpx.get(srv.url + "/openapi.json").json()
    req = spec["components"]["schemas"]["PredictRequest"]
    assert [s["required"] for s in req["oneOf"]] == [["text"], ["texts"]]  # a single-text model
    text, texts = (s["properties"][s["required"][0]] for s in req["oneOf"])
    assert text["minLength"] == 1 and text["maxLength"] == 200 and text["pattern"] == r"\S"
    assert texts["minItems"] == 1 and texts["maxItems"] == 8 and texts["items"]["maxLength"] == 200
    assert "200 bytes of UTF-8" in req["description"]


def test_pair_models_document_pairs_only():
    with running(tiny_checkpoint("mrpc")) as srv:
        req = httpx.get(srv.url + "/openapi.json").json()["components"]["schemas"]["PredictRequest"]
        assert [s["required"] for s in req["oneOf"]] == [["pairs"]]
        assert req["examples"][0]["pairs"]
        assert httpx.post(srv.url + "/predict", json=req["examples"][0]).status_code == 200
        # a pair sent where texts go, or a list where one text goes: the error says where they go
        for body, words in (({"texts": [["a man rides", "a man is riding"]]},
                             "texts.0 is a list, not a text; send text pairs as 'pairs': [[a, b], ...]"),
                            ({"text": ["a man rides", "a man is riding"]},
                             "text is a list, not a text; send several texts as 'texts'")):
            r = httpx.post(srv.url + "/predict", json=body)
            assert r.status_code == 422 and words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("content,code,type_,words", [
    (b'\xff\xfe\x00', 400, "invalid_body", "not valid UTF-8"),
    (b'{"text": "caf\xe9"}', 400, "invalid_body", "not valid UTF-8"),  # Latin-1, not UTF-8
    (b'{"text": "unterminated', 422, "invalid_request", "not valid JSON (Unterminated string starting at: character 9"),
    (b'[' * 100_000, 400, "invalid_body", "nested too deeply"),
])
def test_undecodable_bodies_get_a_4xx_that_names_the_problem(guarded, content, code, type_, words):
    r = httpx.post(guarded.url + "/predict", content=content, headers={"content-type": "application/json"})
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert err["type"] == type_ and words in err["message"], err


@pytest.mark.parametrize("token,words", [("", "set but empty"), ("s3cret\n", "whitespace")])
def test_an_unusable_api_token_is_refused_at_start(sst2, token, words):
    r = serve_cli([str(sst2), "--backend", "onnxruntime"], env={"HOLOSERVE_API_TOKEN": token})
    assert r.returncode == 2, r.stderr[-2000:]
    assert words in r.stderr and "HOLOSERVE_API_TOKEN" in r.stderr and "Traceback" not in r.stderr
    assert "s3cret" not in r.stderr  # the token itself is never printed


@pytest.mark.parametrize("token,words", [
    ("   ", "set but empty"),
    (" s3cret", "whitespace"),
    ("s3cr\u00e9t", "printable ASCII"),
    ("two words", "printable ASCII"),
])
def test_api_token_rules(token, words):
    with pytest.raises(HoloServeError, match=words):
        ServerConfig.from_env({"HOLOSERVE_API_TOKEN": token}).validate()
    assert ServerConfig.from_env({}).validate().api_token == ""  # unset: no auth, as documented
    assert ServerConfig.from_env({"HOLOSERVE_API_TOKEN": "tok-1.2_3~+/="}).validate().api_token == "tok-1.2_3~+/="
