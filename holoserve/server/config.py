"""Server settings: one dataclass, every field settable by a CLI flag or a HOLOSERVE_* variable.

Each field is described once, in its metadata (`option`): `holoserve serve --help`, the list of HOLOSERVE_*
variables and docs/usage.md's options table are all made from it (serve_cli.options_table). A comment on a
field says why its default is what it is.
"""
from __future__ import annotations

import os
from dataclasses import Field, dataclass, field, fields
from typing import Any, Callable, Sequence

from .. import HoloServeError
from ..core.choices import (OPENVINO_KERNELS, OPENVINO_KERNELS_DEFAULT, OPENVINO_PRECISIONS, TORCH_CUDA_ROUTES,
                            TORCH_PRECISIONS)
from ..core.settings import field_types, parse_setting
from ..core.tokenizer import GROUP_WASTE

TOKEN_ENV = "HOLOSERVE_API_TOKEN"


def option(default: Any, help: str, *, choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
           flag: bool = True) -> Any:
    """A server setting: its default and its one description (`help`, what it does, for a user). `choices`: the
    values it takes, or a function that lists them where the list is only known once the code is loaded;
    `flag=False`: settable by its environment variable only."""
    meta: dict[str, Any] = {"help": help, "flag": flag}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


def backend_names() -> tuple[str, ...]:
    """"auto" and every backend in the registry (holoserve.backends.base), in its order; the registry is
    imported here, not at module level, so that reading the settings loads no backend code."""
    from ..backends.base import available_backends

    return ("auto", *available_backends())


def choices_of(f: Field) -> tuple[str, ...] | None:
    """The values a setting takes, where it has a fixed set."""
    c = f.metadata.get("choices")
    if c is None:
        return None
    return tuple(c() if callable(c) else c)


