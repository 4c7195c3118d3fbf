"""A benchmark run's outputs: its record (JSON), its page (Markdown table), its plot (PNG), all written
atomically, and the description of the machine it ran on."""
from __future__ import annotations

import os
import platform
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from holoserve.core.files import atomic_savefig, atomic_write_json, atomic_write_text
from holoserve.core.machine import cpu_name


def table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    """A Markdown table's lines: the header, the rule, then one line per row (cells as given, str()'d)."""
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def write_record(record: dict, out_dir: Path, name: str, markdown: Callable[[dict], str]) -> tuple[Path, Path]:
    """`out_dir/name.json` (the record) and `out_dir/name.md` (its page, `markdown(record)`); returns both."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{name}.json", out_dir / f"{name}.md"
    atomic_write_json(js, record)
    atomic_write_text(md, markdown(record))
    return js, md


@contextmanager
def figure(path: Path, figsize: tuple[float, float] = (8, 4), dpi: int = 120, **subplots: Any) -> Iterator[tuple]:
    """`with figure(path) as (fig, ax): ...` draws on a fresh figure (headless backend), then lays it out and
    saves it to `path` atomically; the figure is closed either way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize, **subplots)
    try:
        yield fig, ax
        fig.tight_layout()
        atomic_savefig(fig, path, dpi=dpi)
    finally:
        plt.close(fig)


def uptime_text() -> str:
    """`uptime`'s line (the load averages a shared machine had), "" where it cannot run."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    """The CPU, core count, architecture, Python and the load when the run started."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "arch": platform.machine(), "python": platform.python_version(),
            "uptime_at_start": uptime_text(), "load_avg_at_start": os.getloadavg()}
