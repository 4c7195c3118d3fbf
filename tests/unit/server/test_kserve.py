"""The Open Inference Protocol (KServe v2) routes, driven by the real tritonclient HTTP client against uvicorn."""
from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest

from tests.helpers.serving import metric, running, tiny_checkpoint

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")

TEXTS = ["a gripping, funny film", "a dull mess", "loved it", "the plot never finds its footing at all"]




@pytest.fixture(scope="module")
def server(sst2):
    with running(sst2, max_batch_size=8, max_queue_delay_ms=2, max_items=8, max_text_bytes=200,
                 max_body_bytes=8192) as srv:
        yield srv


def client(srv, **kw):
    return httpclient.InferenceServerClient(url=srv.url.removeprefix("http://"), **kw)


def model_name(srv) -> str:
    return httpx.get(srv.url + "/v1/models").json()["models"][0]["name"]


def text_input(name: str, texts: list[str], binary: bool, column: bool = True):
    arr = np.array([t.encode() for t in texts], dtype=object)
    arr = arr.reshape(-1, 1) if column else arr
    inp = httpclient.InferInput(name, list(arr.shape), "BYTES")
    inp.set_data_from_numpy(arr, binary_data=binary)
    return inp


def strs(arr) -> list[str]:
    """BYTES output as str (tritonclient gives bytes for binary data, str for JSON)."""
    return [x.decode() if isinstance(x, bytes) else x for x in arr.reshape(-1)]


def predict_scores(srv, body: dict) -> list[dict]:
    r = httpx.post(srv.url + "/predict", json=body)
    assert r.status_code == 200, r.text
    return r.json()["predictions"]


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_health_and_metadata(server):
    c = client(server)
    name = model_name(server)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(name)
    meta = c.get_server_metadata()
    assert meta["name"] == "holoserve" and "binary_tensor_data" in meta["extensions"]
    mm = c.get_model_metadata(name)
    assert mm["name"] == name and len(mm["versions"]) == 1 and mm["platform"].startswith("holoserve_")
    assert [i["name"] for i in mm["inputs"]] == ["TEXT"] and mm["inputs"][0]["datatype"] == "BYTES"
    outs = {o["name"]: o for o in mm["outputs"]}
    assert outs["LOGITS"]["datatype"] == "FP32" and outs["LOGITS"]["shape"] == [-1, 2]
    assert outs["LABEL"]["datatype"] == "BYTES"
    assert c.get_model_metadata(name, model_version=mm["versions"][0])["name"] == name
    assert not c.is_model_ready("no-such-model")
    with pytest.raises(InferenceServerException, match="unknown model 'no-such-model'"):
        c.get_model_metadata("no-such-model")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_matches_predict(server, binary):
    c = client(server)
    name = model_name(server)
    outputs = [httpclient.InferRequestedOutput("LOGITS", binary_data=binary),
               httpclient.InferRequestedOutput("LABEL", binary_data=binary)]
    res = c.infer(name, [text_input("TEXT", TEXTS, binary)], outputs=outputs, request_id="req-1")
    logits = res.as_numpy("LOGITS")
    labels = strs(res.as_numpy("LABEL"))
    assert logits.dtype == np.float32 and logits.shape == (len(TEXTS), 2)
    assert res.as_numpy("LABEL").shape == (len(TEXTS), 1)  # follows TEXT's [n, 1]
    assert res.get_response()["id"] == "req-1"
    preds = predict_scores(server, {"texts": TEXTS})
    probs = softmax(logits.astype(np.float64))
    for p, row, lab in zip(preds, probs, labels):
        assert lab == p["label"]
        assert np.allclose(row, [p["scores"]["negative"], p["scores"]["positive"]], atol=1e-5)


def test_infer_defaults_and_rank1(server):
    """No outputs named: both come back (tritonclient then asks for binary); TEXT as [n] gives LABEL [n]."""
    c = client(server)
    res = c.infer(model_name(server), [text_input("TEXT", TEXTS[:2], True, column=False)])
    assert res.as_numpy("LOGITS").shape == (2, 2)
    assert res.as_numpy("LABEL").shape == (2,)


def test_plain_json_request(server):
    """What curl sends: JSON in, JSON out, nested data accepted, optional parameters ignored."""
    name = model_name(server)
    body = {"id": "x", "parameters": {"priority": 1},
            "inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES", "data": [["loved it"], ["a dull mess"]]}]}
    r = httpx.post(f"{server.url}/v2/models/{name}/infer", json=body)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert r.json()["model_name"] == name and r.json()["id"] == "x"
    assert out["LOGITS"]["shape"] == [2, 2] and len(out["LOGITS"]["data"]) == 4
    assert out["LABEL"]["shape"] == [2, 1] and all(x in ("negative", "positive") for x in out["LABEL"]["data"])


