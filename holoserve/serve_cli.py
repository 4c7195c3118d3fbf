"""`holoserve serve ARTIFACT_DIR`: serve a checkpoint over HTTP. Every flag has a HOLOSERVE_* variable.

Light at import time (the CLI imports every stage's argument module): fastapi/uvicorn load in run().
"""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

from . import HoloServeError
from .server.config import TOKEN_ENV, ServerConfig, choices_of, env_name


def flag_name(name: str) -> str:
    """The flag of a ServerConfig field: --max-batch-size for max_batch_size,
    --graceful-timeout for graceful_timeout_s."""
    return "--" + name.replace("_", "-").removesuffix("-s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact_dir", nargs="?", metavar="ARTIFACT_DIR",
                        help=f"{_help(_field('artifact_dir'))} (env {env_name('artifact_dir')})")
    defaults = ServerConfig()
    for f in _flagged():
        default = getattr(defaults, f.name)
        text = f"{_help(f)} (env {env_name(f.name)}; default {default})"
        if isinstance(default, bool):
            parser.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, type=type(default), default=None, help=text,
                                choices=choices_of(f))
    parser.epilog = (f"Bearer-token auth: set {TOKEN_ENV} (never a flag, so it does not show in `ps`); it must not "
                     "be empty or carry surrounding whitespace, or the server refuses to start.")


def _field(name: str):
    return next(f for f in fields(ServerConfig) if f.name == name)


def _flagged():
    """The settings with a flag (not the checkpoint folder, the positional argument, nor the token)."""
    return [f for f in fields(ServerConfig) if f.metadata.get("flag", True)]


def _help(f) -> str:
    return f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %


def options_table() -> str:
    """docs/usage.md's table of `holoserve serve` options, made from the same descriptions as --help."""
    defaults = ServerConfig()
    rows = ["| option | environment variable | default | what it does |", "| --- | --- | --- | --- |"]
    for f in _flagged():
        default, choices = getattr(defaults, f.name), choices_of(f)
        flag = flag_name(f.name)
        if isinstance(default, bool):
            flag, shown = f"{flag}` / `--no-{flag[2:]}", "on" if default else "off"
        else:
            flag += " " + "\\|".join(choices) if choices else ""
            shown = f"`{default}`" if default != "" else "none"
        text = f.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{flag}` | `{env_name(f.name)}` | {shown} | {text} |")
    return "\n".join(rows) + "\n"


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    cfg = ServerConfig.from_env()
    for f in fields(ServerConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name != "api_token":
            setattr(cfg, f.name, v)
    if not cfg.artifact_dir:
        raise HoloServeError("give the checkpoint folder: holoserve serve ARTIFACT_DIR "
                             f"(or set {env_name('artifact_dir')})")
    backends = choices_of(_field("backend"))
    if cfg.backend not in backends:
        raise HoloServeError(f"unknown backend {cfg.backend!r}: choose one of {', '.join(backends)}")
    return cfg.validate()


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from holoserve.core.artifact import load_artifact
    from .server.app import create_app, open_backend
    from .server.backend_choice import decide_for_workers
    from .server.connections import check_listen, fit_open_files, server_options
    from .server.logs import setup_logging
    from .server.metrics import prepare_multiprocess_dir
    from .server.service import effective_max_seq_length

    cfg = config_from_args(args)
    setup_logging(cfg.log_level)
    check_listen(cfg.host, cfg.port)  # before the model loads: a taken port fails in a moment
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
