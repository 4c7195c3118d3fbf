"""App factory for `--workers N`: each worker process builds its app from HOLOSERVE_* variables."""
from __future__ import annotations

from .app import create_app
from .backend_choice import inherited_decision
from .config import ServerConfig
from .logs import setup_logging


def app_from_env():
    cfg = ServerConfig.from_env()
    setup_logging(cfg.log_level)
    return create_app(cfg, decision=inherited_decision())
