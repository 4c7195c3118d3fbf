"""Server settings: one dataclass, every field settable by a CLI flag or a HOLOSERVE_* variable."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from .. import HoloServeError
from ..core.choices import (OPENVINO_KERNELS, OPENVINO_KERNELS_DEFAULT, OPENVINO_PRECISIONS, TORCH_CUDA_ROUTES,
                            TORCH_PRECISIONS)
from ..core.settings import field_types, parse_setting

TOKEN_ENV = "HOLOSERVE_API_TOKEN"


@dataclass
class ServerConfig:
    artifact_dir: str = ""
    backend: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    max_batch_size: int = 32  # 1 turns dynamic batching off
    # How long a non-full batch waits for company; 0 (Triton's default too), as under load batches form from
    # requests that arrive while the previous batch runs; why: docs/results/2026-11-21-serving.md
    max_queue_delay_ms: float = 0.0
    # Split a merged batch into length groups when padding would pass this share of its tokens; negative:
    # never. "auto": 0.25 on CPU backends; never on GPU ones (torch-cuda, tensorrt), where one padded
    # launch costs less than several small ones; why: docs/results/2026-11-25-gpu-h100.md
    max_padding_waste: str = "auto"
    # Close a batch once its padded tokens (sequences x the longest) would pass this budget; 0: count only.
    max_batch_tokens: int = 0
    # A lone sequence with nothing queued behind it runs on the event-loop thread instead of being
    # handed to the inference thread, saving the hand-off and its wake-ups; why: docs/results/2026-11-21-serving.md
    # The loop is busy for that one run, so a request arriving meanwhile is read when it ends: it would
    # have waited for the single inference thread anyway.
    inline_single: bool = True
    max_queue_size: int = 256  # sequences waiting for inference; beyond this: 503 + Retry-After
    max_items: int = 64  # texts (or pairs) per request
    max_text_bytes: int = 10_000  # UTF-8 bytes per text
    max_body_bytes: int = 1_000_000  # whole request body; beyond this: 413
    # Request bodies being received or held by requests in progress, all together; beyond this: 503 + Retry-After,
    # so that many clients sending large bodies at once cannot take more memory than this (middleware.py).
    max_buffered_body_bytes: int = 64_000_000
    max_seq_length: int = 0  # 0: the checkpoint's manifest value
    threads: int = 0  # backend intra-op threads; 0: the library's default
    # OpenVINO's precision for the float ops around its INT8 GEMMs: "auto" is its CPU default (bf16 where the
    # CPU has bf16 units: a few predictions differ from `holoserve eval`), "f32" matches `holoserve eval`;
    # why: docs/results/2026-11-24-openvino.md
    openvino_precision: str = "auto"
    # OpenVINO models compiled for fixed (batch x seq) shapes beside the dynamic one, e.g. "1x128,32x128": a batch
    # that fits one with little padding (openvino.STATIC_PAD_SHARE) runs there, where OpenVINO fuses more;
    # why: docs/results/2026-11-24-openvino.md
    openvino_shapes: str = ""
    # OpenVINO's sparse INT8 weight decompression (CPUs with AMX only): off, as it showed no consistent gain;
    # why: docs/results/2026-11-24-openvino.md
    openvino_sparse_weights: bool = False
    # HoloServe's 2:4 INT8 kernels for OpenVINO's Linears (holoserve.kernels): auto = where the CPU and a C++
    # compiler (or a prebuilt library) allow them; on = fail without them; off = OpenVINO's GEMMs.
    openvino_kernels: str = OPENVINO_KERNELS_DEFAULT
    # The torch backend's float dtype: fp32 is the checkpoint's numerics; fp16 (CUDA only) is how a GPU
    # serves a dense model, the GPU baseline bench/serve_load compares torch-cuda with.
    torch_precision: str = "fp32"
    torch_compile: bool = False  # the torch backend through torch.compile; its first calls compile (warm-up)
    # torch-cuda: which INT8 GEMMs serve each batch bucket; auto = whichever of the 2:4 and the dense INT8
    # GEMMs of the same weights ran faster at load (the table is in /v1/models); sparse until auto has run on a GPU
    torch_cuda_route: str = "sparse"
    model_name: str = ""  # default: the checkpoint folder's name
    warmup: bool = True
    verify: bool = True  # check sha256 of every checkpoint file at start-up
    graceful_timeout_s: float = 30.0
    # Connection-level limits, enforced by the HTTP protocol (connections.py) before the app sees a request.
    # Each bounds what one client can hold: nginx, Node and h11 ship limits of the same order.
    max_header_bytes: int = 16_384  # request line + headers; beyond this: 431 and the connection is closed
    header_timeout_s: float = 10.0  # to receive a whole request head, from its first byte (or from connect)
    body_timeout_s: float = 30.0  # to receive a whole request body once its head has arrived
    # A client that takes none of its response for this long has its connection aborted (and the
    # response bytes buffered for it dropped).
    send_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1024  # open connections per process; beyond it the longest-stalled one is dropped
    log_level: str = "info"
    # One JSON line per request costs the event loop a record per request; off unless asked for.
    access_log: bool = False
    api_token: str = ""  # bearer token; from HOLOSERVE_API_TOKEN only (never a flag: flags show in `ps`)

    def padding_waste_for(self, backend) -> float:
        """max_padding_waste as the batcher takes it, "auto" resolved for this backend."""
        if self.max_padding_waste != "auto":
            return float(self.max_padding_waste)
        return -1.0 if getattr(backend, "whole_batches", False) else 0.25

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
            problems.append(f"max queue size ({self.max_queue_size}) must be >= max items per request ({self.max_items})")
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
