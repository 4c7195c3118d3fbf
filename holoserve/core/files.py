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




# --------------------------------------------------------------------------- whole folders
#
# A checkpoint is replaced as a whole: the new folder is assembled as a sibling, then swapped with
# the old one in one atomic step (renameat2 RENAME_EXCHANGE on Linux), so the path holds the old or
# the new complete folder at every instant. Temporary siblings carry the writing process's pid, so a
# later writer can tell a crashed writer's leftovers from a live one's and remove them.

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the kernel or filesystem cannot."""
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def temp_sibling(path: Path, kind: str) -> Path:
    """A new, empty folder next to `path` named for it, this process and `kind` (tmp, old, export)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.{kind}-", dir=path.parent))
    _public_mode(tmp, directory=True)
    return tmp


def replace_dir(new: Path, dst: Path) -> None:
    """Put the complete folder `new` at `dst`, replacing what is there, with no instant where `dst`
    is missing or partial (where the OS offers an atomic exchange; elsewhere two renames)."""
    _fsync_dir(new)
    if dst.exists():
        if _renameat2_exchange(new, dst):
            _fsync_dir(dst.parent)
            shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old folder
            return
        old = temp_sibling(dst, "old")
        os.rmdir(old)
        os.replace(dst, old)
        os.replace(new, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, dst)
    _fsync_dir(dst.parent)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(path: Path) -> list[str]:
    """Remove the temporary siblings of `path` left by writers that are no longer running; returns
    their names. Those of live writers are left alone."""
    import re

    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\.[a-z]+-")
    removed = []
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if m and not _alive(int(m.group(1))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed
