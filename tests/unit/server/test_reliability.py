"""Memory and work bounded before anything is done for a request, on a real server: bodies a route does not
take are never read, bodies in progress are bounded all together, long texts cost what their kept tokens
cost and are tokenized off the event loop, pipelined heads are measured one by one, a shutdown answers what
is on its way and exits 0, and a connection closed once is counted once."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.helpers.serving import RawHTTP, metric, running, serve_subprocess, wait_metric

os.environ.setdefault("OMP_NUM_THREADS", "1")
TOKEN = "s3cret-token"


def _head(method: str, path: str, length: int, extra: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


@pytest.fixture(scope="module")
def protected(sst2, tmp_path_factory):
    os.environ["HOLOSERVE_API_TOKEN"] = TOKEN
    try:
        with running(sst2, api_token=TOKEN, max_body_bytes=100_000, max_buffered_body_bytes=250_000) as srv:
            yield srv
    finally:
        os.environ.pop("HOLOSERVE_API_TOKEN", None)


def _buffered(srv) -> int:
    """Body bytes the edge middleware holds now (the app's middleware stack, built at its first request)."""
    layer = srv.app.middleware_stack
    while layer is not None and not hasattr(layer, "buffered"):
        layer = getattr(layer, "app", None)
    return layer.buffered


def test_a_route_that_takes_no_body_answers_without_reading_it(protected):
    """POST /healthz (GET only, public) declaring 1 MB: answered at once, the connection closed, nothing held."""
    with RawHTTP(protected.url) as conn:
        conn.send(_head("POST", "/healthz", 1_000_000) + b"x" * 20_000)
        status, headers, _ = conn.response()
        assert status == 405 and headers.get("connection") == "close"
        assert conn.closed_within(2)
    assert _buffered(protected) == 0


def test_a_protected_route_refuses_bad_credentials_before_the_body(protected):
    with RawHTTP(protected.url) as conn:
        conn.send(_head("POST", "/predict", 90_000))  # head only: the answer cannot wait for the body
        status, headers, body = conn.response()
        assert status == 401 and json.loads(body)["error"]["type"] == "unauthorized"
        assert headers.get("connection") == "close" and conn.closed_within(2)


def test_bodies_in_progress_are_bounded_all_together(protected):
    """Three clients each send 90 KB of a 95 KB body and hold: the third passes the 250 KB budget and gets 503 at
    once; when the first two give up, the budget is free again."""
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    conns = [RawHTTP(protected.url) for _ in range(3)]
    try:
        for c in conns[:2]:
            c.send(_head("POST", "/predict", 95_000, auth) + b" " * 90_000)
        deadline = time.monotonic() + 5
        while _buffered(protected) < 180_000 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _buffered(protected) == 180_000
        conns[2].send(_head("POST", "/predict", 95_000, auth) + b" " * 90_000)
        status, headers, body = conns[2].response()
        assert status == 503 and json.loads(body)["error"]["type"] == "overloaded"
        assert headers.get("retry-after") == "1" and headers.get("connection") == "close"
    finally:
        for c in conns:
            c.close()
    deadline = time.monotonic() + 5
    while _buffered(protected) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _buffered(protected) == 0
    r = httpx.post(protected.url + "/predict", json={"text": "fine"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200


def test_pipelined_heads_are_measured_one_by_one(sst2):
    """120 small pipelined requests and the first 40 bytes of a 121st in one write, against a 4 KB head limit:
    all 121 are answered (the read is not counted as one head)."""
    with running(sst2, max_header_bytes=4096) as srv:
        req = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
        last = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"p" * 20 + b"\r\n\r\n"
        with RawHTTP(srv.url) as conn:
            conn.send(req * 120 + last[:40])
            assert [conn.response()[0] for _ in range(120)] == [200] * 120
            conn.send(last[40:])
            assert conn.response()[0] == 200
        m = httpx.get(srv.url + "/metrics").text
        assert metric(m, "holoserve_http_connections_closed_total", reason="header_too_large") == 0


def test_long_texts_do_not_stall_the_neighbours(sst2):
    """64 texts of 10 KB per request from four clients at once, while a neighbour sends short texts: every
    request is answered, the long ones truncated, and the texts are tokenized off the event loop."""
    with running(sst2, max_items=64, max_text_bytes=10_000, max_body_bytes=1_000_000, max_queue_size=1024) as srv:
        long_texts = [("word " * 2000)[:10_000]] * 64
        results: list[int] = []

        def long_client():
            r = httpx.post(srv.url + "/predict", json={"texts": long_texts}, timeout=60)
            results.append(r.status_code)
            assert all(p["truncated"] for p in r.json()["predictions"])

        threads = [threading.Thread(target=long_client) for _ in range(4)]
        for t in threads:
            t.start()
        short = [httpx.post(srv.url + "/predict", json={"text": "a short one"}, timeout=60).status_code
                 for _ in range(20)]
        for t in threads:
            t.join(60)
        assert results == [200] * 4 and short == [200] * 20
        tokenizer = srv.app.state.service.tokenizer
        assert tokenizer.pending == 0


def test_a_full_tokenizer_queue_answers_503(sst2, monkeypatch):
    with running(sst2, max_items=8, max_queue_size=8) as srv:
        tokenizer = srv.app.state.service.tokenizer
        gate = threading.Event()
        encode = tokenizer._encode
        monkeypatch.setattr(tokenizer, "_encode", lambda items: (gate.wait(10), encode(items))[1])
        texts = ["word " * 300] * 8  # over the inline size: handed to the worker, which waits at the gate
        out: list[httpx.Response] = []
        first = threading.Thread(target=lambda: out.append(httpx.post(srv.url + "/predict", json={"texts": texts},
                                                                      timeout=30)))
        first.start()
        deadline = time.monotonic() + 5
        while tokenizer.pending < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = httpx.post(srv.url + "/predict", json={"texts": texts[:2]}, timeout=30)
        gate.set()
        first.join(30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded" and r.headers["retry-after"] == "1"
        assert out[0].status_code == 200


def test_shutdown_answers_what_is_on_its_way_and_exits_0(sst2):
    """SIGTERM while a request body is still arriving and while a connection is idle: the body completed after
    the signal is answered, a request sent on the idle connection right after it too (with Connection: close),
    and the process exits with status 0."""
    body = json.dumps({"text": "the movie was good"}).encode()
    with serve_subprocess([str(sst2)], env={"HOLOSERVE_BACKEND": "onnxruntime"}) as (url, proc):
        with RawHTTP(url) as arriving, RawHTTP(url) as idle:
            arriving.send(_head("POST", "/predict", len(body)) + body[:5])
            assert idle.sock.send(b"") == 0
            time.sleep(0.2)  # both connections accepted
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            idle.send(_head("POST", "/predict", len(body)) + body)
            time.sleep(0.2)
            arriving.send(body[5:])
            for conn in (arriving, idle):
                status, headers, payload = conn.response()
                assert status == 200, payload
                assert headers.get("connection") == "close"
                assert json.loads(payload)["predictions"][0]["label"]
        assert proc.wait(30) == 0


def test_a_connection_closed_once_is_counted_once(sst2):
    """A client that pipelines requests whose large answers it never reads, then stalls inside a body: the body
    timeout closes the connection and the send timeout later aborts it; one closure, one count."""
    with running(sst2, send_timeout_s=1.0, body_timeout_s=0.5) as srv:
        name = httpx.get(srv.url + "/v1/models").json()["models"][0]["name"]
        payload = json.dumps({"id": "r" * 400_000, "inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES",
                                                              "data": ["x"]}]}).encode()
        req = _head("POST", f"/v2/models/{name}/infer", len(payload)) + payload
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        try:
            s.sendall(req * 3 + _head("POST", "/predict", 100) + b'{"text": ')
            wait_metric(srv.url, "holoserve_http_connections_closed_total", lambda v: v >= 1, timeout=30)
            time.sleep(2.5)  # past the send timeout too
            m = httpx.get(srv.url + "/metrics").text
            assert metric(m, "holoserve_http_connections_closed_total") == 1, \
                [x for x in m.splitlines() if "closed_total{" in x]
            wait_metric(srv.url, "holoserve_http_connections", lambda v: v == 1)  # just this scrape
        finally:
            s.close()


def test_the_predict_fast_path_answers_as_the_route_does(sst2):
    """A JSON body the request model accepts is answered without FastAPI's routing (fastpath.py); the same
    request sent as another JSON media type goes through the route: both answers agree byte for byte but for
    the timings and request ids, and so do their errors."""
    with running(sst2, max_items=4) as srv:
        def both(payload: dict) -> list[httpx.Response]:
            body = json.dumps(payload).encode()
            return [httpx.post(srv.url + "/predict", content=body, headers={"content-type": ctype,
                                                                             "x-request-id": "same-id"})
                    for ctype in ("application/json", "application/vnd.holoserve+json")]

        for payload in ({"text": "a charming film é ☃"}, {"texts": ["good", "bad", "fine"]}):
            fast, routed = both(payload)
            assert fast.status_code == routed.status_code == 200
            a, b = fast.json(), routed.json()
            a.pop("timing_ms"), b.pop("timing_ms")
            assert a == b and fast.headers["content-type"] == routed.headers["content-type"]
        for payload in ({"texts": ["x"] * 5}, {"pairs": [["a", "b"]]}, {"texts": []}):
            fast, routed = both(payload)
            assert (fast.status_code, fast.content) == (routed.status_code, routed.content), payload
        bad = httpx.post(srv.url + "/predict", content=b'{"text": 3}', headers={"content-type": "application/json"})
        assert bad.status_code == 422 and bad.json()["error"]["type"] == "invalid_request"
