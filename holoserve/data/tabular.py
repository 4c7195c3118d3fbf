"""Labelled texts from the user's own files: CSV, TSV, JSON Lines, Parquet, or a `datasets.save_to_disk`
folder, read with 🤗 datasets (the compress extra; the server never imports this module).

Columns are found by name (`--text-column`, `--text-pair-column`, `--label-column`), with the usual
defaults (text / sentence / sentence1 + sentence2 / label); a header-less TSV names them by index
("0", "1", ...). Labels come from the data: integers or strings are classes, in a stable order
(numeric, or lexicographic for strings) that the checkpoint records; decimal numbers are a
regression target. Every problem is one HoloServeError naming the file, the row and the fix.
"""
from __future__ import annotations

import csv
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .. import HoloServeError

FORMATS = ("csv", "tsv", "jsonl", "parquet", "disk")
TEXT_DEFAULTS = ("text", "sentence", "sentence1", "question")
PAIR_DEFAULTS = ("text_pair", "sentence2")
LABEL_DEFAULTS = ("label", "labels", "score")
HOLDOUT_SHARE = 0.1
_INT = re.compile(r"^[+-]?\d+$")


@dataclass(frozen=True)
class Example:
    text: str
    text_pair: str | None
    label: int | float  # class index, or a float score for regression


@dataclass(frozen=True)
class Source:
    """One file (or saved folder) of labelled rows."""

    path: Path
    format: str = ""  # inferred from the suffix when empty
    header: bool = True  # CSV/TSV: first line names the columns (else they are "0", "1", ...)
    encoding: str = "utf-8"

    def resolved_format(self) -> str:
        if self.format:
            return self.format
        if self.path.is_dir():
            return "disk"
        suffix = self.path.suffix.lower()
        by_suffix = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".txt": "tsv", ".jsonl": "jsonl", ".json": "jsonl",
                     ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
        if suffix not in by_suffix:
            raise HoloServeError(f"{self.path}: cannot tell the format from the suffix {suffix!r}; use .csv, .tsv, "
                                 ".jsonl, .parquet or a datasets.save_to_disk folder")
        return by_suffix[suffix]


@dataclass(frozen=True)
class Columns:
    text: str | None = None
    text_pair: str | None = None
    label: str | None = None


@dataclass
class Table:
    source: Source
    columns: list[str]
    rows: dict[str, list[Any]]  # column -> values

    def __len__(self) -> int:
        return len(next(iter(self.rows.values()))) if self.rows else 0


def _tsv_header(src: Source) -> list[str]:
    try:
        with open(src.path, encoding=src.encoding, newline="") as f:
            first = next(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), None)
    except UnicodeDecodeError as e:
        raise HoloServeError(f"{src.path}: not {src.encoding.upper()} text ({e.reason} at byte {e.start}); "
                             "save the file as UTF-8") from None
    if not first:
        raise HoloServeError(f"{src.path} is empty: it needs a header line and at least one row")
    return first if src.header else [str(i) for i in range(len(first))]