@dataclass
class ServerConfig:
    artifact_dir: str = option("", "checkpoint folder", flag=False)
    backend: str = option("auto", "inference backend; auto = tensorrt > torch-cuda > the faster of openvino and "
                          "onnxruntime (timed at start-up), whichever this machine can run", choices=backend_names)
    host: str = option("127.0.0.1", "bind address (127.0.0.1: this machine only; 0.0.0.0: all interfaces, as in "
                       "the container)")
    port: int = option(8000, "TCP port")
    workers: int = option(1, "server processes (each loads the model; the backend is chosen once for all of them; "
                          "/metrics reports all of them together)")
    max_batch_size: int = option(32, "largest batch the dynamic batcher forms; 1 turns batching off")
    # auto: two where a worker has two or more cores; why: docs/results/2026-11-29-instances.md
    instances: str = option(
        "auto", "batches each server process runs at once on a CPU backend, each on its own share of the threads "
        "(Triton's instance count; GPU backends run one); auto = 2 where the process has two or more cores for "
        "its backend, else 1, and 1 wherever OpenVINO serves (alone or routed with ONNX Runtime)")
    # 0 (Triton's default too): under load, batches form from requests that arrive while the previous batch
    # runs; why: docs/results/2026-11-21-serving.md
    max_queue_delay_ms: float = option(0.0, "how long a non-full batch waits for more requests")
    # auto: on GPU backends one padded launch costs less than several small ones; why:
    # docs/results/2026-11-25-gpu-h100.md
    max_padding_waste: str = option(
        "auto", "split a merged batch into length groups when padding would exceed this share of its tokens "
        "(negative: always pad the whole batch to its longest; auto: 0.25 on CPU backends, never split on GPU "
        "backends)")
    max_batch_tokens: int = option(
        0, "close a batch when its padded tokens (sequences x its longest sequence) would pass this budget, so "
        "short requests are not batched behind long ones; a sequence longer than the budget runs alone; 0 = "
        "batches close on --max-batch-size only")
    # Saves the hand-off to the inference thread and its wake-ups; why: docs/results/2026-11-21-serving.md.
    # The loop is busy for that one run, so a request arriving meanwhile is read when it ends: with one
    # instance it would have waited for the inference thread anyway; with more it could have started on
    # another, so only one instance runs inline (docs/results/2026-11-29-instances.md).
    inline_single: bool = option(True, "run a lone batch-1 inference on the event-loop thread (no thread "
                                 "hand-off) when nothing else is queued; with one instance only")
    max_queue_size: int = option(256, "sequences allowed to wait for inference; beyond it requests get 503 + "
                                 "Retry-After")
    max_items: int = option(64, "texts or pairs per request")
    max_text_bytes: int = option(10_000, "UTF-8 bytes per text")
    max_body_bytes: int = option(1_000_000, "request body bytes (413 beyond)")
    # So that many clients sending large bodies at once cannot take more memory than this (bodies.py).
    max_buffered_body_bytes: int = option(
        64_000_000, "request body bytes held by all requests in progress together (503 + Retry-After beyond), "
        "which bounds the memory many large bodies at once can take")
    max_seq_length: int = option(
        0, "tokens per sequence after truncation; 0 = the checkpoint's manifest value, which is also the most it "
        "accepts (the model was calibrated and exported for it; its position table bounds it too)")
    threads: int = option(0, "backend intra-op threads; 0 = as many as a container's CPU quota or cpuset leaves "
                             "the process (shared by the workers), where one limits it, else the library default")
    # auto: OpenVINO's own default; why: docs/results/2026-11-24-openvino.md
    openvino_precision: str = option(
        "auto", "openvino backend: precision of the float ops around the INT8 GEMMs; auto = OpenVINO's CPU default "
        "(bf16 on CPUs with bf16 units: a few predictions differ from `holoserve eval`), f32 = the checkpoint's "
        "numerics", choices=OPENVINO_PRECISIONS)
    # Why (openvino.STATIC_PAD_SHARE is the padding share): docs/results/2026-11-24-openvino.md
    openvino_shapes: str = option(
        "", "openvino backend: BATCHxSEQ shapes to compile static models for, e.g. 1x128,32x128 (each compiled at "
        "start-up, one more copy of the model in memory); a batch that fits one with at most 10 % padding runs "
        "there (OpenVINO fuses more with static shapes), every other batch on the dynamic model, its length padded to "
        "a multiple of 16 tokens (OpenVINO prepares each new shape)")
    # Off, as it showed no consistent gain; why: docs/results/2026-11-24-openvino.md
    openvino_sparse_weights: bool = option(False, "openvino backend: let OpenVINO decompress the 2:4 INT8 weights "
                                           "(CPUs with AMX only; see docs/results/2026-11-24-openvino.md)")
    openvino_kernels: str = option(
        OPENVINO_KERNELS_DEFAULT, "openvino backend: run the 2:4 INT8 Linears on HoloServe's own kernels, which "
        "skip the zeros, and each attention block as one f32 op (AVX-512 VNNI + VBMI, no AMX; "
        "`python -m holoserve.kernels build` builds them ahead of time); auto = where this machine can, falling "
        "back to OpenVINO's GEMMs, on = fail where they cannot run, "
        "off = OpenVINO's GEMMs, reference = their portable scalar build on any x86-64 CPU (the same numbers, many "
        "times slower: for checking predictions, not for speed)", choices=OPENVINO_KERNELS)
    # fp16: the GPU baseline bench/serve_load compares torch-cuda with.
    torch_precision: str = option(
        "fp32", "torch backend: float dtype; fp32 = the checkpoint's numerics, fp16 = how a GPU serves a dense "
        "model (CUDA only; a few predictions can differ from fp32)", choices=TORCH_PRECISIONS)
    torch_compile: bool = option(False, "torch backend: run the model through torch.compile (dynamic shapes; the "
                                 "first requests of each kind compile, the warm-up pays for the first)")
    # sparse until auto has run on a GPU
    torch_cuda_route: str = option(
        "sparse", "torch-cuda backend: which INT8 GEMMs serve each batch bucket; auto = the faster of the 2:4 and "
        "the dense INT8 GEMMs of the same weights, timed at start-up (the table is in /v1/models); sparse or "
        "dense-int8 = that kind for every bucket", choices=TORCH_CUDA_ROUTES)
    model_name: str = option("", "name reported by the API and metrics; default: the checkpoint folder's name")
    warmup: bool = option(True, "run the model once before reporting ready")
    verify: bool = option(True, "check the sha256 of every checkpoint file at start-up")
    graceful_timeout_s: float = option(30.0, "seconds to drain in-flight requests on SIGTERM/SIGINT; requests "
                                       "still running then get 503 + Retry-After")
    # Connection-level limits, enforced by the HTTP protocol (connections.py) before the app sees a request.
    # Each bounds what one client can hold: nginx, Node and h11 ship limits of the same order.
    max_header_bytes: int = option(16_384, "largest request line + headers in bytes; beyond it the client gets "
                                   "431 and the connection is closed")
    header_timeout_s: float = option(10.0, "seconds a client has to send a whole request head, from its first "
                                     "byte (or from connecting); then 408 and the connection is closed "
                                     "(slow-header clients)")
    body_timeout_s: float = option(30.0, "seconds a client has to send a whole request body once its head has "
                                   "arrived; then 408 and the connection is closed (slow-body clients)")
    # The response bytes buffered for the aborted connection are dropped with it.
    send_timeout_s: float = option(30.0, "seconds a client may take none of its response before its connection "
                                   "is aborted")
    keep_alive_timeout_s: float = option(5.0, "seconds an idle keep-alive connection is kept open")
    max_connections: int = option(
        1024, "open connections per server process; beyond it the connection that has waited longest for its "
        "client (idle, or a request still arriving) is closed, and when all are busy the new one gets 503; the "
        "open-file limit is raised to fit it where allowed")
    log_level: str = option("info", "log level (debug, info, warning, error)")
    access_log: bool = option(False, "write one JSON access-log line per request (off by default: a record per "
                              "request costs the server's event loop time under load)")
    # Never a flag: flags show in `ps`.
    api_token: str = option("", f"bearer token; from {TOKEN_ENV} only", flag=False)

    def padding_waste_for(self, backend) -> float:
        """max_padding_waste as the batcher takes it, "auto" resolved for this backend."""
        if self.max_padding_waste != "auto":
            return float(self.max_padding_waste)
        return -1.0 if getattr(backend, "whole_batches", False) else GROUP_WASTE

    def validate(self) -> "ServerConfig":
        problems = []
        if self.max_batch_size < 1:
            problems.append("max batch size must be >= 1")
        if self.max_batch_tokens < 0:
            problems.append("max batch tokens must be >= 0 (0 = batches close on count only)")
        if self.max_queue_delay_ms < 0:
            problems.append("max queue delay must be >= 0 ms")
        if self.max_items < 1:
            problems.append("max items must be >= 1")
        if self.max_queue_size < self.max_items:
            problems.append(f"max queue size ({self.max_queue_size}) must be >= max items per request "
                            f"({self.max_items})")
        if self.max_text_bytes < 1 or self.max_body_bytes < 64:
            problems.append("byte limits must be positive (body limit >= 64)")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            problems.append(f"max buffered body bytes ({self.max_buffered_body_bytes}) must be >= max body bytes "
                            f"({self.max_body_bytes}), or no request of the largest size could be read")
        if self.workers < 1:
            problems.append("workers must be >= 1")
        if not (0 <= self.port < 65536):
            problems.append(f"port {self.port} is out of range")
        if self.max_seq_length < 0:
            problems.append("max sequence length must be >= 0 (0 = from the manifest)")
        if self.max_header_bytes < 1024:
            problems.append(f"max header bytes ({self.max_header_bytes}) must be >= 1024")
        for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name.removesuffix('_s').replace('_', ' ')} must be > 0 s")
        if self.max_connections < 1:
            problems.append("max connections must be >= 1")
        if self.max_padding_waste != "auto":
            try:
                self.max_padding_waste = str(float(self.max_padding_waste))
            except ValueError:
                problems.append(f"max padding waste {self.max_padding_waste!r} must be a number (a share of the "
                                "batch's tokens, e.g. 0.25; negative: never split) or auto")
        if self.instances != "auto":
            try:
                self.instances = str(int(self.instances))
                if int(self.instances) < 1:
                    raise ValueError
            except ValueError:
                problems.append(f"instances {self.instances!r} must be a whole number >= 1 (batches run at once) "
                                "or auto")
        if self.openvino_precision not in OPENVINO_PRECISIONS:
            problems.append(f"openvino precision {self.openvino_precision!r} is not one of "
                            + ", ".join(OPENVINO_PRECISIONS))
        if self.openvino_kernels not in OPENVINO_KERNELS:
            problems.append(f"openvino kernels {self.openvino_kernels!r} is not one of " + ", ".join(OPENVINO_KERNELS))
        if self.torch_precision not in TORCH_PRECISIONS:
            problems.append(f"torch precision {self.torch_precision!r} is not one of " + ", ".join(TORCH_PRECISIONS))
        if self.torch_cuda_route not in TORCH_CUDA_ROUTES:
            problems.append(f"torch-cuda route {self.torch_cuda_route!r} is not one of " + ", ".join(TORCH_CUDA_ROUTES))
        if self.openvino_shapes:
            from ..backends.openvino import parse_shapes  # imports no OpenVINO

            try:
                parse_shapes(self.openvino_shapes)
            except HoloServeError as e:
                problems.append(str(e))
        token_problem = check_token(self.api_token)
        if token_problem:
            problems.append(token_problem)
        if problems:
            raise HoloServeError("invalid server settings: " + "; ".join(problems))
        return self

    # ---- environment round trip (used by --workers > 1, where each worker builds its own app)
    def to_env(self) -> dict[str, str]:
        env = {}
        for f in fields(self):
            if f.name == "api_token":
                continue
            v = getattr(self, f.name)
            env[env_name(f.name)] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return env

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "ServerConfig":
        environ = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        types = field_types(cls)
        for f in fields(cls):
            raw = environ.get(env_name(f.name))
            if raw is None or f.name == "api_token":
                continue
            kwargs[f.name] = parse_value(f.name, raw, types[f.name])
        cfg = cls(**kwargs)
        token = environ.get(TOKEN_ENV)
        if token is not None and not token.strip():
            # Set but blank (`-e HOLOSERVE_API_TOKEN=` or an empty secret file): serving without auth
            # here would be a silent surprise.
            raise HoloServeError(f"{TOKEN_ENV} is set but empty, which would turn auth off: set it to the token, "
                                 "or unset it to serve without auth")
        cfg.api_token = token or ""
        return cfg


