"""The Open Inference Protocol (KServe v2) over REST, beside /predict: what KServe and Triton clients speak.

GET  /v2                                   server metadata
GET  /v2/health/live, /v2/health/ready     200, or 400 when not ready (the protocol's "false")
GET  /v2/models/{name}[/versions/{v}]      model metadata: inputs, outputs, platform, versions
GET  /v2/models/{name}[/versions/{v}]/ready
POST /v2/models/{name}[/versions/{v}]/infer

The model's tensors are those of the Triton text model that `holoserve export --triton-repo` writes:
input `TEXT` (and `TEXT_PAIR` for a pair task), BYTES, one UTF-8 text per row, shape [n] or [n, 1];
outputs `LOGITS` (FP32 [n, num_labels]) and `LABEL` (BYTES, the top label, or `score` for regression;
shape [n], or [n, 1] when the texts came as [n, 1]). Inference goes through the same service as
/predict: the same input limits, tokenizer, dynamic batcher, queue bound and metrics; auth and the
body limit are the edge middleware's. Errors are {"error": "..."} (400 for a bad request, 404 for an
unknown model or version, 503 while not ready or overloaded).

Tensor data is JSON, or binary per the binary-tensor-data extension (what tritonclient sends by
default): the request's JSON header is `Inference-Header-Content-Length` bytes long and binary
inputs follow it, BYTES elements each as a 4-byte little-endian length and the bytes; binary outputs
are asked for with `parameters: {"binary_data": true}` on an output, or `binary_data_output` on the
request (JSON booleans only). Shared-memory and classification parameters are not supported (400).

What one request can make the server produce is bounded before the model runs: each output may be
asked for once (a duplicate is a 400), and the largest response the request could get, computed from
its inputs (rows x labels x the longest number or label, the echoed `id`), must fit `max_body_bytes`,
the limit request bodies have too; otherwise 400. A 1 MB request could otherwise ask for the same
output tens of thousands of times and hold the event loop and hundreds of MB building the answer.
"""
from __future__ import annotations

import json
import struct
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from .. import __version__
from .protocol import ApiError, text_bytes, v2_error_body
from .service import ClassifierService

HEADER_LENGTH = "inference-header-content-length"
TEXT, TEXT_PAIR, LOGITS, LABEL = "TEXT", "TEXT_PAIR", "LOGITS", "LABEL"
_JSON = "application/json"
_UNSUPPORTED_PARAMS = ("shared_memory_region", "classification")