def read_table(src: Source) -> Table:
    """All rows of one source, every CSV/TSV cell as text (no type guessing, no NaN for "nan")."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never reach a hub
    import datasets
    from datasets import Features, Value

    datasets.disable_progress_bars()
    path = Path(src.path)
    if not path.exists():
        raise HoloServeError(f"{path} does not exist")
    if path.is_file() and path.stat().st_size == 0:
        raise HoloServeError(f"{path} is empty")
    fmt = src.resolved_format()
    with tempfile.TemporaryDirectory(prefix="holoserve-data-") as cache:
        try:
            if fmt == "disk":
                ds = datasets.load_from_disk(str(path))
                if isinstance(ds, datasets.DatasetDict):
                    raise HoloServeError(f"{path} holds several splits ({', '.join(ds)}); pass the folder of one "
                                         "split (e.g. DIR/train), or save each split on its own")
            elif fmt in ("csv", "tsv"):
                kw: dict[str, Any] = dict(na_filter=False, encoding=src.encoding, cache_dir=cache)
                if fmt == "tsv":  # GLUE-style TSV: quotes are literal text
                    names = _tsv_header(src)
                    kw.update(sep="\t", quoting=csv.QUOTE_NONE)
                else:
                    with open(path, encoding=src.encoding, newline="") as f:
                        first = next(csv.reader(f), None)
                    if not first:
                        raise HoloServeError(f"{path} is empty: it needs a header line and at least one row")
                    names = first if src.header else [str(i) for i in range(len(first))]
                if not src.header:
                    kw.update(header=None, column_names=names)
                kw["features"] = Features({n: Value("string") for n in names})
                ds = datasets.load_dataset("csv", data_files=str(path), split="train", **kw)
            elif fmt == "jsonl":
                ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache)
            elif fmt == "parquet":
                ds = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=cache)
            else:
                raise HoloServeError(f"unknown data format {fmt!r}: choose one of {', '.join(FORMATS)}")
            rows = ds.to_dict()
        except HoloServeError:
            raise
        except UnicodeDecodeError as e:
            raise HoloServeError(f"{path}: not {src.encoding.upper()} text ({e.reason}); "
                                 "save the file as UTF-8") from None
        except Exception as e:  # datasets/pyarrow/pandas raise many types for a malformed file
            msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            if "utf-8" in msg.lower() or "decode" in msg.lower():
                raise HoloServeError(f"{path}: not UTF-8 text ({msg}); save the file as UTF-8") from None
            raise HoloServeError(f"{path} cannot be read as {fmt} ({type(e).__name__}: {msg}); check the format "
                                 "(mixed value types in one column are not allowed)") from None
    table = Table(src, list(rows), rows)
    if not len(table):
        raise HoloServeError(f"{path} holds no rows")
    return table


def _pick(table: Table, given: str | None, defaults: Sequence[str], role: str, flag: str, required: bool) -> str | None:
    if given is not None:
        if given not in table.columns:
            raise HoloServeError(f"{table.source.path}: no column {given!r} for the {role}; the columns are "
                                 f"{', '.join(map(repr, table.columns))} (pass {flag} NAME)")
        return given
    for name in defaults:
        if name in table.columns:
            return name
    if required:
        raise HoloServeError(f"{table.source.path}: no {role} column among {', '.join(map(repr, table.columns))}; "
                             f"pass {flag} NAME (default: one of {', '.join(defaults)})")
    return None


def resolve_columns(table: Table, cols: Columns) -> Columns:
    text = _pick(table, cols.text, TEXT_DEFAULTS, "text", "--text-column", True)
    pair_defaults = PAIR_DEFAULTS if text == "sentence1" or cols.text is None else ()
    pair = _pick(table, cols.text_pair, pair_defaults, "text pair", "--text-pair-column", False)
    if text == "question" and pair is None and "sentence" in table.columns:
        pair = "sentence"
    label = _pick(table, cols.label, LABEL_DEFAULTS, "label", "--label-column", True)
    return Columns(text, pair, label)


# --------------------------------------------------------------------------- labels


@dataclass
class LabelSpace:
    """How raw label values map to the model's outputs."""

    regression: bool
    raw: list[Any] = field(default_factory=list)  # class values in output order
    names: list[str] = field(default_factory=list)  # what the checkpoint answers

    def index(self, value: Any) -> int | float:
        if self.regression:
            return float(value)
        return self._lookup[label_key(value)]

    def __post_init__(self):
        self._lookup = {label_key(v): i for i, v in enumerate(self.raw)}

    def knows(self, value: Any) -> bool:
        return self.regression or label_key(value) in self._lookup


def label_key(value: Any) -> str:
    """A label value as the text the label space looks it up by."""
    return str(value).strip() if not isinstance(value, bool) else str(value).lower()


def _kind(value: Any) -> str:
    """int, float or str: what a label value is (text cells are typed by their spelling)."""
    if isinstance(value, bool):
        return "str"
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    text = str(value).strip()
    if _INT.match(text):
        return "int"
    try:
        float(text)
        return "float"
    except ValueError:
        return "str"