def _post(srv, body, name=None, path="infer"):
    name = name or model_name(srv)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{srv.url}/v2/models/{name}/{path}", content=data)


@pytest.mark.parametrize("body,code,needle", [
    (b"{not json", 400, "not valid JSON"),
    ({"inputs": []}, 400, "'inputs' must be a non-empty list"),
    ({"inputs": [{"name": "WORDS", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}, 400,
     "unexpected input 'WORDS'"),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, 400, "takes BYTES"),
    ({"inputs": [{"name": "TEXT", "shape": [2], "datatype": "BYTES", "data": ["x"]}]}, 400, "but 1 elements"),
    ({"inputs": [{"name": "TEXT", "shape": [1, 2], "datatype": "BYTES", "data": ["x", "y"]}]}, 400,
     "send [n] or [n, 1]"),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["   "]}]}, 400, "TEXT[0] is empty"),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [7]}]}, 400, "not a string"),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": "x"}]}, 400, "must be a list of strings"),
    ({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [[["x"]]]}]}, 400, "rows of one"),
    ({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": json.loads("[" * 200 + "]" * 200)}]},
     400, "rows of one"),
    # Nesting must agree with the shape: [2] with one row of two is not two texts.
    ({"inputs": [{"name": "TEXT", "shape": [2], "datatype": "BYTES", "data": [["a", "b"]]}]}, 400,
     "has shape [2] (one dimension) but nested 'data'"),
    ({"inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES", "data": [["a", "b"]]}]}, 400,
     "row 0 of 'data' is not a list of 1 string"),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [[["x"]]]}]}, 400, "nested 'data'"),
    # Each output once; boolean parameters are JSON booleans; the id is a string; no NaN in the JSON.
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
      "outputs": [{"name": "LOGITS"}, {"name": "LABEL"}, {"name": "LOGITS"}]}, 400,
     "output 'LOGITS' is asked for more than once"),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
      "outputs": [{"name": "LOGITS", "parameters": {"binary_data": "no"}}]}, 400,
     "output 'LOGITS': parameter 'binary_data' is \"no\"; it takes true or false"),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
      "parameters": {"binary_data_output": "false"}}, 400, "parameter 'binary_data_output' is \"false\""),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}], "id": 7}, 400,
     "'id' is int; send a string"),
    (b'{"id": NaN, "inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}', 400,
     "NaN is not a JSON value"),
    (b'{"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}], '
     b'"parameters": {"p": -Infinity}}',
     400, "-Infinity is not a JSON value"),
    # The echoed id counts in the response's size: 3,000 non-ASCII characters are 18,000 bytes of JSON.
    (json.dumps({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}], "id": "\u00e9" * 3000},
                ensure_ascii=False).encode(), 400,
     "the server's limit is 8192 bytes (--max-body-bytes)"),
    (b'{"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ' + b"[" * 100_000 + b"]" * 100_000
     + b"}]}", 413, "the limit is 8192 bytes"),
    (b'{"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ' + b"[" * 4000 + b"]" * 4000
     + b"}]}", 400, "nested too deeply"),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x" * 201]}]}, 400, "limit is 200 bytes"),
    ({"inputs": [{"name": "TEXT", "shape": [9], "datatype": "BYTES", "data": ["x"] * 9}]}, 400, "the limit is 8"),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
      "outputs": [{"name": "PROBS"}]}, 400, "unknown output 'PROBS'"),
    ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
      "outputs": [{"name": "LOGITS", "parameters": {"classification": 1}}]}, 400, "'classification' is not supported"),
])
def test_errors(server, body, code, needle):
    r = _post(server, body)
    assert r.status_code == code, r.text
    assert set(r.json()) == {"error"} and needle in r.json()["error"], r.json()


def test_unknown_model_and_version(server):
    body = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    r = _post(server, body, name="other")
    assert r.status_code == 404 and "unknown model 'other'" in r.json()["error"]
    r = httpx.post(f"{server.url}/v2/models/{model_name(server)}/versions/0/infer", json=body)
    assert r.status_code == 404 and "no version '0'" in r.json()["error"]
    assert httpx.get(f"{server.url}/v2/models/other/ready").status_code == 404


