"""Where a command's rows come from: the user's own files (holoserve.data.tabular), a GLUE shortcut's folder
(holoserve.data.glue) or, with neither, the embedded SST-2 sample (holoserve.data.sample); and which rows a
command reads by default."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import HoloServeError
from . import sample
from .glue import read_split
from .tabular import (HOLDOUT_SHARE, Columns, Example, LabelSpace, Source, examples, holdout, infer_labels, label_key,
                      read_table, resolve_columns)
from .tasks import Task, get_task



@dataclass(frozen=True)
class DataOptions:
    """Where a command's rows come from: the user's files, or a GLUE shortcut's folder."""

    train: Path | None = None
    dev: Path | None = None
    columns: Columns = Columns()
    header: bool = True
    data_dir: str | os.PathLike | None = None  # GLUE shortcuts only

    @property
    def user_files(self) -> bool:
        return self.train is not None or self.dev is not None

    def source(self, path: Path) -> Source:
        return Source(Path(path), header=self.header)


@dataclass
class TaskData:
    task: Any  # holoserve.data.tasks.Task
    train: list[Example]
    dev: list[Example]
    info: dict[str, Any]  # recorded in the checkpoint: where the rows came from


def load_for_training(name: str | None, opts: DataOptions, *, metric: str | None = None, seed: int = 0,
                      train_limit: int | None = None, dev_limit: int | None = None) -> TaskData:
    """The task and its rows for `holoserve compress`: labels from the training file, the dev file checked
    against them, or a fixed-seed share of the training rows held out when there is no dev file; a GLUE
    shortcut's files (`name`, `opts.data_dir`); with neither, the embedded SST-2 sample (holoserve.data.sample)."""
    if not opts.user_files and name is None and opts.data_dir is None:  # no data options: the embedded sample
        task = get_task(sample.TASK).with_primary(metric)
        train = read_split(task, "train", sample.root(), limit=train_limit)
        dev = read_split(task, "dev", sample.root(), limit=dev_limit)
        return TaskData(task, train, dev, sample.info())
    if not opts.user_files:
        task = get_task(name or "sst2").with_primary(metric)
        train = read_split(task, "train", opts.data_dir, limit=train_limit)
        dev = read_split(task, "dev", opts.data_dir, limit=dev_limit)
        info = {"source": f"GLUE {task.folder} (built-in shortcut)", "train": "train.tsv", "dev": "dev.tsv"}
        return TaskData(task, train, dev, info)
    if opts.train is None:
        raise HoloServeError("--dev was given without --train: compress needs the training rows (--train FILE)")
    table = read_table(opts.source(opts.train))
    cols = resolve_columns(table, opts.columns)
    labels = infer_labels(table, cols.label)
    task = Task(name or Path(opts.train).stem, tuple(labels.names), cols.text_pair is not None).with_primary(metric)
    train = examples(table, cols, labels, limit=train_limit)
    info: dict[str, Any] = {"source": "user files", "train": Path(opts.train).name, "train_rows": len(train),
                            "columns": {"text": cols.text, "text_pair": cols.text_pair, "label": cols.label}}
    if labels.regression:
        info["labels"] = "regression (numeric scores)"
    else:
        info["label_values"] = [str(r) for r in labels.raw]
    if opts.dev is not None:
        dev_table = read_table(opts.source(opts.dev))
        missing = [c for c in (cols.text, cols.text_pair, cols.label) if c and c not in dev_table.columns]
        if missing:
            raise HoloServeError(f"{opts.dev}: no column {missing[0]!r}, which the training file uses; the columns "
                                 f"are {', '.join(map(repr, dev_table.columns))}")
        dev = examples(dev_table, cols, labels, limit=dev_limit)
        info["dev"] = Path(opts.dev).name
    else:
        train, dev = holdout(train, seed=seed)
        dev = dev[:dev_limit] if dev_limit else dev
        info["dev"] = f"held out: {len(dev)} of the training rows ({HOLDOUT_SHARE:.0%}, seed {seed}); no --dev given"
        info["train_rows"] = len(train)
    return TaskData(task, train, dev, info)


def trained_on_embedded(art: Any) -> bool:
    """Whether a checkpoint (holoserve.core.artifact.Artifact) was trained on the embedded sample."""
    data = art.manifest.training.get("data")
    return isinstance(data, dict) and data.get("source") == "embedded"


def rows_for(task: Any, split: str, opts: DataOptions, limit: int | None = None, *,
             embedded: bool = False) -> list[Example] | None:
    """Rows of `split` ("train" or "dev") for a checkpoint's task, labels mapped onto its outputs by name;
    None when no source for that split was given (the caller falls back or says what to pass). With
    `embedded` (a checkpoint trained on the embedded sample) and no data options, the sample's rows."""
    path = {"train": opts.train, "dev": opts.dev}[split]
    if path is None and embedded and not opts.user_files and opts.data_dir is None and task.name == sample.TASK:
        return read_split(get_task(sample.TASK), split, sample.root(), limit=limit)
    if path is None:
        if opts.user_files or (opts.data_dir is None and not os.environ.get("HOLOSERVE_DATA_DIR")):
            return None
        try:
            glue = get_task(task.name)
        except HoloServeError:
            return None
        if split not in glue.splits:
            return None
        return read_split(glue, split, opts.data_dir, limit=limit)
    table = read_table(opts.source(path))
    cols = resolve_columns(table, opts.columns)
    if task.is_pair != (cols.text_pair is not None):
        want = "two texts per row (--text-pair-column)" if task.is_pair else "one text per row"
        raise HoloServeError(f"{path}: the checkpoint's task {task.name!r} reads {want}")
    labels = LabelSpace(regression=True) if task.is_regression else \
        LabelSpace(regression=False, raw=list(task.labels), names=list(task.labels))
    try:
        glue = get_task(task.name)  # a GLUE-format file for a shortcut's checkpoint spells labels its own way
        spelled = set(map(label_key, table.rows[cols.label]))
        if not task.is_regression and glue.raw_labels and spelled <= set(glue.raw_labels):
            labels = LabelSpace(regression=False, raw=list(glue.raw_labels), names=list(task.labels))
    except HoloServeError:
        pass
    return examples(table, cols, labels, limit=limit)


def data_options(args: Any) -> DataOptions:
    """DataOptions from the arguments holoserve.cli_options.add_data_arguments defines."""
    def path(v):
        return Path(v).expanduser() if v else None

    return DataOptions(path(getattr(args, "train", None)), path(getattr(args, "dev", None)),
                       Columns(getattr(args, "text_column", None), getattr(args, "text_pair_column", None),
                               getattr(args, "label_column", None)),
                       header=not getattr(args, "no_header", False), data_dir=getattr(args, "data_dir", None))
