"""The requests the hostile benchmark sends: fuzz cases with the statuses each may get, a mixed load of good
and bad requests, and KServe v2 edge cases (JSON and binary framing)."""
from __future__ import annotations

import gzip
import json
import os
import random
import zlib

from bench.lib.http import get, post


WORDS = ("the movie was good and the actors were great but the plot was very dull and boring "
         "i loved it she hated the story a fun film with a sad ending").split()


def js(obj) -> bytes:
    return json.dumps(obj).encode()


def long_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def fuzz_cases(pair: bool) -> list[tuple[str, list[bytes], set, int]]:
    """(name, pieces of raw bytes to send, acceptable outcomes, responses expected). An outcome is a
    status code or 'closed' (the server closed the connection without an answer, where that is right)."""
    good = {"pairs": [["a man rides a horse", "a man is riding a horse"]]} if pair else {"text": "a fun film"}
    chunked_big = (b"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(b"100000\r\n" + b"a" * 0x100000 + b"\r\n"
                                                              for _ in range(2)) + b"0\r\n\r\n")
    big_header = [b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Big: "] + [b"b" * (1 << 20)] * 32 + [b"\r\n\r\n"]
    return [
        ("valid request", [post(js(good))], {200}, 1),
        ("invalid JSON", [post(b'{"text": "unterminated')], {422}, 1),
        ("invalid UTF-8", [post(b'{"text": "caf\xe9"}')], {400}, 1),
        ("UTF-16 garbage", [post(b"\xff\xfe\x00")], {400}, 1),
        ("JSON nested 100k deep", [post(b"[" * 100_000)], {400, 422}, 1),
        ("number 1e999999 as text", [post(b'{"text": 1e999999}')], {422}, 1),
        ("lone surrogate", [post(b'{"text": "\\ud800"}')], {422}, 1),
        ("NUL inside a text",
         [post(js({"texts" if not pair else "pairs": [["a\u0000b", "c"]] if pair else ["a\u0000b"]}))],
         {200}, 1),
        ("65 items", [post(js({"texts": ["a"] * 65}))], {400, 422}, 1),
        ("10,001-byte text", [post(js({"text": "a" * 10_001}))], {400, 422}, 1),
        ("5,000 emoji (20 kB)", [post(js({"text": "\U0001F600" * 5000}))], {400, 422}, 1),
        ("2 MB body with Content-Length", [post(b"[" + b"1," * 1_000_000 + b"1]")], {413}, 1),
        ("2 MB chunked body", [chunked_big], {413}, 1),
        ("Content-Length lies (says 10 MB)",
         [b"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Length: 10000000\r\n\r\n{}"], {413}, 1),
        ("Content-Length: -1", [b"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Length: -1\r\n\r\n"], {400}, 1),
        ("Content-Length and Transfer-Encoding",
         [b"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
          b"0\r\n\r\n"], {400}, 1),
        ("32 MB header", big_header, {431, "closed"}, 1),
        ("100 kB URL", [get("/healthz?" + "a" * 100_000)], {414, 431, "closed"}, 1),
        ("2,000 small headers", [get("/healthz", "".join(f"X-H{i}: v\r\n" for i in range(2000)))],
         {431, "closed"}, 1),
        ("NUL in a header value", [b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-A: a\x00b\r\n\r\n"], {400}, 1),
        ("TLS hello on the plain port", [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64)],
         {400, "closed"}, 1),
        ("unknown method", [b"BREW /predict HTTP/1.1\r\nHost: bench\r\n\r\n"], {400, 405}, 1),
        ("GET /predict", [get("/predict")], {405}, 1),
        ("path traversal", [get("/../../etc/passwd")], {404}, 1),
        ("text/plain body", [post(b"hello", ctype="text/plain")], {422}, 1),
        ("empty body", [post(b"")], {422}, 1),
        ("wrong input kind", [post(js({"text": "a"} if pair else {"pairs": [["a", "b"]]}))], {400}, 1),
        ("both text and texts", [post(js({"text": "a", "texts": ["b"]}))], {422}, 1),
        ("duplicate JSON keys", [post(b'{"text": "a", "text": "b"}') if not pair else post(js(good))], {200}, 1),
        ("HTTP/1.0", [get("/healthz", version="1.0")], {200}, 1),
        ("3 pipelined requests", [post(js(good)) * 3], {200}, 3),
        ("Expect: 100-continue", [post(js(good), extra="Expect: 100-continue\r\n")], {100, 200}, 1),
        ("hostile X-Request-Id", [get("/healthz", "X-Request-Id: ../../<script>\r\n")], {200}, 1),
    ]


def v2_error_shape(body: bytes) -> bool:
    """The Open Inference Protocol's error body: {"error": "..."}."""
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(obj) == {"error"} and isinstance(obj["error"], str)


def mixed_requests(good: int, bad: int, pair: bool, seed: int = 0) -> list[tuple[str, bytes, set]]:
    rng = random.Random(seed)
    sentence = lambda: long_text(rng.randint(3, 12), rng.randint(0, 1 << 30))  # noqa: E731
    if pair:
        good_body = lambda: js({"pairs": [[sentence(), sentence()]]})  # noqa: E731
        long_body = lambda: js({"pairs": [[long_text(450, rng.randint(0, 1 << 30)), long_text(450)]]})  # noqa: E731
    else:
        good_body = lambda: js({"text": sentence()})  # noqa: E731
        long_body = lambda: js({"text": long_text(900, rng.randint(0, 1 << 30))})  # noqa: E731
    kinds = [  # (kind, body maker, acceptable statuses); the 900-word text is valid: truncated, answered
        ("900-word text", long_body, {200}),
        ("invalid JSON", lambda: b'{"text": "oops', {422}),
        ("invalid UTF-8", lambda: b'{"text": "\xff\xfe"}', {400}),
        ("65 items", lambda: js({"texts": ["a"] * 65}), {400, 422}),
        ("empty text", lambda: js({"text": "   "}), {400, 422}),
        ("wrong type", lambda: js({"text": 42}), {422}),
        ("1.5 MB body", lambda: b'{"text": "' + b"a" * 1_500_000 + b'"}', {413}),
    ]
    out = [("good", good_body(), {200}) for _ in range(good)]
    for i in range(bad):
        kind, make, ok = kinds[i % len(kinds)] if i % 2 else kinds[0]  # half the bad ones are long texts
        out.append((kind, make(), ok))
    rng.shuffle(out)
    return out


def v2_inputs(texts: list[str], pair: bool) -> list[dict]:
    inputs = [{"name": "TEXT", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]
    if pair:
        inputs.append({"name": "TEXT_PAIR", "shape": [len(texts)], "datatype": "BYTES", "data": texts})
    return inputs


def v2_binary(texts: list[str], pair: bool) -> tuple[bytes, int]:
    """A binary-tensor request as tritonclient sends it: the JSON header, then each BYTES element."""
    blob = b"".join(len(t.encode()).to_bytes(4, "little") + t.encode() for t in texts)
    inputs = [{"name": "TEXT", "shape": [len(texts)], "datatype": "BYTES",
               "parameters": {"binary_data_size": len(blob)}}]
    if pair:
        inputs.append({**inputs[0], "name": "TEXT_PAIR"})
    head = js({"inputs": inputs, "outputs": [{"name": "LOGITS", "parameters": {"binary_data": True}},
                                             {"name": "LABEL", "parameters": {"binary_data": True}}]})
    return head + blob * (2 if pair else 1), len(head)


def amplification_body(pair: bool) -> bytes:
    """64 texts and one output named 50,000 times: 0.9 MB that asked for a 125 MB answer."""
    return json.dumps({"inputs": v2_inputs([long_text(12, i) for i in range(64)], pair),
                       "outputs": [{"name": "LOGITS"}] * 50_000}, separators=(",", ":")).encode()


def v2_cases(name: str, pair: bool) -> list[tuple[str, list[bytes], set, int]]:
    """Malformed and edge KServe v2 requests; every 4xx answer must carry the protocol's {"error": "..."}."""
    infer = f"/v2/models/{name}/infer"
    one = v2_inputs(["a fun film"], pair)
    good = js({"inputs": one})
    binary, head_len = v2_binary(["a fun film", "a dull mess"], pair)
    out = lambda outputs, **kw: js({"inputs": one, "outputs": outputs, **kw})  # noqa: E731
    return [
        ("v2: JSON request", [post(good, infer)], {200}, 1),
        ("v2: binary request (tritonclient's framing)",
         [post(binary, infer, "application/octet-stream", f"Inference-Header-Content-Length: {head_len}\r\n")],
         {200}, 1),
        ("v2: one output 50,000 times (0.9 MB)", [post(amplification_body(pair), infer)], {400}, 1),
        ("v2: an output listed twice", [post(out([{"name": "LABEL"}, {"name": "LABEL"}]), infer)], {400}, 1),
        ('v2: binary_data "no"', [post(out([{"name": "LOGITS", "parameters": {"binary_data": "no"}}]), infer)],
         {400}, 1),
        ('v2: binary_data_output "false"', [post(js({"inputs": one, "parameters": {"binary_data_output": "false"}}),
                                                 infer)], {400}, 1),
        ("v2: id NaN", [post(b'{"id": NaN, "inputs": ' + js(one) + b"}", infer)], {400}, 1),
        ("v2: id a number", [post(js({"id": 5, "inputs": one}), infer)], {400}, 1),
        ("v2: shape [2] with data [[a, b]]",
         [post(js({"inputs": [{"name": "TEXT", "shape": [2], "datatype": "BYTES", "data": [["a", "b"]]}]}), infer)],
         {400}, 1),
        ("v2: answer over the body limit (0.8 MB non-ASCII id)",
         [post(json.dumps({"id": "\u00e9" * 400_000, "inputs": one}, ensure_ascii=False).encode(), infer)], {400}, 1),
        ("v2: gzip request", [post(gzip.compress(good), infer, extra="Content-Encoding: gzip\r\n")], {200}, 1),
        ("v2: deflate request", [post(zlib.compress(good), infer, extra="Content-Encoding: deflate\r\n")], {200}, 1),
        ("v2: Content-Encoding br", [post(good, infer, extra="Content-Encoding: br\r\n")], {415}, 1),
        ("v2: gzip bomb (5 MB in 5 kB)", [post(gzip.compress(b" " * 5_000_000), infer,
                                               extra="Content-Encoding: gzip\r\n")], {413}, 1),
        ("v2: gzip header, plain body", [post(good, infer, extra="Content-Encoding: gzip\r\n")], {400}, 1),
        ("v2: head over the limit", [post(good, infer, extra=f"X-Pad: {'a' * 20_000}\r\n")], {431}, 1),
        ("v2: NUL in a header value", [f"GET /v2/models/{name} HTTP/1.1\r\nHost: bench\r\nX-A: a".encode()
                                       + b"\x00b\r\n\r\n"], {400}, 1),
        ("v2: head never completed", [f"POST {infer} HTTP/1.1\r\nHost: bench\r\n".encode()], {408}, 1),
        ("v2: body never completed",
         [f"POST {infer} HTTP/1.1\r\nHost: bench\r\nContent-Length: 100\r\n\r\n{{".encode()], {408}, 1),
        ("v2: unknown model", [post(good, "/v2/models/nope/infer")], {404}, 1),
    ]
