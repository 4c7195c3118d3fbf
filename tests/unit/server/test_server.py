"""The HTTP server end to end: uvicorn on a loopback port, httpx as the client, a tiny exported model."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from holoserve.core.artifact import load_artifact
from holoserve.backends.onnxruntime import OrtBackend
from holoserve.server.app import create_app
from holoserve.server.config import ServerConfig
from holoserve.core.tokenizer import TextEncoder, pad_batch
from tests.helpers.serving import (running, metric, REPO, ThreadServer, server_env, serve_subprocess,
                                   tiny_checkpoint, wait_metric, wait_ready)

os.environ.setdefault("OMP_NUM_THREADS", "1")





@pytest.fixture(scope="module")
def server(sst2):
    with running(sst2, max_batch_size=8, max_queue_delay_ms=5, max_items=8, max_text_bytes=200,
                 max_body_bytes=4096, access_log=True) as srv:
        yield srv


def expected(ckpt, texts):
    """Logits for each text alone, straight from the backend (no server, no batching)."""
    art = load_artifact(ckpt)
    enc = TextEncoder(ckpt / "tokenizer.json", art.max_seq_length, pair=art.is_pair)
    be = OrtBackend(art, threads=1)
    out = []
    for e in enc.encode(texts):
        logits = be.infer(*pad_batch([e]))[0]
        p = np.exp(logits - logits.max())
        out.append(p / p.sum())
    return out



# --------------------------------------------------------------------------- endpoints


def test_health_ready_models_metrics(server):
    r = httpx.get(server.url + "/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.get(server.url + "/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    m = httpx.get(server.url + "/v1/models").json()["models"][0]
    assert m["task"]["name"] == "sst2" and m["labels"] == ["negative", "positive"]
    assert m["sparsity"]["pattern"] == "2:4" and m["precision"] == "int8"
    assert m["backend"]["backend"] == "onnxruntime" and m["backend"]["device"] == "cpu"
    assert m["batching"]["max_batch_size"] == 8 and "metrics" in m
    assert m["batching"]["max_padding_waste"] == 0.25  # "auto" on a CPU backend: length groups
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("holoserve_inference_request_duration_seconds_bucket", "holoserve_inference_queue_duration_seconds",
                 "holoserve_inference_compute_infer_duration_seconds", "holoserve_inference_batch_size",
                 "holoserve_inference_compute_input_duration_seconds", "holoserve_http_requests_in_flight",
                 "holoserve_inference_pending_request_count", "holoserve_http_request_duration_seconds",
                 "holoserve_model_ready"):
        assert name in r.text, name
    assert metric(r.text, "holoserve_model_ready") == 1 and metric(r.text, "holoserve_workers_ready") == 1
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/predict", "/healthz", "/readyz", "/v1/models", "/metrics"} <= set(spec["paths"])


def test_predict_single_and_many_in_order(server, sst2):
    texts = ["the movie was good", "an awful boring film", "i loved the actors", "it was fine"]
    exp = expected(sst2, texts)
    r = httpx.post(server.url + "/predict", json={"text": texts[0]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"]["backend"] == "onnxruntime" and body["model"]["name"] == "ckpt-sst2"
    assert set(body["timing_ms"]) == {"tokenize", "queue", "inference", "total"}
    p = body["predictions"][0]
    assert p["scores"]["positive"] == pytest.approx(exp[0][1], abs=1e-5)
    assert p["label"] == ["negative", "positive"][int(np.argmax(exp[0]))]
    assert p["truncated"] is False and p["num_tokens"] == 6
    r = httpx.post(server.url + "/predict", json={"texts": texts})
    preds = r.json()["predictions"]
    assert len(preds) == 4
    for p, e in zip(preds, exp):
        assert p["scores"]["negative"] == pytest.approx(e[0], abs=1e-5)
        assert sum(p["scores"].values()) == pytest.approx(1.0)


def test_truncation_is_reported(server):
    long = " ".join(["a"] * 60)  # 60 tokens > max_seq_length 32
    p = httpx.post(server.url + "/predict", json={"text": long}).json()["predictions"][0]
    assert p["truncated"] is True and p["num_tokens"] == 32


def test_pairs_on_a_pair_model(mrpc):
    pairs = [["the man is riding a horse", "a man rides a horse"], ["a dog", "the company said a new year"]]
    with running(mrpc, max_queue_delay_ms=0) as srv:
        r = httpx.post(srv.url + "/predict", json={"pairs": pairs})
        assert r.status_code == 200, r.text
        exp = expected(mrpc, [tuple(p) for p in pairs])
        for p, e in zip(r.json()["predictions"], exp):
            assert p["scores"]["equivalent"] == pytest.approx(e[1], abs=1e-5)
        r = httpx.post(srv.url + "/predict", json={"text": "a single text"})
        assert r.status_code == 400 and "pairs" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- bad input -> 4xx JSON


BAD = [
    ({"text": ""}, 422, "empty_text"),
    ({"text": "   \n\t"}, 422, "empty_text"),
    ({"texts": ["fine", ""]}, 422, "empty_text"),
    ({"text": "a" * 201}, 422, "text_too_long"),
    ({"text": "é" * 101}, 422, "text_too_long"),  # 202 bytes of UTF-8, 101 characters
    ({"texts": ["x"] * 9}, 422, "too_many_items"),
    ({"texts": []}, 422, "invalid_request"),
    ({}, 422, "invalid_request"),
    ({"text": "a", "texts": ["b"]}, 422, "invalid_request"),
    ({"text": 5}, 422, "invalid_request"),
    ({"text": None}, 422, "invalid_request"),
    ({"texts": "not a list"}, 422, "invalid_request"),
    ({"texts": [1, 2]}, 422, "invalid_request"),
    ({"texts": [["nested"]]}, 422, "invalid_request"),
    ({"text": "ok", "extra": 1}, 422, "invalid_request"),
    ({"pairs": [["a", "b", "c"]]}, 422, "invalid_request"),
    ({"pairs": [["a", "b"]]}, 400, "wrong_input_kind"),
    ([1, 2, 3], 422, "invalid_request"),
    ("just a string", 422, "invalid_request"),
]


@pytest.mark.parametrize("payload,code,type_", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_a_4xx_json_error(server, payload, code, type_):
    r = httpx.post(server.url + "/predict", json=payload)
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == type_ and err["message"]
    assert r.json()["request_id"] == r.headers["x-request-id"]


def test_request_rules_need_only_the_protocol_and_run_in_order():
    """The body rules live on the request model: no server needed, and one request always gets the
    same error (the input kind first, then the item count, then each text in turn)."""
    from pydantic import ValidationError

    from holoserve.server.protocol import ApiError, InputLimits, PredictRequest

    single = InputLimits(max_items=2, max_text_bytes=5, pair=False, model="m", task="sst2")

    def refused(body, limits=single):
        with pytest.raises(ApiError) as e:
            PredictRequest.model_validate(body).inputs(limits)
        return e.value.code, e.value.type

    assert refused({"pairs": []}) == (400, "wrong_input_kind")
    assert refused({"text": "ok"}, InputLimits(2, 5, pair=True, model="m", task="mrpc")) == (400, "wrong_input_kind")
    assert refused({"texts": ["a", "b", "c"]}) == (422, "too_many_items")
    assert refused({"texts": ["far too long", ""]}) == (422, "text_too_long")
    assert refused({"texts": ["", "far too long"]}) == (422, "empty_text")
    assert PredictRequest(texts=["ab", "é"]).inputs(single) == (["ab", "é"], 4)
    with pytest.raises(ValidationError, match="send exactly one of 'text', 'texts' or 'pairs' \\(got text, texts\\)"):
        PredictRequest.model_validate({"text": "a", "texts": ["b"]})


@pytest.mark.parametrize("content,headers,code", [
    (b'{"text": "unterminated', {"content-type": "application/json"}, 422),
    (b'{"text": "\\ud800"}', {"content-type": "application/json"}, 422),  # lone surrogate
    (b'\xff\xfe\x00', {"content-type": "application/json"}, 400),  # not decodable at all
    (b'text=hello', {"content-type": "application/x-www-form-urlencoded"}, 422),
    (b'', {"content-type": "application/json"}, 422),
    (b'{"text": "' + b"a" * 5000 + b'"}', {"content-type": "application/json"}, 413),
])
def test_malformed_bodies(server, content, headers, code):
    r = httpx.post(server.url + "/predict", content=content, headers=headers)
    assert r.status_code == code, r.text
    assert r.json()["error"]["code"] == code


def test_body_too_large_without_content_length(server):
    def chunks():  # chunked transfer encoding: the limit is enforced while reading
        for _ in range(10):
            yield b"x" * 1000

    r = httpx.post(server.url + "/predict", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "body_too_large"


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    r = httpx.get(server.url + "/predict")
    assert r.status_code == 405 and r.json()["error"]["type"] == "method_not_allowed"


def test_request_id_is_echoed_and_logged(server, caplog):
    with caplog.at_level(logging.INFO, logger="holoserve.access"):
        logger = logging.getLogger("holoserve.access")
        logger.addHandler(caplog.handler)
        try:
            r = httpx.post(server.url + "/predict", json={"text": "good"}, headers={"x-request-id": "abc-123"})
            time.sleep(0.05)
        finally:
            logger.removeHandler(caplog.handler)
    assert r.headers["x-request-id"] == "abc-123" and r.json()["request_id"] == "abc-123"
    recs = [rec for rec in caplog.records if getattr(rec, "request_id", None) == "abc-123"]
    assert recs and recs[0].status == 200 and recs[0].path == "/predict" and recs[0].duration_ms > 0
    # A hostile id is replaced, not echoed.
    r = httpx.get(server.url + "/healthz", headers={"x-request-id": "bad id\twith spaces"})
    assert re.fullmatch(r"[0-9a-f]{20}", r.headers["x-request-id"])


# --------------------------------------------------------------------------- batching, overload, auth


def _post_concurrently(url: str, payloads: list[dict], timeout: float = 30.0) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(c.post(url + "/predict", json=p) for p in payloads))

    return asyncio.run(go())


def test_batching_merges_concurrent_requests_and_routes_results(sst2):
    texts = ["good", "the movie was bad", "i hated the boring plot", "a great film with great actors and fun",
             "dull", "she loved it", "the worst story", "it was very very funny"]
    exp = expected(sst2, texts)
    with running(sst2, max_batch_size=8, max_queue_delay_ms=300) as srv:
        before = httpx.get(srv.url + "/metrics").text
        resps = _post_concurrently(srv.url, [{"text": t} for t in texts])
        after = httpx.get(srv.url + "/metrics").text
    assert all(r.status_code == 200 for r in resps), [r.text for r in resps]
    for r, e in zip(resps, exp):  # every caller gets the answer for its own text
        assert r.json()["predictions"][0]["scores"]["negative"] == pytest.approx(e[0], abs=1e-4)
    execs = (metric(after, "holoserve_inference_batch_size_count")
             - metric(before, "holoserve_inference_batch_size_count"))
    seqs = metric(after, "holoserve_inference_batch_size_sum") - metric(before, "holoserve_inference_batch_size_sum")
    singles = (metric(after, "holoserve_inference_batch_size_bucket", le="1.0")
               - metric(before, "holoserve_inference_batch_size_bucket", le="1.0"))
    assert seqs == 8
    assert execs < 8 and singles < execs, (execs, singles)  # at least one batch held several requests
    assert max(r.json()["timing_ms"]["queue"] for r in resps) > 0


def test_full_queue_answers_503_with_retry_after(sst2):
    with running(sst2, max_batch_size=8, max_queue_delay_ms=1500, max_queue_size=4, max_items=4) as srv:
        results: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: results.setdefault(
            "a", httpx.post(srv.url + "/predict", json={"texts": ["good", "bad", "fine", "dull"]}, timeout=30)))
        t.start()
        wait_metric(srv.url, "holoserve_inference_pending_request_count", lambda v: v >= 4)  # the first one is queued
        r = httpx.post(srv.url + "/predict", json={"text": "one more"})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "overloaded"
        t.join(30)
        assert results["a"].status_code == 200 and len(results["a"].json()["predictions"]) == 4
        m = httpx.get(srv.url + "/metrics").text
        assert metric(m, "holoserve_inference_request_failure_total", reason="overloaded") == 1


def test_bearer_token_auth(sst2):
    cfg = ServerConfig(artifact_dir=str(sst2), threads=1, api_token="s3cret-token")
    with ThreadServer(create_app(cfg)) as srv:
        assert httpx.get(srv.url + "/healthz").status_code == 200
        assert httpx.get(srv.url + "/readyz").status_code == 200
        r = httpx.post(srv.url + "/predict", json={"text": "good"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "unauthorized"
        r = httpx.post(srv.url + "/predict", json={"text": "good"}, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = httpx.post(srv.url + "/predict", json={"text": "good"}, headers={"authorization": "Basic s3cret-token"})
        assert r.status_code == 401
        ok = {"authorization": "Bearer s3cret-token"}
        assert httpx.post(srv.url + "/predict", json={"text": "good"}, headers=ok).status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers=ok).status_code == 200


# --------------------------------------------------------------------------- the CLI process


def test_cli_serves_and_drains_in_flight_requests_on_sigterm(sst2):
    # A long queue delay keeps the request in flight when SIGTERM arrives.
    args = [str(sst2), "--max-batch-size", "8", "--max-queue-delay-ms", "1500", "--access-log"]
    with serve_subprocess(args, env={"HOLOSERVE_BACKEND": "onnxruntime"}) as (url, proc):
        out: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: out.setdefault(
            "r", httpx.post(url + "/predict", json={"text": "the movie was good"}, timeout=30)))
        t.start()
        wait_metric(url, "holoserve_inference_pending_request_count", lambda v: v >= 1)  # the request is queued
        t_sig = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        rc = proc.wait(30)
        assert out["r"].status_code == 200, out["r"].text
        assert out["r"].json()["timing_ms"]["queue"] > 1000
        # a drained SIGTERM is a clean exit: status 0, as with --workers N
        assert rc == 0 and time.monotonic() - t_sig < 20
        logs = [json.loads(line) for line in proc.stderr.read().decode().splitlines() if line.startswith("{")]
        assert any(rec.get("msg") == "stopped" for rec in logs)
        access = [rec for rec in logs if rec["logger"] == "holoserve.access" and rec["path"] == "/predict"]
        assert access and access[0]["status"] == 200 and access[0]["request_id"]


def test_cli_flags_and_env(sst2, monkeypatch):
    from holoserve.cli import build_parser
    from holoserve.serve_cli import config_from_args

    monkeypatch.setenv("HOLOSERVE_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("HOLOSERVE_MAX_QUEUE_DELAY_MS", "7.5")
    monkeypatch.setenv("HOLOSERVE_WARMUP", "false")
    monkeypatch.setenv("HOLOSERVE_API_TOKEN", "tok")
    args = build_parser().parse_args(["serve", str(sst2), "--max-batch-size", "16", "--port", "9001"])
    cfg = config_from_args(args)
    assert (cfg.max_batch_size, cfg.max_queue_delay_ms, cfg.port, cfg.warmup) == (16, 7.5, 9001, False)
    assert cfg.host == "127.0.0.1" and cfg.api_token == "tok" and cfg.backend == "auto"
    monkeypatch.setenv("HOLOSERVE_MODEL_DIR", str(sst2))
    assert config_from_args(build_parser().parse_args(["serve"])).artifact_dir == str(sst2)
    monkeypatch.setenv("HOLOSERVE_PORT", "not-a-port")
    from holoserve import HoloServeError

    with pytest.raises(HoloServeError, match="HOLOSERVE_PORT"):
        config_from_args(build_parser().parse_args(["serve"]))


def test_cli_clear_error_without_an_export():
    ckpt = tiny_checkpoint("sst2", onnx=False)
    r = subprocess.run([sys.executable, "-m", "holoserve", "serve", str(ckpt), "--backend", "onnxruntime"],
                       env=server_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "holoserve export" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "holoserve", "serve", str(ckpt)],  # auto: nothing usable
                       env=server_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no backend can serve" in r.stderr


def test_multiple_workers(sst2):
    with serve_subprocess([str(sst2), "--workers", "2", "--backend", "onnxruntime"], timeout=90) as (url, proc):
        rs = [httpx.post(url + "/predict", json={"text": "good"}) for _ in range(4)]
        assert all(r.status_code == 200 for r in rs)


# --------------------------------------------------------------------------- no torch at serving time


NO_TORCH = r"""
import importlib.abc, sys
BLOCK = ("torch", "transformers", "compress", "export")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
from holoserve.cli import build_parser
build_parser()  # every stage's argument module is imported; missing extras must not break `serve`
from holoserve.server.app import create_app
from holoserve.server.config import ServerConfig
from starlette.testclient import TestClient
app = create_app(ServerConfig(artifact_dir=sys.argv[1], threads=1))
with TestClient(app) as c:
    import time
    for _ in range(100):
        if c.get("/readyz").status_code == 200:
            break
        time.sleep(0.05)
    r = c.post("/predict", json={"texts": ["good", "bad"]})
    assert r.status_code == 200, r.text
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCK)
print("LOADED", loaded)
"""


def test_server_runs_without_torch(sst2):
    r = subprocess.run([sys.executable, "-c", NO_TORCH, str(sst2)], env=server_env(), cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LOADED []" in r.stdout


# --------------------------------------------------------------------------- OpenAPI fuzzing


def test_openapi_fuzz_has_no_server_errors(server, tmp_path):
    """Fuzz every operation: no 5xx, every answer with a documented status code matches its declared
    response schema (errors included), every body the schema calls valid is served, and every body it
    calls invalid is refused (so the schema says 'exactly one of text, texts or pairs')."""
    exe = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    if not os.path.exists(exe):
        pytest.skip("schemathesis is not installed (pip install 'holoserve[dev]')")
    r = subprocess.run(
        [exe, "run", server.url + "/openapi.json", "--checks",
         "not_a_server_error,response_schema_conformance,positive_data_acceptance,negative_data_rejection",
         "--max-examples", "40",
         "--seed", "1", "--request-timeout", "10", "--no-shrink", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=150, env={**os.environ, "NO_COLOR": "1"}, cwd=tmp_path)
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert "No issues found" in r.stdout
    wait_ready(server.url)  # the server survived the fuzzing


def test_split_by_length_bounds_padding():
    from holoserve.core.tokenizer import split_by_length

    lengths = [5, 30, 6, 31, 55, 7, 29, 5]
    groups = split_by_length(lengths, 0.25)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        real = sum(lengths[i] for i in g)
        assert len(g) * max(lengths[i] for i in g) <= 1.25 * real or len(g) == 1
    assert split_by_length(lengths, -1) == [list(range(len(lengths)))]  # plain pad-to-longest
    assert split_by_length([9] * 4, 0.0) == [[0, 1, 2, 3]]


def test_a_client_that_leaves_does_not_disturb_the_others(sst2):
    with running(sst2, max_batch_size=8, max_queue_delay_ms=600) as srv:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/predict", json={"texts": ["good", "bad"]}, timeout=0.15)
        r = httpx.post(srv.url + "/predict", json={"text": "the movie was good"}, timeout=30)
        assert r.status_code == 200 and len(r.json()["predictions"]) == 1
        wait_metric(srv.url, "holoserve_inference_pending_request_count", lambda v: v == 0)
        assert httpx.get(srv.url + "/healthz").status_code == 200


def test_regression_pair_task_answers_a_score():
    stsb = tiny_checkpoint("stsb")
    with running(stsb, max_queue_delay_ms=0) as srv:
        r = httpx.post(srv.url + "/predict", json={"pairs": [["a man rides a horse", "the man is riding a horse"]]})
        assert r.status_code == 200, r.text
        p = r.json()["predictions"][0]
        assert p["label"] == "score" and p["scores"] == {"score": p["score"]}
        exp = load_artifact(stsb)
        assert exp.labels == [] and httpx.get(srv.url + "/v1/models").json()["models"][0]["labels"] == []


def test_cli_unreadable_checkpoint_is_a_clear_error(sst2, monkeypatch):
    import holoserve.core.artifact
    from holoserve import HoloServeError
    from holoserve.cli import build_parser
    from holoserve.serve_cli import run

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", str(sst2 / "manifest.json"))

    monkeypatch.setattr(holoserve.core.artifact, "load_artifact", denied)
    with pytest.raises(HoloServeError, match="readable by"):
        run(build_parser().parse_args(["serve", str(sst2), "--port", "0"]))


def _seq(i: int):
    """A 3-token sequence whose first id tags it: _tag_logits answers [i, -i] for it."""
    from holoserve.core.tokenizer import Encoded

    return Encoded(np.array([i, 7, 8], dtype=np.int64), np.zeros(3, dtype=np.int64), False)


def _tag_logits(ids: np.ndarray) -> np.ndarray:
    return np.stack([ids[:, 0].astype(np.float32), -ids[:, 0].astype(np.float32)], axis=1)


def test_zero_queue_delay_dispatches_at_once_and_still_batches_under_load():
    """--max-queue-delay-ms 0: a lone request runs immediately; requests that arrive while an
    inference runs are merged into the next batch."""
    from holoserve.server.batcher import BatchPolicy, DynamicBatcher

    sizes: list[int] = []
    gate = threading.Event()

    def infer(ids, mask, types):
        sizes.append(ids.shape[0])
        if len(sizes) == 1:
            gate.wait(5)  # the first inference is slow: the others queue up behind it
        return _tag_logits(ids)

    async def main():
        b = DynamicBatcher(infer, BatchPolicy(max_batch_size=8, max_queue_delay_ms=0, max_queue_size=64))
        b.start()
        first = asyncio.ensure_future(b.submit([_seq(100)]))
        while not sizes:
            await asyncio.sleep(0.001)
        rest = [asyncio.ensure_future(b.submit([_seq(200 + i)])) for i in range(5)]
        await asyncio.sleep(0.05)
        gate.set()
        results = [await first] + [await r for r in rest]
        await b.stop(5)
        return results

    results = asyncio.run(main())
    assert sizes == [1, 5]
    assert [float(r[0].logits[0]) for r in results] == [100.0] + [200.0 + i for i in range(5)]


def test_inline_single_runs_a_lone_sequence_on_the_loop_and_batches_in_the_worker():
    """inline_single: a lone sequence with nothing queued runs on the event-loop thread (no hand-off);
    a merged batch still runs in the inference thread; without the option everything does."""
    from holoserve.server.batcher import BatchPolicy, DynamicBatcher

    async def main(inline: bool):
        loop_thread = threading.current_thread()
        seen: list[tuple[int, bool]] = []

        def infer(ids, mask, types):
            seen.append((ids.shape[0], threading.current_thread() is loop_thread))
            return _tag_logits(ids)

        b = DynamicBatcher(infer, BatchPolicy(max_batch_size=8, max_queue_delay_ms=0, max_queue_size=64,
                                              inline_single=inline))
        b.start()
        one = await b.submit([_seq(5)])
        two = await b.submit([_seq(6), _seq(9)])
        await b.stop(5)
        assert [float(r.logits[0]) for r in one + two] == [5.0, 6.0, 9.0]
        return seen

    assert asyncio.run(main(True)) == [(1, True), (2, False)]
    assert asyncio.run(main(False)) == [(1, False), (2, False)]
