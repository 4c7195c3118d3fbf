"""GLUE task descriptions: where the rows are, which columns hold text and label, how to score.

Kept torch-free: the server, the benchmarks and the compressor all read tasks from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import HoloServeError


@dataclass(frozen=True)
class Task:
    name: str  # CLI name, e.g. "sst2"
    folder: str  # folder under the GLUE data dir, e.g. "SST-2"
    text_columns: tuple[int, ...]  # one column (single sentence) or two (pair)
    label_column: int
    header: bool
    labels: tuple[str, ...]  # empty for regression
    raw_labels: tuple[str, ...]  # how labels are spelled in the TSV, same order as `labels`
    metrics: tuple[str, ...]  # first one is the primary metric
    encoding: str = "utf-8"
    splits: tuple[str, ...] = ("train", "dev")

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2

    @property
    def is_regression(self) -> bool:
        return not self.labels

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.labels)

    @property
    def primary_metric(self) -> str:
        return self.metrics[0]


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("sst2", "SST-2", (0,), 1, True, ("negative", "positive"), ("0", "1"), ("accuracy",)),
        Task(
            "mrpc", "MRPC", (3, 4), 0, True, ("not_equivalent", "equivalent"), ("0", "1"),
            ("f1", "accuracy"), encoding="utf-8-sig",
        ),
        Task("cola", "CoLA", (3,), 1, False, ("unacceptable", "acceptable"), ("0", "1"), ("mcc", "accuracy")),
        Task("stsb", "STS-B", (7, 8), 9, True, (), (), ("pearson", "spearman")),
        Task(
            "qnli", "QNLI", (1, 2), 3, True, ("entailment", "not_entailment"),
            ("entailment", "not_entailment"), ("accuracy",), splits=("dev",),
        ),
    )
}

ALIASES = {"sst-2": "sst2", "sts-b": "stsb"}


def get_task(name: str) -> Task:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in TASKS:
        raise HoloServeError(f"unknown task {name!r}: choose one of {', '.join(sorted(TASKS))}")
    return TASKS[key]