def infer_labels(table: Table, column: str, names: dict[str, str] | None = None) -> LabelSpace:
    """The label space of the training rows: classes (ints or strings, sorted) or a regression target."""
    values = table.rows[column]
    kinds: dict[str, int] = {}
    for i, v in enumerate(values, start=1):
        if v is None or (isinstance(v, str) and not v.strip()):
            raise HoloServeError(f"{table.source.path}: row {i} has no label in column {column!r}; every training "
                                 "row needs one")
        kinds.setdefault(_kind(v), i)
    if "str" in kinds and len(kinds) > 1:
        other = next(k for k in kinds if k != "str")
        raise HoloServeError(
            f"{table.source.path}: column {column!r} mixes label types: row {kinds['str']} is text, row "
            f"{kinds[other]} is a number; make every label a class name or every label a number")
    if "float" in kinds:
        bad = [i for i, v in enumerate(values, start=1) if not math.isfinite(float(v))]
        if bad:
            raise HoloServeError(f"{table.source.path}: row {bad[0]} has a non-finite score in column {column!r}")
        return LabelSpace(regression=True)
    if "int" in kinds:
        raw = sorted({int(str(v).strip()) for v in values})
    else:
        raw = sorted({str(v).strip() for v in values})
    if len(raw) < 2:
        raise HoloServeError(f"{table.source.path}: every training row has the label {raw[0]!r}; a classifier needs "
                             "at least two classes")
    label_names = [names.get(str(r), str(r)) if names else str(r) for r in raw]
    return LabelSpace(regression=False, raw=raw, names=label_names)


def examples(table: Table, cols: Columns, labels: LabelSpace, limit: int | None = None) -> list[Example]:
    """The rows as Examples, checked: non-empty texts (and pairs), labels the label space knows."""
    path, out = table.source.path, []
    texts, pairs, raw = table.rows[cols.text], table.rows[cols.text_pair] if cols.text_pair else None, \
        table.rows[cols.label]
    for i in range(len(table)):
        row = i + 1
        text = texts[i]
        if not isinstance(text, str) or not text.strip():
            raise HoloServeError(f"{path}: row {row} has an empty text in column {cols.text!r}; remove the row or "
                                 "fill it in")
        pair = None
        if pairs is not None:
            pair = pairs[i]
            if not isinstance(pair, str) or not pair.strip():
                raise HoloServeError(f"{path}: row {row} has an empty text pair in column {cols.text_pair!r}; "
                                     "every row of a pair task needs both texts")
            pair = pair.strip()
        value = raw[i]
        if value is None or (isinstance(value, str) and not value.strip()):
            raise HoloServeError(f"{path}: row {row} has no label in column {cols.label!r}")
        if not labels.knows(value):
            raise HoloServeError(f"{path}: row {row} has the label {label_key(value)!r}, which no training row has "
                                 f"(the classes are {', '.join(map(repr, labels.names))}); fix the label or add "
                                 "training rows with it")
        try:
            label = labels.index(value)
        except ValueError:
            raise HoloServeError(f"{path}: row {row}: score {value!r} in column {cols.label!r} is not a number") \
                from None
        out.append(Example(text.strip(), pair, label))
        if limit is not None and len(out) >= limit:
            break
    return out


def holdout(rows: list[Example], share: float = HOLDOUT_SHARE, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """A fixed-seed split of the training rows: (train, held-out dev)."""
    if len(rows) < 10:
        raise HoloServeError(f"only {len(rows)} training rows and no dev file: pass --dev FILE, or give at least 10 "
                             "rows so that a share can be held out for evaluation")
    order = np.random.default_rng(seed).permutation(len(rows))
    n_dev = max(1, int(round(len(rows) * share)))
    dev_idx = set(order[:n_dev].tolist())
    return ([r for i, r in enumerate(rows) if i not in dev_idx], [r for i, r in enumerate(rows) if i in dev_idx])
