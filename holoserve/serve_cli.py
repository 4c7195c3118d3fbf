"""`holoserve serve ARTIFACT_DIR`: serve a checkpoint over HTTP. Every flag has a HOLOSERVE_* variable.

Light at import time (the CLI imports every stage's argument module): fastapi/uvicorn load in run().
"""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

from . import HoloServeError
from .core.choices import OPENVINO_KERNELS, OPENVINO_PRECISIONS, TORCH_CUDA_ROUTES, TORCH_PRECISIONS
from .server.config import TOKEN_ENV, ServerConfig, env_name

BACKENDS = ("auto", "onnxruntime", "openvino", "tensorrt", "torch-cuda", "torch")
CHOICES = {"backend": BACKENDS, "openvino_precision": OPENVINO_PRECISIONS, "openvino_kernels": OPENVINO_KERNELS,
           "torch_precision": TORCH_PRECISIONS, "torch_cuda_route": TORCH_CUDA_ROUTES}  # fields with a fixed set of values

HELP = {
    "backend": "inference backend; auto = tensorrt > torch-cuda > the faster of openvino and onnxruntime (timed "
               "at start-up), whichever this machine can run",
    "host": "bind address (127.0.0.1: this machine only; 0.0.0.0: all interfaces, as in the container)",
    "port": "TCP port",
    "workers": "server processes (each loads the model; the backend is chosen once for all of them; /metrics "
               "reports all of them together)",
    "max_batch_size": "largest batch the dynamic batcher forms; 1 turns batching off",
    "max_queue_delay_ms": "how long a non-full batch waits for more requests",
    "max_padding_waste": "split a merged batch into length groups when padding would exceed this share of its "
                         "tokens (negative: always pad the whole batch to its longest; auto: 0.25 on CPU "
                         "backends, never split on GPU backends)",
    "max_batch_tokens": "close a batch when its padded tokens (sequences x its longest sequence) would pass this "
                        "budget, so short requests are not batched behind long ones; a sequence longer than the "
                        "budget runs alone; 0 = batches close on --max-batch-size only",
    "inline_single": "run a lone batch-1 inference on the event-loop thread (no thread hand-off) when "
                     "nothing else is queued",
    "max_queue_size": "sequences allowed to wait for inference; beyond it requests get 503 + Retry-After",
    "max_items": "texts or pairs per request",
    "max_text_bytes": "UTF-8 bytes per text",
    "max_body_bytes": "request body bytes (413 beyond)",
    "max_buffered_body_bytes": "request body bytes held by all requests in progress together (503 + Retry-After "
                               "beyond), which bounds the memory many large bodies at once can take",
    "max_seq_length": "tokens per sequence after truncation; 0 = the checkpoint's manifest value, which is also "
                      "the most it accepts (the model was calibrated and exported for it; its position table "
                      "bounds it too)",
    "threads": "backend intra-op threads; 0 = the library default",
    "openvino_precision": "openvino backend: precision of the float ops around the INT8 GEMMs; auto = OpenVINO's "
                          "CPU default (bf16 on CPUs with bf16 units: a few predictions differ from `holoserve "
                          "eval`), f32 = the checkpoint's numerics",
    "openvino_shapes": "openvino backend: BATCHxSEQ shapes to compile static models for, e.g. 1x128,32x128 "
                       "(each compiled at start-up, one more copy of the model in memory); a batch that fits one with "
                       "at most 10 %% padding runs there (OpenVINO fuses more with static shapes), every other "
                       "batch on the dynamic model",
    "openvino_kernels": "openvino backend: run the 2:4 INT8 Linears on HoloServe's own kernels, which skip the "
                        "zeros (AVX-512 VNNI + VBMI, no AMX; `python -m holoserve.kernels build` builds them ahead "
                        "of time); auto = where this machine can, falling back to OpenVINO's GEMMs, on = fail where "
                        "they cannot run, off = OpenVINO's GEMMs",
    "openvino_sparse_weights": "openvino backend: let OpenVINO decompress the 2:4 INT8 weights (CPUs with AMX "
                               "only; see docs/results/2026-11-24-openvino.md)",
    "torch_precision": "torch backend: float dtype; fp32 = the checkpoint's numerics, fp16 = how a GPU serves a "
                       "dense model (CUDA only; a few predictions can differ from fp32)",
    "torch_compile": "torch backend: run the model through torch.compile (dynamic shapes; the first requests of "
                     "each kind compile, the warm-up pays for the first)",
    "torch_cuda_route": "torch-cuda backend: which INT8 GEMMs serve each batch bucket; auto = the faster of the "
                        "2:4 and the dense INT8 GEMMs of the same weights, timed at start-up (the table is in "
                        "/v1/models); sparse or dense-int8 = that kind for every bucket",
    "model_name": "name reported by the API and metrics; default: the checkpoint folder's name",
    "warmup": "run the model once before reporting ready",
    "verify": "check the sha256 of every checkpoint file at start-up",
    "graceful_timeout_s": "seconds to drain in-flight requests on SIGTERM/SIGINT; requests still running then "
                          "get 503 + Retry-After",
    "max_header_bytes": "largest request line + headers in bytes; beyond it the client gets 431 and the "
                        "connection is closed",
    "header_timeout_s": "seconds a client has to send a whole request head, from its first byte (or from "
                        "connecting); then 408 and the connection is closed (slow-header clients)",
    "body_timeout_s": "seconds a client has to send a whole request body once its head has arrived; then 408 "
                      "and the connection is closed (slow-body clients)",
    "send_timeout_s": "seconds a client may take none of its response before its connection is aborted",
    "keep_alive_timeout_s": "seconds an idle keep-alive connection is kept open",
    "max_connections": "open connections per server process; beyond it the connection that has waited longest "
                       "for its client (idle, or a request still arriving) is closed, and when all are busy "
                       "the new one gets 503; the open-file limit is raised to fit it where allowed",
    "log_level": "log level (debug, info, warning, error)",
    "access_log": "write one JSON access-log line per request (off by default: a record per request costs "
                  "the server's event loop time under load)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact_dir", nargs="?", metavar="ARTIFACT_DIR",
                        help=f"checkpoint folder (env {env_name('artifact_dir')})")
    defaults = ServerConfig()
    for f in fields(ServerConfig):
        if f.name in ("artifact_dir", "api_token"):
            continue
        flag = "--" + f.name.replace("_", "-").removesuffix("-s")
        default = getattr(defaults, f.name)
        text = f"{HELP.get(f.name, '')} (env {env_name(f.name)}; default {default})"
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(flag, dest=f.name, type=type(default), default=None, help=text,
                                choices=CHOICES.get(f.name))
    parser.epilog = (f"Bearer-token auth: set {TOKEN_ENV} (never a flag, so it does not show in `ps`); it must not "
                     "be empty or carry surrounding whitespace, or the server refuses to start.")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    cfg = ServerConfig.from_env()
    for f in fields(ServerConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name != "api_token":
            setattr(cfg, f.name, v)
    if not cfg.artifact_dir:
        raise HoloServeError(f"give the checkpoint folder: holoserve serve ARTIFACT_DIR (or set {env_name('artifact_dir')})")
    if cfg.backend not in BACKENDS:
        raise HoloServeError(f"unknown backend {cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
    return cfg.validate()


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from holoserve.core.artifact import load_artifact
    from .server.app import create_app, open_backend
    from .server.backend_choice import decide_for_workers
    from .server.connections import fit_open_files, server_options
    from .server.logs import setup_logging
    from .server.metrics import prepare_multiprocess_dir
    from .server.service import effective_max_seq_length

    cfg = config_from_args(args)
    setup_logging(cfg.log_level)
    fit = fit_open_files(cfg.max_connections)
    if fit < cfg.max_connections:
        logging.getLogger("holoserve.server").warning(
            "max connections lowered from %d to %d to fit the open-file limit (raise it with `ulimit -n`)",
            cfg.max_connections, fit)
        cfg.max_connections = fit
    common = dict(host=cfg.host, port=cfg.port, log_config=None, access_log=False,
                  timeout_graceful_shutdown=cfg.graceful_timeout_s, server_header=False)
    if cfg.workers > 1:
        # Each worker builds its own app from the environment (uvicorn forks fresh processes).
        try:
            artifact = load_artifact(cfg.artifact_dir, verify=cfg.verify)  # fail fast, clearly
        except OSError as e:
            raise HoloServeError(f"cannot read the checkpoint {cfg.artifact_dir}: {e}") from None
        effective_max_seq_length(cfg, artifact)
        decision = decide_for_workers(cfg)  # one backend for every worker (server/backend_choice.py)
        logging.getLogger("holoserve.server").info("backend for all workers: %s (%s)", cfg.backend,
                                                    decision["reason"])
        os.environ.update(cfg.to_env())
        # One set of metrics for all workers: they inherit PROMETHEUS_MULTIPROC_DIR (metrics.py).
        metrics_dir, made = prepare_multiprocess_dir(cfg.workers)
        try:
            uvicorn.run("holoserve.server.factory:app_from_env", factory=True, workers=cfg.workers, **common,
                        **server_options(cfg, by_name=True))
        finally:
            if made:
                import shutil

                shutil.rmtree(metrics_dir, ignore_errors=True)
        return 0
    prepare_multiprocess_dir(1)  # a PROMETHEUS_MULTIPROC_DIR set by the operator starts empty
    # One process: load here so a bad checkpoint or backend is a clear error, not a traceback.
    try:
        artifact = load_artifact(cfg.artifact_dir, verify=cfg.verify)
        effective_max_seq_length(cfg, artifact)  # before the (slow) backend load
        backend, decision = open_backend(cfg, artifact)
    except OSError as e:
        raise HoloServeError(f"cannot read the checkpoint {cfg.artifact_dir}: {e}. Its files must be readable by "
                             "the server's user (in the container, uid 10001: chmod -R a+rX the folder)") from None
    holder: dict[str, uvicorn.Server] = {}
    app = create_app(cfg, artifact=artifact, backend=backend, decision=decision,
                     shutdown_flag=lambda: bool(holder and holder["server"].should_exit))
    server = _server_class(uvicorn)(uvicorn.Config(app, **common, **server_options(cfg)))
    holder["server"] = server
    server.run()
    return 0


def _server_class(uvicorn) -> type:
    """uvicorn's Server, except that a SIGTERM, once drained, ends the process with status 0 (as `--workers N`
    does) instead of being raised again, which would make the exit status 143."""
    import signal

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
                captured.remove(sig)

    return Server
