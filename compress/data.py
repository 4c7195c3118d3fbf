"""Tokenized GLUE splits and fast CPU batches: length-grouped order, padding to the batch's longest row."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from holoserve.data.tabular import Example


@dataclass
class Encoded:
    """One tokenized split as ragged int64 rows plus labels."""

    input_ids: list[np.ndarray]
    token_type_ids: list[np.ndarray]
    labels: np.ndarray  # int64 classes or float32 scores
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


def encode(tokenizer, examples: Sequence[Example], regression: bool = False) -> Encoded:
    if examples and examples[0].text_pair is not None:
        encs = tokenizer.encode_batch([(e.text, e.text_pair) for e in examples])
    else:
        encs = tokenizer.encode_batch([e.text for e in examples])
    ids = [np.asarray(e.ids, dtype=np.int64) for e in encs]
    tts = [np.asarray(e.type_ids, dtype=np.int64) for e in encs]
    labels = np.asarray([e.label for e in examples], dtype=np.float32 if regression else np.int64)
    return Encoded(ids, tts, labels, np.asarray([len(x) for x in ids], dtype=np.int64))


def to_device(batch: dict[str, torch.Tensor], device: torch.device, non_blocking: bool = False
              ) -> dict[str, torch.Tensor]:
    """A collated batch (built on the CPU) on the model's device."""
    return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}


def collate(data: Encoded, idx: Sequence[int]) -> dict[str, torch.Tensor]:
    """Pad the rows `idx` to their longest length (dynamic padding)."""
    n, width = len(idx), int(max(data.lengths[i] for i in idx))
    ids = np.zeros((n, width), dtype=np.int64)
    tts = np.zeros((n, width), dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.int64)
    for r, i in enumerate(idx):
        k = data.lengths[i]
        ids[r, :k], tts[r, :k], mask[r, :k] = data.input_ids[i], data.token_type_ids[i], 1
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(mask),
        "token_type_ids": torch.from_numpy(tts),
        "labels": torch.from_numpy(data.labels[list(idx)]),
    }


def epoch_batches(lengths: np.ndarray, batch_size: int, seed: int, group_size: int = 50) -> list[np.ndarray]:
    """One epoch of length-grouped batches: shuffle, sort by length inside mega-batches, shuffle the batches.

    Rows of similar length share a batch (little padding), yet each epoch's order is random
    and fully determined by `seed`.
    """
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(lengths))
    mega = batch_size * max(1, group_size)
    batches: list[np.ndarray] = []
    for start in range(0, len(perm), mega):
        chunk = perm[start:start + mega]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches.extend(chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size))
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def train_batches(data: Encoded, batch_size: int, seed: int, group_size: int = 50, start_step: int = 0
                  ) -> Iterator[dict[str, torch.Tensor]]:
    """An endless deterministic stream of training batches; `start_step` skips ahead (for resuming)."""
    epoch, step = 0, 0
    while True:
        batches = epoch_batches(data.lengths, batch_size, seed * 100_003 + epoch, group_size)
        for b in batches:
            if step >= start_step:
                yield collate(data, b)
            step += 1
        epoch += 1


def eval_batches(data: Encoded, batch_size: int) -> Iterator[tuple[np.ndarray, dict[str, torch.Tensor]]]:
    """Batches sorted by length (fast); yields (row indices, batch)."""
    order = np.argsort(data.lengths, kind="stable")
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        yield idx, collate(data, idx)


UNLABELED = -100  # the class label of a row only the teacher labels (regression: NaN)


def labelled(labels: torch.Tensor) -> torch.Tensor:
    """Which rows of a batch carry a real label (augmented rows do not)."""
    return ~torch.isnan(labels) if labels.is_floating_point() else labels != UNLABELED


def with_perturbed_copies(data: Encoded, copies: int, rate: float, seed: int, special_ids: Sequence[int]
                          ) -> Encoded:
    """`data` plus `copies` perturbed copies of every row, labelled UNLABELED (NaN for regression) so that
    only distillation learns from them. In each copy every token that is not special ([CLS], [SEP], ...)
    is, with probability `rate`, replaced by a token drawn from the rows' own token frequencies, deleted,
    or swapped with the next token of its segment (a third each). Deterministic for a seed."""
    if copies <= 0:
        return data
    rng = np.random.default_rng(seed)
    special = np.asarray(sorted(set(int(i) for i in special_ids)), dtype=np.int64)
    all_ids = np.concatenate(data.input_ids) if len(data) else np.zeros(0, dtype=np.int64)
    pool = all_ids[~np.isin(all_ids, special)]
    if pool.size == 0:
        return data
    ids, tts = list(data.input_ids), list(data.token_type_ids)
    regression = data.labels.dtype.kind == "f"
    for _ in range(copies):
        for x, t in zip(data.input_ids, data.token_type_ids):
            x, t = x.copy(), t.copy()
            free = ~np.isin(x, special)
            hit = free & (rng.random(len(x)) < rate)
            op = rng.integers(0, 3, len(x))
            keep = np.ones(len(x), dtype=bool)
            for i in np.flatnonzero(hit):
                if op[i] == 0:
                    x[i] = pool[rng.integers(pool.size)]
                elif op[i] == 1:
                    keep[i] = False
                elif i + 1 < len(x) and free[i + 1] and t[i + 1] == t[i]:
                    x[i], x[i + 1] = x[i + 1], x[i]
            for seg in np.unique(t[free]):  # never delete every token of a segment
                if not keep[free & (t == seg)].any():
                    keep[free & (t == seg)] = True
            ids.append(x[keep])
            tts.append(t[keep])
    extra = len(ids) - len(data)
    fill = np.full(extra, np.nan if regression else UNLABELED, dtype=data.labels.dtype)
    return Encoded(ids, tts, np.concatenate([data.labels, fill]), np.asarray([len(x) for x in ids], dtype=np.int64))