class V2Error(Exception):
    def __init__(self, code: int, type_: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code, self.type, self.message, self.headers = code, type_, message, headers or {}


def _error_response(code: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(v2_error_body(message), status_code=code, headers=headers, media_type=_JSON)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")).encode(), status_code=status, media_type=_JSON)


def service(request: Request) -> ClassifierService:
    return request.app.state.service


def _model(svc: ClassifierService, name: str, version: str | None = None) -> None:
    if name != svc.name:
        raise V2Error(404, "unknown_model", f"unknown model '{name}'; this server serves '{svc.name}'")
    if version is not None and version != svc.version:
        raise V2Error(404, "unknown_version", f"model '{name}' has no version '{version}'; the served version is "
                      f"'{svc.version}'")


# ---- request decoding


def _flatten(data: Any, name: str, shape: list[int]) -> list[Any]:
    """JSON tensor data, flat (row-major) or nested as the shape is: [n] takes a flat list, [n, 1] a flat
    list or n rows of one element each. Nesting that disagrees with the shape is refused, so a request
    means one thing (shape [2] with [["a", "b"]] is one row of two, not two texts)."""
    if not isinstance(data, list):
        raise V2Error(400, "invalid_request", f"input '{name}': 'data' must be a list of strings")
    if not any(isinstance(x, list) for x in data):
        return data
    if len(shape) == 1:
        raise V2Error(400, "invalid_request", f"input '{name}' has shape {shape} (one dimension) but nested "
                      f"'data'; send a flat list of {shape[0]} strings, or shape [{shape[0]}, 1] with rows of one")
    out: list[Any] = []
    for i, x in enumerate(data):
        if not isinstance(x, list) or len(x) != shape[1] or any(isinstance(y, list) for y in x):
            raise V2Error(400, "invalid_request", f"input '{name}': row {i} of 'data' is not a list of "
                          f"{shape[1]} string (shape {shape}); send a flat list of strings or rows of one")
        out.extend(x)
    return out


def _bytes_elements(raw: bytes, name: str) -> list[bytes]:
    """Binary BYTES tensor data: each element a 4-byte little-endian length and its bytes."""
    out, i, n = [], 0, len(raw)
    while i < n:
        if i + 4 > n:
            raise V2Error(400, "invalid_request", f"input '{name}': binary BYTES data is cut off (an element "
                          "needs a 4-byte length first)")
        (k,) = struct.unpack_from("<I", raw, i)
        i += 4
        if i + k > n:
            raise V2Error(400, "invalid_request", f"input '{name}': binary BYTES element of {k} bytes runs past "
                          "the end of its data")
        out.append(raw[i:i + k])
        i += k
    return out


class _NonFinite(ValueError):
    pass


def _non_finite(token: str) -> Any:
    """NaN and Infinity are not JSON: Python's parser takes them, and an `id` holding one would be
    echoed back as a body no strict client can parse."""
    raise _NonFinite(f"{token} is not a JSON value")


def _parse_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON inference header and the binary data after it (empty without the extension)."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            n = -1
        if not 0 <= n <= len(body):
            raise V2Error(400, "invalid_request", f"Inference-Header-Content-Length {header_length!r} is not a "
                          f"length within the {len(body)}-byte body")
        head, binary = body[:n], body[n:]
    else:
        head, binary = body, b""
    try:
        req = json.loads(head, parse_constant=_non_finite)
    except (ValueError, RecursionError) as e:
        why = (e.msg if isinstance(e, json.JSONDecodeError) else str(e) if isinstance(e, _NonFinite)
               else "not UTF-8 or nested too deeply")
        raise V2Error(400, "invalid_body", f"the inference request is not valid JSON ({why}); send "
                      '{"inputs": [{"name": "TEXT", "shape": [n], "datatype": "BYTES", "data": [...]}]}') from None
    if not isinstance(req, dict):
        raise V2Error(400, "invalid_body", "the inference request must be a JSON object with an 'inputs' list")
    return req, binary


def _texts(inp: dict[str, Any], binary: bytes, offset: int) -> tuple[list[str], tuple[int, ...], int]:
    """One input tensor's texts, its shape, and the binary offset after its data."""
    name = inp.get("name")
    dtype = inp.get("datatype")
    if dtype != "BYTES":
        raise V2Error(400, "invalid_request", f"input '{name}' has datatype {dtype!r}; it takes BYTES (UTF-8 text)")
    shape = inp.get("shape")
    if (not isinstance(shape, list) or not shape or len(shape) > 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or (len(shape) == 2 and shape[1] != 1)):
        raise V2Error(400, "invalid_request", f"input '{name}' has shape {shape!r}; send [n] or [n, 1] "
                      "(one text per row)")
    count = shape[0]
    params = inp.get("parameters") or {}
    if not isinstance(params, dict):
        raise V2Error(400, "invalid_request", f"input '{name}': 'parameters' must be an object")
    for p in _UNSUPPORTED_PARAMS:
        if any(k.startswith(p) for k in params):
            raise V2Error(400, "unsupported", f"input '{name}': parameter '{p}' is not supported by this server")
    size = params.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
            raise V2Error(400, "invalid_request", f"input '{name}': binary_data_size {size!r} runs past the "
                          f"{len(binary)} bytes of binary data after the JSON header")
        elements = _bytes_elements(binary[offset:offset + size], name)
        offset += size
        items = []
        for i, raw in enumerate(elements):
            try:
                items.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise V2Error(400, "invalid_text", f"{name}[{i}] is not valid UTF-8") from None
    else:
        if "data" not in inp:
            raise V2Error(400, "invalid_request", f"input '{name}' has no 'data' (and no binary_data_size)")
        items = _flatten(inp["data"], name, shape)
        for i, s in enumerate(items):
            if not isinstance(s, str):
                raise V2Error(400, "invalid_request", f"{name}[{i}] is {type(s).__name__}, not a string")
    if len(items) != count:
        raise V2Error(400, "invalid_request", f"input '{name}' has shape {shape} but {len(items)} elements")
    return items, tuple(shape), offset


def _check(items: list[str], name: str, limits) -> int:
    """The /predict rules for each text; their total UTF-8 size."""
    return sum(text_bytes(s, f"{name}[{i}]", limits.max_text_bytes, lambda code, msg: V2Error(400, code, msg))
               for i, s in enumerate(items))


def decode_inputs(req: dict[str, Any], binary: bytes, svc: ClassifierService):
    """The texts (or pairs) of an inference request, checked as /predict checks them."""
    inputs = req.get("inputs")
    shape_error = V2Error(400, "invalid_request", "'inputs' must be a non-empty list of tensors "
                          '({"name", "shape", "datatype", "data"})')
    if not isinstance(inputs, list) or not inputs:
        raise shape_error
    expected = (TEXT, TEXT_PAIR) if svc.limits.pair else (TEXT,)
    by_name: dict[str, tuple[list[str], tuple[int, ...]]] = {}
    offset = 0
    for inp in inputs:  # entry by entry: a long list is refused at its first bad entry
        if not isinstance(inp, dict):
            raise shape_error
        name = inp.get("name")
        if name not in expected:
            raise V2Error(400, "invalid_request", f"unexpected input {_shown(name)}; model '{svc.name}' takes "
                          + " and ".join(expected))
        if name in by_name:
            raise V2Error(400, "invalid_request", f"input '{name}' is given twice")
        texts, shape, offset = _texts(inp, binary, offset)
        by_name[name] = (texts, shape)
    missing = [n for n in expected if n not in by_name]
    if missing:
        raise V2Error(400, "invalid_request", f"missing input {', '.join(missing)}; model '{svc.name}' (task "
                      f"{svc.limits.task}) takes " + " and ".join(expected))
    texts, shape = by_name[TEXT]
    n = len(texts)
    if n == 0:
        raise V2Error(400, "invalid_request", "input 'TEXT' is empty; send at least one text")
    if n > svc.limits.max_items:
        raise V2Error(400, "too_many_items", f"input 'TEXT' has {n} texts; the limit is {svc.limits.max_items}")
    total = _check(texts, TEXT, svc.limits)
    if not svc.limits.pair:
        return texts, total, shape
    seconds, _ = by_name[TEXT_PAIR]
    if len(seconds) != n:
        raise V2Error(400, "invalid_request", f"TEXT has {n} texts but TEXT_PAIR has {len(seconds)}; send one "
                      "second text per first")
    total += _check(seconds, TEXT_PAIR, svc.limits)
    return list(zip(texts, seconds)), total, shape


def _shown(value: Any) -> str:
    """A client's value in an error message, cut short (it could be most of a megabyte)."""
    text = repr(value[:100] if isinstance(value, (str, list)) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def _flag(params: dict[str, Any], key: str, default: bool, where: str) -> bool:
    """A boolean parameter: JSON true or false only (bool("no") would be true)."""
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise V2Error(400, "invalid_request", f"{where}parameter '{key}' is {json.dumps(value)[:40]}; it takes "
                      "true or false (a JSON boolean)")
    return value


def _requested_outputs(req: dict[str, Any]) -> list[tuple[str, bool]]:
    """(name, binary) of each output to return, in order; each output at most once."""
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise V2Error(400, "invalid_request", "'parameters' must be an object")
    all_binary = _flag(params, "binary_data_output", False, "")
    outputs = req.get("outputs")
    if outputs is None:
        return [(LOGITS, all_binary), (LABEL, all_binary)]
    shape_error = V2Error(400, "invalid_request", "'outputs' must be a list of {\"name\": ...} objects")
    if not isinstance(outputs, list):
        raise shape_error
    out: list[tuple[str, bool]] = []
    # Entry by entry: a list that names an output again is refused at that entry, not walked whole.
    for o in outputs:
        if not isinstance(o, dict):
            raise shape_error
        name = o.get("name")
        if name not in (LOGITS, LABEL):
            raise V2Error(400, "invalid_request", f"unknown output {_shown(name)}; the model has LOGITS and LABEL")
        if any(name == n for n, _ in out):
            raise V2Error(400, "invalid_request", f"output '{name}' is asked for more than once; list each "
                          "output once")
        p = o.get("parameters") or {}
        if not isinstance(p, dict):
            raise V2Error(400, "invalid_request", f"output '{name}': 'parameters' must be an object")
        for bad in _UNSUPPORTED_PARAMS:
            if any(k.startswith(bad) for k in p):
                raise V2Error(400, "unsupported", f"output '{name}': parameter '{bad}' is not supported by this "
                              "server")
        out.append((name, _flag(p, "binary_data", all_binary, f"output '{name}': ")))
    return out


def _request_id(req: dict[str, Any]) -> str | None:
    """The request's `id`, echoed in the response: a string, as the protocol has it."""
    rid = req.get("id")
    if rid is not None and not isinstance(rid, str):
        raise V2Error(400, "invalid_request", f"'id' is {type(rid).__name__}; send a string (or no id)")
    return rid


# The longest JSON text of one FP32 logit as the response writes it (a float32 widened to a Python
# float: up to 17 significant digits, a sign, a point and an exponent), with its comma.
_FLOAT_JSON = 25
# The response's fixed parts: braces, keys, datatype and shape of each output, binary sizes.
_ENVELOPE = 128
_PER_OUTPUT = 160


def response_bound(svc: ClassifierService, n: int, outputs: list[tuple[str, bool]], rid: str | None) -> int:
    """The most bytes the answer to a request with `n` rows, these outputs and this id can take."""
    labels = svc.labels  # ["score"] for regression: the LABEL output's one value
    size = _ENVELOPE + len(json.dumps(svc.name)) + len(json.dumps(svc.version))
    if rid is not None:
        size += len(json.dumps(rid)) + 8
    for name, binary in outputs:
        size += _PER_OUTPUT
        if name == LOGITS:
            size += n * len(labels) * (4 if binary else _FLOAT_JSON)
        elif binary:
            size += n * (4 + max(len(x.encode()) for x in labels))
        else:
            size += n * (1 + max(len(json.dumps(x)) for x in labels))
    return size


def check_response_size(svc: ClassifierService, n: int, outputs: list[tuple[str, bool]], rid: str | None) -> None:
    """Refuse, before the model runs, a request whose answer could pass the body limit."""
    limit = svc.config.max_body_bytes
    bound = response_bound(svc, n, outputs, rid)
    if bound > limit:
        raise V2Error(400, "response_too_large", f"the response to this request could take {bound} bytes; the "
                      f"server's limit is {limit} bytes (--max-body-bytes): send fewer texts, ask for binary "
                      "outputs or fewer of them, or a shorter 'id'")


def _serialize_bytes(values: list[str]) -> bytes:
    parts = []
    for v in values:
        b = v.encode("utf-8")
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


# ---- routes

# Not in /openapi.json: the protocol has its own specification (KServe's open-inference-protocol REST
# document), and its request rules (a shape that matches the data, the model's input names) are more
# than a JSON schema can say.
v2_router = APIRouter(include_in_schema=False)


@v2_router.get("/v2", summary="Server metadata")
async def server_metadata() -> Response:
    return _json({"name": "holoserve", "version": __version__, "extensions": ["binary_tensor_data"]})


@v2_router.get("/v2/health/live", summary="Liveness (200)")
async def live() -> Response:
    return Response(status_code=200)


@v2_router.get("/v2/health/ready", summary="Readiness: 200 when the model is loaded and warmed up, else 400")
async def ready(request: Request) -> Response:
    return Response(status_code=200 if service(request).ready else 400)


def _metadata(svc: ClassifierService) -> dict[str, Any]:
    inputs = [{"name": TEXT, "datatype": "BYTES", "shape": [-1]}]
    if svc.limits.pair:
        inputs.append({"name": TEXT_PAIR, "datatype": "BYTES", "shape": [-1]})
    backend = svc.backend.name if svc.backend is not None else svc.config.backend
    return {"name": svc.name, "versions": [svc.version], "platform": f"holoserve_{backend}",
            "inputs": inputs,
            "outputs": [{"name": LOGITS, "datatype": "FP32", "shape": [-1, len(svc.labels)]},
                        {"name": LABEL, "datatype": "BYTES", "shape": [-1]}]}


def _guard(fn):
    """Answer V2Error as {"error": ...}."""
    import functools

    @functools.wraps(fn)
    async def wrapped(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except (V2Error, ApiError) as e:
            return _error_response(e.code, e.message, e.headers)
    return wrapped


@v2_router.get("/v2/models/{name}", summary="Model metadata")
@_guard
async def model_metadata(name: str, request: Request) -> Response:
    svc = service(request)
    _model(svc, name)
    return _json(_metadata(svc))


@v2_router.get("/v2/models/{name}/versions/{version}", summary="Model metadata (one version)")
@_guard
async def model_version_metadata(name: str, version: str, request: Request) -> Response:
    svc = service(request)
    _model(svc, name, version)
    return _json(_metadata(svc))


@v2_router.get("/v2/models/{name}/ready", summary="Model readiness: 200, or 400 when not ready")
@_guard
async def model_ready(name: str, request: Request) -> Response:
    svc = service(request)
    _model(svc, name)
    return Response(status_code=200 if svc.ready else 400)


@v2_router.get("/v2/models/{name}/versions/{version}/ready", summary="Model version readiness")
@_guard
async def model_version_ready(name: str, version: str, request: Request) -> Response:
    svc = service(request)
    _model(svc, name, version)
    return Response(status_code=200 if svc.ready else 400)


async def _infer(request: Request, name: str, version: str | None) -> Response:
    svc = service(request)
    m = svc.metrics
    t0 = time.perf_counter()
    try:
        _model(svc, name, version)
        req, binary = _parse_body(await request.body(), request.headers.get(HEADER_LENGTH))
        items, total_bytes, shape = decode_inputs(req, binary, svc)
        outputs = _requested_outputs(req)
        rid = _request_id(req)
        check_response_size(svc, len(items), outputs, rid)
        encs, results, _ = await svc.classify(items, total_bytes, request.state.request_id, t0)
        logits = np.stack([r.logits for r in results]).astype(np.float32, copy=False)
        n = len(results)
        if svc.regression:
            labels = ["score"] * n
        else:
            names = svc.labels
            labels = [names[k] for k in logits.argmax(axis=1).tolist()]
        label_shape = [n, 1] if len(shape) == 2 else [n]
        out_json: list[dict[str, Any]] = []
        blobs: list[bytes] = []
        for out_name, as_binary in outputs:
            if out_name == LOGITS:
                entry: dict[str, Any] = {"name": LOGITS, "datatype": "FP32", "shape": list(logits.shape)}
                if as_binary:
                    blob = np.ascontiguousarray(logits, dtype="<f4").tobytes()
                else:
                    entry["data"] = logits.reshape(-1).tolist()
            else:
                entry = {"name": LABEL, "datatype": "BYTES", "shape": label_shape}
                if as_binary:
                    blob = _serialize_bytes(labels)
                else:
                    entry["data"] = labels
            if as_binary:
                entry["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            out_json.append(entry)
        body: dict[str, Any] = {"model_name": svc.name, "model_version": svc.version, "outputs": out_json}
        if rid is not None:
            body["id"] = rid
        head = json.dumps(body, separators=(",", ":")).encode()
        m.success_l.inc()
        if not blobs:
            return Response(head, media_type=_JSON)
        return Response(head + b"".join(blobs), media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(head))})
    except (V2Error, ApiError) as e:
        m.fail(e.type)
        return _error_response(e.code, e.message, e.headers)
    finally:
        m.request_duration_l.observe(time.perf_counter() - t0)


@v2_router.post("/v2/models/{name}/infer", summary="Classify TEXT (and TEXT_PAIR): LOGITS and LABEL")
async def infer(name: str, request: Request) -> Response:
    return await _infer(request, name, None)


@v2_router.post("/v2/models/{name}/versions/{version}/infer", summary="Classify with one model version")
async def infer_version(name: str, version: str, request: Request) -> Response:
    return await _infer(request, name, version)
