"""GLUE TSV readers. Quoting is off (sentences contain literal quotes), MRPC has a BOM, CoLA has no header."""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

from .. import HoloServeError
from .tasks import Task, get_task

DATA_DIR_ENV = "HOLOSERVE_DATA_DIR"


@dataclass(frozen=True)
class Example:
    text: str
    text_pair: str | None
    label: int | float  # class index, or a float score for regression


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    """--data-dir wins, then $HOLOSERVE_DATA_DIR; a clear error if neither points at GLUE folders."""
    raw = data_dir if data_dir else os.environ.get(DATA_DIR_ENV)
    if not raw:
        raise HoloServeError(
            f"no GLUE data dir given: pass --data-dir DIR or set {DATA_DIR_ENV} "
            "(a folder holding SST-2/, MRPC/, CoLA/, STS-B/ with train.tsv and dev.tsv)"
        )
    path = Path(raw).expanduser()
    if not path.is_dir():
        raise HoloServeError(f"GLUE data dir {path} does not exist or is not a folder")
    return path


def task_file(task: Task, split: str, data_dir: str | os.PathLike | None) -> Path:
    if split not in task.splits:
        raise HoloServeError(f"task {task.name} has no {split!r} split here (it has: {', '.join(task.splits)})")
    path = resolve_data_dir(data_dir) / task.folder / f"{split}.tsv"
    if not path.is_file():
        raise HoloServeError(f"missing GLUE file {path}: expected <data-dir>/{task.folder}/{split}.tsv")
    return path


def read_split(
    task: Task | str, split: str, data_dir: str | os.PathLike | None = None, limit: int | None = None
) -> list[Example]:
    """Read one split; `limit` keeps the first N rows (the files are already shuffled)."""
    task = get_task(task) if isinstance(task, str) else task
    path = task_file(task, split, data_dir)
    need = max(task.text_columns + (task.label_column,)) + 1
    examples: list[Example] = []
    with path.open(encoding=task.encoding, newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        for lineno, row in enumerate(reader, start=1):
            if task.header and lineno == 1:
                continue
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) < need:
                raise HoloServeError(f"{path}:{lineno}: expected at least {need} tab-separated columns, got {len(row)}")
            raw = row[task.label_column].strip()
            if task.is_regression:
                try:
                    label: int | float = float(raw)
                except ValueError:
                    raise HoloServeError(f"{path}:{lineno}: score {raw!r} is not a number") from None
            else:
                if raw not in task.raw_labels:
                    raise HoloServeError(
                        f"{path}:{lineno}: label {raw!r} is not one of {', '.join(task.raw_labels)}"
                    )
                label = task.raw_labels.index(raw)
            texts = [row[c].strip() for c in task.text_columns]
            examples.append(Example(texts[0], texts[1] if task.is_pair else None, label))
            if limit is not None and len(examples) >= limit:
                break
    if not examples:
        raise HoloServeError(f"{path} holds no rows")
    return examples
