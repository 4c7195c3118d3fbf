"""Atomic file writes and checksums: at every instant a path holds the old or the new complete file."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _public_mode(fd_or_path, directory: bool = False) -> None:
    """mkstemp/mkdtemp create 0600/0700 entries; give checkpoint files the usual umask-based modes so a
    server running as another user (e.g. in a container) can read them."""
    mode = (0o777 if directory else 0o666) & ~_umask()
    if isinstance(fd_or_path, int):
        os.fchmod(fd_or_path, mode)
    else:
        os.chmod(fd_or_path, mode)


def _atomic_write(path: str | os.PathLike, fill: Callable[[BinaryIO], None]) -> None:
    """Let `fill` write a temporary sibling of `path`, fsync it and rename it into place, so that
    readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        _public_mode(fd)
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    _atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_savefig(fig: Any, path: str | os.PathLike, dpi: int = 120) -> None:
    """Save a matplotlib figure atomically (its format from the file suffix, e.g. .png)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    _atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=dpi))


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy a (possibly large) file into place via a temporary sibling and a rename."""
    def fill(out: BinaryIO) -> None:
        with open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, 1 << 20)

    _atomic_write(dst, fill)


def file_entry(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    return {"sha256": sha256_file(p), "bytes": p.stat().st_size}


