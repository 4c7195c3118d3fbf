"""Inference backends behind one small interface (see base.py). Library imports are lazy."""
from .base import Backend, BackendUnavailable, available_backends, load_backend, register

__all__ = ["Backend", "BackendUnavailable", "available_backends", "load_backend", "register"]
