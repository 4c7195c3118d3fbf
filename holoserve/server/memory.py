"""Giving memory back to the system after a burst of large requests.

The C library keeps memory that Python frees in its heap for reuse, so a process that once held many large
request bodies at the same time stays that large long after they are gone. `MemoryReleaser` counts the
bytes the server let go of and, once enough have been freed and nothing large is held any more, asks glibc
to return its free pages (malloc_trim), at most once a second and on a thread of its own, since trimming a
large heap takes a while. Elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from typing import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class MemoryReleaser:
    def __init__(self, min_freed_bytes: int = 8 << 20, min_interval_s: float = 1.0):
        self.min_freed_bytes = min_freed_bytes
        self.min_interval_s = min_interval_s
        self._trim = _malloc_trim()
        self._freed = 0
        self._last = 0.0
        self._running = False
        self.trims = 0  # how many times memory was handed back (for tests and diagnostics)

    def freed(self, nbytes: int, idle: bool) -> None:
        """`nbytes` were let go of; `idle`: nothing large is held now, so a trim can return them."""
        self._freed += nbytes
        if not idle or self._freed < self.min_freed_bytes or self._trim is None or self._running:
            return
        wait = max(0.0, self._last + self.min_interval_s - time.monotonic())  # at most one trim a second
        self._freed, self._running = 0, True
        timer = threading.Timer(wait, self._release)
        timer.daemon = True
        timer.start()

    def _release(self) -> None:
        try:
            self._trim(0)
            self.trims += 1
        finally:
            self._last, self._running = time.monotonic(), False
