"""The GLUE shortcuts' files: <data-dir>/<folder>/<split>.tsv, read by the generic reader (quoting off: the
sentences contain literal quotes; MRPC has a BOM; CoLA has no header)."""
from __future__ import annotations

import os
from pathlib import Path

from .. import HoloServeError
from .tabular import Columns, Example, LabelSpace, Source, examples, read_table
from .tasks import Task, get_task

DATA_DIR_ENV = "HOLOSERVE_DATA_DIR"


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    """--data-dir wins, then $HOLOSERVE_DATA_DIR; a clear error if neither points at GLUE folders."""
    raw = data_dir if data_dir else os.environ.get(DATA_DIR_ENV)
    if not raw:
        raise HoloServeError(
            f"no GLUE data dir given: pass --data-dir DIR or set {DATA_DIR_ENV} "
            "(a folder holding SST-2/, MRPC/, CoLA/, STS-B/ with train.tsv and dev.tsv); `holoserve compress` "
            "with no --task, --train or --data-dir trains on the SST-2 sample that ships with HoloServe"
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
    """Read one split of a GLUE shortcut through the generic reader; `limit` keeps the first N rows."""
    task = get_task(task) if isinstance(task, str) else task
    path = task_file(task, split, data_dir)
    table = read_table(Source(path, "tsv", header=task.header, encoding=task.encoding))
    labels = LabelSpace(regression=True) if task.is_regression else \
        LabelSpace(regression=False, raw=list(task.raw_labels), names=list(task.labels))
    cols = Columns(task.text_column, task.pair_column, task.label_column)
    for c in (cols.text, cols.text_pair, cols.label):
        if c is not None and c not in table.columns:
            raise HoloServeError(f"{path}: expected a column {c!r} (the GLUE {task.folder} layout); it has "
                                 f"{', '.join(map(repr, table.columns))}")
    return examples(table, cols, labels, limit=limit)