def test_body_limit_and_metrics_shared(server):
    name = model_name(server)
    big = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x" * 9000]}]}
    r = _post(server, big)
    assert r.status_code == 413 and "the limit is 8192 bytes" in r.json()["error"]
    before = httpx.get(server.url + "/metrics").text
    client(server).infer(name, [text_input("TEXT", TEXTS[:3], True)])
    after = httpx.get(server.url + "/metrics").text

    def value(text, prefix):
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    assert (value(after, "holoserve_inference_request_success_total")
            == value(before, "holoserve_inference_request_success_total") + 1)
    assert value(after, "holoserve_inference_count_total") == value(before, "holoserve_inference_count_total") + 3
    assert 'route="/v2/models/{name}/infer"' in after
    assert 'reason="body_too_large"' in after


def test_auth(sst2):
    with running(sst2, api_token="s3cret-token") as srv:
        auth = {"Authorization": "Bearer s3cret-token"}
        name = httpx.get(srv.url + "/v1/models", headers=auth).json()["models"][0]["name"]
        c = client(srv)
        assert c.is_server_live() and c.is_server_ready()  # health stays public, as /healthz does
        with pytest.raises(InferenceServerException, match="bearer token"):
            c.infer(name, [text_input("TEXT", ["x"], True)])
        res = c.infer(name, [text_input("TEXT", ["x"], True)], headers=auth)
        assert res.as_numpy("LOGITS").shape == (1, 2)
        # Two Authorization headers are refused, whichever comes first: no server-specific pick of one.
        body = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
        for pair in (["Bearer wrong", "Bearer s3cret-token"], ["Bearer s3cret-token", "Bearer wrong"],
                     ["Bearer s3cret-token", "Bearer s3cret-token"]):
            r = httpx.post(f"{srv.url}/v2/models/{name}/infer", json=body,
                           headers=[("Authorization", v) for v in pair])
            assert r.status_code == 400 and "more than one Authorization header" in r.json()["error"], r.text
        r = httpx.get(srv.url + "/v1/models", headers=[("Authorization", "Bearer wrong"),
                                                        ("Authorization", "Bearer s3cret-token")])
        assert r.status_code == 400 and "more than one Authorization header" in r.json()["error"]["message"]


def test_pairs():
    ckpt = tiny_checkpoint("mrpc")
    with running(ckpt, max_batch_size=8) as srv:
        name = model_name(srv)
        c = client(srv)
        mm = c.get_model_metadata(name)
        assert [i["name"] for i in mm["inputs"]] == ["TEXT", "TEXT_PAIR"]
        a, b = ["a man rides a horse", "it rains"], ["a man is riding a horse", "the sun is out"]
        res = c.infer(name, [text_input("TEXT", a, True), text_input("TEXT_PAIR", b, False)])
        preds = predict_scores(srv, {"pairs": [list(p) for p in zip(a, b)]})
        assert strs(res.as_numpy("LABEL")) == [p["label"] for p in preds]
        r = _post(srv, {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}, name=name)
        assert r.status_code == 400 and "missing input TEXT_PAIR" in r.json()["error"]
        r = _post(srv, {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["x"]},
                                   {"name": "TEXT_PAIR", "shape": [2], "datatype": "BYTES", "data": ["y", "z"]}]},
                  name=name)
        assert r.status_code == 400 and "TEXT_PAIR has 2" in r.json()["error"]