def check_token(token: str) -> str | None:
    """Why `token` cannot work as a bearer token, or None. HTTP strips the whitespace around a header
    value, so a token with surrounding whitespace (a newline from `echo` or a secret file) could never
    match and would lock every client out; characters outside printable ASCII cannot be sent reliably."""
    if not token:
        return None
    if token != token.strip():
        return (f"{TOKEN_ENV} has leading or trailing whitespace (often a newline from a file or `echo`); no "
                "request could match it: remove the whitespace (e.g. `printf %s \"$TOKEN\"`)")
    if any(not (32 < ord(c) < 127) for c in token):
        return (f"{TOKEN_ENV} holds spaces, control or non-ASCII characters, which clients cannot send reliably in "
                "an Authorization header: use printable ASCII, e.g. `openssl rand -hex 32`")
    return None


def env_name(field: str) -> str:
    return "HOLOSERVE_" + ("MODEL_DIR" if field == "artifact_dir" else field.upper())


def parse_value(name: str, raw: str, typ: Any) -> Any:
    if typ is bool and not raw.strip():
        return False  # an empty switch variable (`-e HOLOSERVE_WARMUP=`) turns it off
    try:
        return parse_setting(raw, typ)
    except ValueError as e:
        raise HoloServeError(f"{env_name(name)}={raw!r} is not valid ({e})") from None
