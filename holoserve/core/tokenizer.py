"""The one tokenizer loader (a checkpoint's tokenizer.json, `tokenizers` library only), and serving-time
encoding on top of it.

No transformers here: the server image has no torch. Every stage (compress, eval, export, the
server, the benchmarks) loads its tokenizer with `load_tokenizer`, so truncation and padding are set
the same way everywhere. Serving encodes each text (or pair) as one unpadded sequence; the batcher
pads a whole batch to its longest member, so padding is paid once per batch, not per request.
"""
from __future__ import annotations

import re
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


# A text is cut to this many characters per token the model can take before it is tokenized: a token spans
# at least one character, so the cut keeps every token that could be served while bounding the work (and the
# memory) a long text costs. Where the cut prefix yields too few tokens (long words), the whole text is used.
CHARS_PER_TOKEN_CUT = 8
_SPACE = re.compile(r"\s")


def cut_text(text: str, tokens: int) -> str:
    """`text` cut before the last whitespace within CHARS_PER_TOKEN_CUT * `tokens` characters; the text itself
    when it is shorter, has no whitespace in the second half of that span, or only whitespace after the cut.
    The pre-tokenizers of BERT-family tokenizers split at whitespace, so the tokens of the prefix are the
    first tokens of the whole text."""
    limit = CHARS_PER_TOKEN_CUT * tokens
    if len(text) <= limit:
        return text
    m = _SPACE.search(text[limit // 2:limit + 1][::-1])
    if m is None:
        return text
    end = limit - m.start()
    return text[:end] if text[end:].strip() else text


class _Template:
    """Where the post-processor puts the special tokens around a pair of sequences, read off the tokenizer
    itself (BERT: [CLS] A [SEP] B [SEP]; RoBERTa: <s> A </s></s> B </s>), so that encodings can be assembled
    from the sequences' own ids without the tokenizer's truncation (whose overflowing pieces of a long pair
    are every combination of both sides' cut-off parts)."""

    def __init__(self, tok):
        e = tok.encode("a", "b")
        # segments: ("special", ids, type ids) or ("sequence", which, type id), in order
        self.segments: list[tuple] = []
        which = -1
        for tid, tt, special in zip(e.ids, e.type_ids, e.special_tokens_mask):
            last = self.segments[-1][0] if self.segments else None
            if special and last == "special":
                self.segments[-1][1].append(tid)
                self.segments[-1][2].append(tt)
            elif special:
                self.segments.append(("special", [tid], [tt]))
            elif last != "sequence":
                which += 1
                self.segments.append(("sequence", which, tt))
        self.segments = [(k, np.asarray(x, np.int64), np.asarray(y, np.int64)) if k == "special" else (k, x, y)
                         for k, x, y in self.segments]
        self.specials = sum(len(x) for k, x, _ in self.segments if k == "special")

    def assemble(self, sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        ids, types = [], []
        for kind, x, y in self.segments:
            if kind == "special":
                ids.append(x)
                types.append(y)
            else:
                seq = np.asarray(sequences[x], dtype=np.int64)
                ids.append(seq)
                types.append(np.full(len(seq), y, dtype=np.int64))
        return np.concatenate(ids), np.concatenate(types)


def longest_first(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """How many tokens of each side of a pair the `longest_first` strategy keeps within `budget` tokens
    (the tokenizers library's rule: the shorter side keeps up to half, the longer the rest)."""
    if n1 + n2 <= budget:
        return n1, n2
    if n1 > n2:
        k2 = min(n2, budget // 2)
        return budget - k2, k2
    k1 = min(n1, budget // 2)
    return k1, budget - k1


class TextEncoder:
    """Encode texts or pairs to unpadded id sequences, truncated to `max_length` tokens (longest_first for
    pairs, as `load_tokenizer` sets it). Each text is cut before tokenizing (`cut_text`) and the sequences
    are truncated here, so a long text or pair costs about what its kept tokens cost."""

    def __init__(self, tokenizer_json: str | Path, max_length: int, *, pair: bool = False):
        if max_length < 4:
            raise HoloServeError(f"max sequence length must be at least 4 tokens, got {max_length}")
        # one text: the tokenizer's own truncation (its overflowing pieces grow only linearly with the text);
        # pairs: sequences without special tokens, truncated and assembled here
        self._truncating = load_tokenizer(tokenizer_json, max_length)
        self._tok = load_tokenizer(tokenizer_json, max_length)
        self._tok.no_truncation()
        self.max_length = int(max_length)
        self.pair = pair
        self.pad_id = pad_token_id(self._tok)
        self._pair = _Template(self._tok)

    def _ids(self, texts: list[str], budget: int) -> list[tuple[list[int], bool]]:
        """Each text's token ids (no special tokens) and whether the text was cut: a cut text's ids are a prefix
        of its tokens at least `budget` long."""
        short = [cut_text(t, budget) for t in texts]
        encs = self._tok.encode_batch(short, add_special_tokens=False) if len(short) > 1 else \
            [self._tok.encode(short[0], add_special_tokens=False)]
        out = []
        for text, cut, enc in zip(texts, short, encs):
            if len(cut) < len(text) and len(enc.ids) < budget:  # long words: the prefix did not hold enough
                out.append(self._whole(text))
            else:
                out.append((enc.ids, len(cut) < len(text)))
        return out

    def _encode_texts(self, texts: list[str]) -> list[Encoded]:
        budget = self.max_length - self._truncating.num_special_tokens_to_add(False)
        short = [cut_text(t, budget) for t in texts]
        tok = self._truncating
        encs = tok.encode_batch(short) if len(short) > 1 else [tok.encode(short[0])]
        out = []
        for text, cut, e in zip(texts, short, encs):
            was_cut = len(cut) < len(text)
            if was_cut and len(e.ids) < self.max_length:  # long words: the prefix did not hold enough
                e, was_cut = tok.encode(text), False
            # With stride 0 the tokenizer keeps what it cut off in `overflowing`.
            out.append(Encoded(np.asarray(e.ids, dtype=np.int64), np.asarray(e.type_ids, dtype=np.int64),
                               truncated=was_cut or bool(e.overflowing)))
        return out

    def _whole(self, text: str) -> tuple[list[int], bool]:
        return self._tok.encode(text, add_special_tokens=False).ids, False

    def encode(self, inputs: Sequence[str] | Sequence[tuple[str, str]]) -> list[Encoded]:
        if not inputs:
            return []
        if isinstance(inputs[0], str):
            return self._encode_texts(list(inputs))
        budget = self.max_length - self._pair.specials
        flat = self._ids([t for pair in inputs for t in pair], budget)
        out = []
        for (text_a, text_b), (a, cut_a), (b, cut_b) in zip(inputs, flat[0::2], flat[1::2]):
            if (cut_a or cut_b) and budget % 2 and min(len(a), len(b)) > budget // 2:
                # Both sides keep about half and the longer one the odd token: which is longer must be known.
                known = (cut_a and not cut_b and len(a) > len(b)) or (cut_b and not cut_a and len(b) >= len(a))
                if not known:
                    (a, cut_a), (b, cut_b) = self._whole(text_a), self._whole(text_b)
            k1, k2 = longest_first(len(a), len(b), budget)
            truncated = cut_a or cut_b or (k1, k2) != (len(a), len(b))
            out.append(self._encoded(self._pair, [a[:k1], b[:k2]], truncated))
        return out

    @staticmethod
    def _encoded(template: _Template, sequences: list[list[int]], truncated: bool) -> Encoded:
        ids, types = template.assemble(sequences)
        return Encoded(ids, types, truncated=truncated)


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


# The padded share above which a CPU server runs a merged batch in length groups (each padded to its own longest
# row): on a CPU, padding costs its share of the work. The batcher's default, and what `holoserve tune` times.
GROUP_WASTE = 0.25


def split_by_length(lengths: Sequence[int], max_waste: float) -> list[list[int]]:
    """Indices grouped so each group, padded to its longest, wastes at most `max_waste` of its tokens.

    A negative `max_waste` keeps everything in one group (plain pad-to-longest).
    """
    if max_waste < 0 or len(lengths) <= 1:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = [[order[0]]]
    real = lengths[order[0]]
    for i in order[1:]:
        L = lengths[i]
        g = groups[-1]
        if (len(g) + 1) * L > (1.0 + max_waste) * (real + L):
            groups.append([i])
            real = L
        else:
            g.append(i)
            real += L
    return groups
