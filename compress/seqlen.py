"""The sequence length a checkpoint is trained, calibrated, exported and served for (max_seq_length).

Unless the user sets it (--max-seq-length), it comes from the data: the shortest length that holds
COVERAGE of the tokenized training rows, rounded up to a multiple of MULTIPLE, at most the preset's
max_seq_length (a cap) and the tokens the model's position table holds. Rows longer than it are
truncated, in training and when served. Torch-free.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from holoserve import HoloServeError

log = logging.getLogger("holoserve.compress")

COVERAGE = 0.99  # share of the training rows the length holds untruncated
MULTIPLE = 32  # rounded up to a multiple of this
UNBOUNDED = 1 << 20  # a tokenizer limit no text reaches: the rows' own lengths
# model types whose position ids start after the padding index (positions pad_token_id + 1 ...), so their
# table holds max_position_embeddings - (pad_token_id + 1) tokens
OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "mpnet", "longformer", "data2vec-text")


@dataclass(frozen=True)
class SequenceLength:
    """The chosen max_seq_length and how it was chosen (manifest.json `sequence_length`)."""

    value: int
    source: str  # "data" or "option"
    train_rows: int
    train_rows_truncated: int
    longest_row: int
    coverage: float | None = None
    tokens_at_coverage: int | None = None
    multiple: int | None = None
    preset_cap: int | None = None
    model_positions: int | None = None

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "value"}

    def describe(self) -> str:
        cut = (f"{self.train_rows_truncated} of {self.train_rows} training rows "
               f"({100 * self.train_rows_truncated / max(1, self.train_rows):.1f} %) are longer and truncated")
        if self.source == "option":
            return f"max_seq_length {self.value} (--max-seq-length); {cut}"
        bounds = [f"preset cap {self.preset_cap}"] + \
            ([f"model positions {self.model_positions}"] if self.model_positions else [])
        return (f"max_seq_length {self.value} from the data: {self.coverage:.0%} of the {self.train_rows} tokenized "
                f"training rows fit in {self.tokens_at_coverage} tokens, rounded up to a multiple of {self.multiple} "
                f"({', '.join(bounds)}); {cut}")


def model_positions(folder: Path) -> int | None:
    """The tokens the position table of the model in `folder` holds (config.json), or None if unknown."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if not isinstance(positions, int) or isinstance(positions, bool) or positions <= 0:
        return None
    if config.get("model_type") in OFFSET_POSITIONS:
        pad = config.get("pad_token_id")
        positions -= (pad if isinstance(pad, int) else 1) + 1
    return positions if positions > 0 else None


def token_lengths(tokenizer, rows: Sequence[Any]) -> np.ndarray:
    """Token counts (special tokens included) of examples (holoserve.data.tabular.Example) under `tokenizer`,
    which must not truncate (holoserve.core.tokenizer.load_tokenizer(dir, UNBOUNDED))."""
    if not rows:
        return np.zeros(0, dtype=np.int64)
    if rows[0].text_pair is not None:
        encs = tokenizer.encode_batch([(r.text, r.text_pair) for r in rows])
    else:
        encs = tokenizer.encode_batch([r.text for r in rows])
    return np.asarray([len(e.ids) for e in encs], dtype=np.int64)


def choose(lengths: np.ndarray, *, cap: int, positions: int | None, fixed: int | None = None) -> SequenceLength:
    """max_seq_length for training rows of token counts `lengths`: `fixed` (the user's) if given, else the
    data's rule, at most `cap` (the preset's) and `positions` (the model's)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n, longest = int(lengths.size), int(lengths.max()) if lengths.size else 0
    if fixed is not None:
        if fixed < 2:
            raise HoloServeError(f"--max-seq-length {fixed}: a sequence needs at least 2 tokens ([CLS] and [SEP])")
        if positions is not None and fixed > positions:
            raise HoloServeError(f"--max-seq-length {fixed} is more than the model's position table holds "
                                 f"({positions} tokens, config.json max_position_embeddings); use at most {positions}")
        return SequenceLength(fixed, "option", n, int((lengths > fixed).sum()), longest, model_positions=positions)
    if cap < 2:
        raise HoloServeError(f"max_seq_length={cap}: the preset's cap on the sequence length needs at least 2 tokens")
    at = int(np.quantile(lengths, COVERAGE, method="inverted_cdf")) if n else 0
    value = min(max(MULTIPLE, math.ceil(at / MULTIPLE) * MULTIPLE), cap, positions or cap)
    return SequenceLength(value, "data", n, int((lengths > value).sum()), longest, coverage=COVERAGE,
                          tokens_at_coverage=at, multiple=MULTIPLE, preset_cap=cap, model_positions=positions)
