"""The HTTP server: FastAPI app, dynamic batcher, Prometheus metrics. Imports no torch."""
from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def create_app(*args, **kwargs):
    from .app import create_app as _create

    return _create(*args, **kwargs)
