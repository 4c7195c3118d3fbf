"""Tokenized GLUE splits and fast CPU batches: length-grouped order, padding to the batch's longest row."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from holoserve.data.glue import Example


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