def _binary_request(srv, elements: list[bytes], size_delta: int = 0, header_length: str | None = None):
    blob = b"".join(len(e).to_bytes(4, "little") + e for e in elements)
    head = json.dumps({"inputs": [{"name": "TEXT", "shape": [len(elements)], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": len(blob) + size_delta}}],
                       "outputs": [{"name": "LABEL", "parameters": {"binary_data": False}}]}).encode()
    return httpx.post(f"{srv.url}/v2/models/{model_name(srv)}/infer", content=head + blob,
                      headers={"Inference-Header-Content-Length": header_length or str(len(head))})


def test_binary_input_edges(server):
    r = _binary_request(server, [b"loved it", "caf\u00e9 au lait".encode()])
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [2], r.text
    assert "Inference-Header-Content-Length".lower() not in r.headers  # JSON outputs only: a plain JSON answer
    for kwargs, needle in (({"size_delta": 5}, "runs past"), ({"header_length": "99999"}, "not a length within"),
                           ({"header_length": "abc"}, "not a length within")):
        r = _binary_request(server, [b"loved it"], **kwargs)
        assert r.status_code == 400 and needle in r.json()["error"], (kwargs, r.text)
    r = _binary_request(server, [b"\xff\xfe bad"])
    assert r.status_code == 400 and "TEXT[0] is not valid UTF-8" in r.json()["error"]


def test_outputs_are_bounded_before_the_model_runs(sst2):
    """One output listed 50,000 times in a 0.9 MB request: refused at once with a small answer, not a
    response of a hundred MB built on the event loop."""
    with running(sst2) as srv:
        name = model_name(srv)
        texts = [f"text number {i}" for i in range(64)]
        body = {"inputs": [{"name": "TEXT", "shape": [64], "datatype": "BYTES", "data": texts}],
                "outputs": [{"name": "LOGITS"}] * 50_000}
        before = httpx.get(srv.url + "/metrics").text
        r = _post(srv, json.dumps(body, separators=(",", ":")).encode(), name=name)
        assert r.status_code == 400 and "asked for more than once" in r.json()["error"]
        assert len(r.content) < 200
        after = httpx.get(srv.url + "/metrics").text
        count = "holoserve_inference_count_total"
        assert metric(after, count) == metric(before, count)  # the model never ran
        # Each output once is served, and a long id (it is echoed) within the limit too.
        body["outputs"] = [{"name": "LOGITS"}, {"name": "LABEL"}]
        body["id"] = "r" * 500_000
        r = _post(srv, body, name=name)
        assert r.status_code == 200 and r.json()["id"] == body["id"] and len(r.json()["outputs"]) == 2
        body["id"] = "\u00e9" * 400_000  # 0.8 MB of UTF-8 fits the limit; as JSON ("\\u00e9") it would not
        r = _post(srv, json.dumps(body, ensure_ascii=False).encode(), name=name)
        assert r.status_code == 400 and "could take" in r.json()["error"]


def test_response_bound_covers_the_largest_answer(server):
    """The size model is an upper bound: for the longest numbers and labels, and every output shape."""
    from holoserve.server.kserve import response_bound

    svc = server.app.state.service
    name = model_name(server)
    for outputs in ([("LOGITS", False), ("LABEL", False)], [("LOGITS", True), ("LABEL", True)],
                    [("LABEL", False)], [("LOGITS", True)]):
        body = {"id": "\u00e9x" * 50,
                "inputs": [{"name": "TEXT", "shape": [8], "datatype": "BYTES", "data": TEXTS * 2}],
                "outputs": [{"name": n, "parameters": {"binary_data": b}} for n, b in outputs]}
        r = _post(server, body, name=name)
        assert r.status_code == 200, r.text
        assert len(r.content) <= response_bound(svc, 8, outputs, body["id"])
    # The JSON form of the worst float32 logit fits the per-number allowance.
    worst = np.array([-1.2345678e-38, -3.4028235e38, -1.4e-45], dtype=np.float32)
    assert max(len(json.dumps(x)) + 1 for x in worst.tolist()) <= 25


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(server, algorithm):
    """tritonclient's request compression: inflated by the server, the same answer as uncompressed."""
    c = client(server)
    name = model_name(server)
    plain = c.infer(name, [text_input("TEXT", TEXTS, True)])
    packed = c.infer(name, [text_input("TEXT", TEXTS, True)], request_compression_algorithm=algorithm,
                     response_compression_algorithm=algorithm)
    np.testing.assert_array_equal(packed.as_numpy("LOGITS"), plain.as_numpy("LOGITS"))
    assert strs(packed.as_numpy("LABEL")) == strs(plain.as_numpy("LABEL"))


def test_compressed_request_edges(server):
    import gzip

    url = f"{server.url}/v2/models/{model_name(server)}/infer"
    body = json.dumps({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["loved it"]}]}).encode()
    r = httpx.post(url, content=gzip.compress(body), headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    r = httpx.post(url, content=body, headers={"Content-Encoding": "br"})
    assert r.status_code == 415 and "Content-Encoding 'br' is not supported" in r.json()["error"]
    r = httpx.post(url, content=body, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "not valid gzip data" in r.json()["error"]
    r = httpx.post(url, content=gzip.compress(body)[:-6], headers={"Content-Encoding": "gzip"})  # cut off
    assert r.status_code == 400 and "not valid gzip data" in r.json()["error"]
    bomb = gzip.compress(b" " * 5_000_000)  # 5 MB of spaces in a few kB
    assert len(bomb) < 8192
    r = httpx.post(url, content=bomb, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413 and "inflates to more than the limit of 8192 bytes" in r.json()["error"]
    r = httpx.post(server.url + "/predict", content=gzip.compress(b'{"text": "loved it"}'),
                   headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["predictions"][0]["label"] in ("negative", "positive")
