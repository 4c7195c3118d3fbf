"""What a classifier is trained for: its labels, whether it reads text pairs, how it is scored.

A task comes from the user's data (holoserve.data.tabular: labels read from the rows) or from one of
the built-in GLUE shortcuts below, which only say where GLUE's files are and how they spell their
columns and labels; both go through the same reader. Kept torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import HoloServeError
from .metrics import CLASSIFICATION, REGRESSION


@dataclass(frozen=True)
class Task:
    name: str
    labels: tuple[str, ...]  # the model's outputs, in order; empty for regression
    pair: bool = False
    metrics: tuple[str, ...] = ()  # first one is the primary metric; default from the task type

    def __post_init__(self):
        if not self.metrics:
            default = ("pearson", "spearman") if not self.labels else \
                (("accuracy", "f1") if len(self.labels) == 2 else ("accuracy", "macro_f1"))
            object.__setattr__(self, "metrics", default)

    @property
    def is_pair(self) -> bool:
        return self.pair

    @property
    def is_regression(self) -> bool:
        return not self.labels

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.labels)

    @property
    def primary_metric(self) -> str:
        return self.metrics[0]

    def with_primary(self, metric: str | None) -> "Task":
        """The same task scored first by `metric` (--metric); refuses one that does not fit the task type."""
        if not metric:
            return self
        allowed = REGRESSION if self.is_regression else CLASSIFICATION
        if metric not in allowed or (metric in ("f1", "mcc") and self.num_labels != 2):
            kind = "regression" if self.is_regression else f"{self.num_labels}-class classification"
            ok = [m for m in allowed if not (m in ("f1", "mcc") and self.num_labels != 2)]
            raise HoloServeError(f"--metric {metric!r} does not fit {kind}; choose one of {', '.join(ok)}")
        return Task(self.name, self.labels, self.pair, (metric,) + tuple(m for m in self.metrics if m != metric))


@dataclass(frozen=True)
class GlueTask(Task):
    """A GLUE shortcut (`--task sst2 --data-dir DIR`): where the TSVs are and how they name things."""

    folder: str = ""  # under the GLUE data dir, e.g. "SST-2"
    text_column: str = ""  # column names, or indices ("0", "1", ...) for a header-less file
    pair_column: str | None = None
    label_column: str = ""
    header: bool = True
    raw_labels: tuple[str, ...] = ()  # how the TSV spells each label, same order as `labels`
    encoding: str = "utf-8"
    splits: tuple[str, ...] = ("train", "dev")
    aliases: tuple[str, ...] = field(default=(), compare=False)


TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask("sst2", ("negative", "positive"), False, ("accuracy",), folder="SST-2", text_column="sentence",
                 label_column="label", raw_labels=("0", "1"), aliases=("sst-2",)),
        GlueTask("mrpc", ("not_equivalent", "equivalent"), True, ("f1", "accuracy"), folder="MRPC",
                 text_column="#1 String", pair_column="#2 String", label_column="Quality", raw_labels=("0", "1"),
                 encoding="utf-8-sig"),
        GlueTask("cola", ("unacceptable", "acceptable"), False, ("mcc", "accuracy"), folder="CoLA",
                 text_column="3", label_column="1", header=False, raw_labels=("0", "1")),
        GlueTask("stsb", (), True, ("pearson", "spearman"), folder="STS-B", text_column="sentence1",
                 pair_column="sentence2", label_column="score", aliases=("sts-b",)),
        GlueTask("qnli", ("entailment", "not_entailment"), True, ("accuracy",), folder="QNLI",
                 text_column="question", pair_column="sentence", label_column="label",
                 raw_labels=("entailment", "not_entailment"), splits=("dev",)),
    )
}


def get_task(name: str) -> GlueTask:
    key = name.lower()
    for task in TASKS.values():
        if key == task.name or key in task.aliases:
            return task
    raise HoloServeError(f"unknown task {name!r}: the built-in GLUE shortcuts are {', '.join(sorted(TASKS))}; "
                         "for your own data pass --train FILE (and --dev FILE)")


def task_of(art) -> Task:
    """The task a checkpoint was trained for, from its manifest (holoserve.core.artifact.Artifact)."""
    t = art.manifest.task
    return Task(t.name, tuple(t.labels), t.pair, tuple(t.metrics))
