"""The one tokenizer loader (a checkpoint's tokenizer.json, `tokenizers` library only), and serving-time
encoding on top of it.

No transformers here: the server image has no torch. Every stage (compress, eval, export, the
server, the benchmarks) loads its tokenizer with `load_tokenizer`, so truncation and padding are set
the same way everywhere. Serving encodes each text (or pair) as one unpadded sequence; the batcher
pads a whole batch to its longest member, so padding is paid once per batch, not per request.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import HoloServeError


def load_tokenizer(path: str | Path, max_length: int, *, pad: bool = False):
    """A `tokenizers.Tokenizer` from tokenizer.json (or the folder holding it).

    Truncates to `max_length` tokens (longest_first for pairs). Never pads unless `pad`, in which
    case a batch is padded to its longest row with the [PAD] id (0 when the vocabulary has none).
    Whatever truncation/padding the file itself carries is replaced.
    """
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise HoloServeError(f"{path} does not exist: the checkpoint needs a fast tokenizer (tokenizer.json)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exceptions
        raise HoloServeError(f"{path} cannot be read as a tokenizers JSON file ({e})") from None
    tok.enable_truncation(max_length=max_length, strategy="longest_first")
    if pad:
        tok.enable_padding(pad_id=pad_token_id(tok), pad_token="[PAD]")
    else:
        tok.no_padding()
    return tok


def pad_token_id(tok) -> int:
    pad = tok.token_to_id("[PAD]")
    return 0 if pad is None else int(pad)


@dataclass(frozen=True)
class Encoded:
    input_ids: np.ndarray  # int64 [seq]
    token_type_ids: np.ndarray  # int64 [seq]
    truncated: bool

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


class TextEncoder:
    """Encode texts or pairs to unpadded id sequences, truncated to `max_length` tokens."""

    def __init__(self, tokenizer_json: str | Path, max_length: int, *, pair: bool = False):
        if max_length < 4:
            raise HoloServeError(f"max sequence length must be at least 4 tokens, got {max_length}")
        self._tok = load_tokenizer(tokenizer_json, max_length)
        self.max_length = int(max_length)
        self.pair = pair
        self.pad_id = pad_token_id(self._tok)

    def encode(self, inputs: Sequence[str] | Sequence[tuple[str, str]]) -> list[Encoded]:
        if len(inputs) == 1:
            # One text (the common request): the single-sequence call skips encode_batch's hand-off to
            # the tokenizer's thread pool, which costs more than tokenizing a sentence.
            item = inputs[0]
            encs = [self._tok.encode(item) if isinstance(item, str) else self._tok.encode(item[0], item[1])]
        else:
            encs = self._tok.encode_batch(list(inputs))
        out = []
        for e in encs:
            ids = np.asarray(e.ids, dtype=np.int64)
            types = np.asarray(e.type_ids, dtype=np.int64)
            # With stride 0 the tokenizer keeps what it cut off in `overflowing`.
            out.append(Encoded(ids, types, truncated=bool(e.overflowing)))
        return out


def pad_batch(items: Sequence[Encoded], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stack sequences into [batch, longest] int64 arrays: input_ids, attention_mask, token_type_ids."""
    if not items:
        raise ValueError("cannot pad an empty batch")
    seq = max(it.length for it in items)
    n = len(items)
    ids = np.full((n, seq), pad_id, dtype=np.int64)
    mask = np.zeros((n, seq), dtype=np.int64)
    types = np.zeros((n, seq), dtype=np.int64)
    for i, it in enumerate(items):
        L = it.length
        ids[i, :L] = it.input_ids
        mask[i, :L] = 1
        types[i, :L] = it.token_type_ids
    return ids, mask, types
