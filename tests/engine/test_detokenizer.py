"""The incremental detokenizer's fast path (decode only the ids after the last complete character) gives exactly
the text and deltas of decoding every id each step."""
from __future__ import annotations

import random

import pytest

from loraplex.engine.detokenizer import IncrementalDetokenizer, decodes_by_concatenation
from loraplex.engine.testing.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(300)


class _Counting:
    """A tokenizer wrapper that records how many ids each decode call got."""

    def __init__(self, tok):
        self._tok, self.lengths = tok, []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self._tok.decode(ids, **kw)


def _stream(tok, ids, incremental, skip=True):
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip, incremental=incremental)
    return [d.update(ids[:n], final=n == len(ids)) for n in range(1, len(ids) + 1)], d.text


def test_the_tiny_byte_level_tokenizer_takes_the_fast_path(tok):
    assert decodes_by_concatenation(tok)
    assert not decodes_by_concatenation(object())  # no backend tokenizer: full decode


@pytest.mark.parametrize("seed", range(6))
def test_fast_path_matches_full_decode_on_random_ids(tok, seed):
    """Random ids (byte tokens split multi-byte characters, leave invalid UTF-8, special ids are skipped)."""
    rng = random.Random(seed)
    text = "héllo wörld — 日本語 😀 the answer is 42. " * 2
    ids = tok.encode(text, add_special_tokens=False)
    ids = ids + [rng.randrange(len(tok)) for _ in range(60)] + ids[:10] + [rng.randrange(3, 260) for _ in range(30)]
    if seed % 2:
        rng.shuffle(ids)
    for skip in (True, False):
        fast, fast_text = _stream(tok, ids, None, skip)
        full, full_text = _stream(tok, ids, False, skip)
        assert fast == full and fast_text == full_text == tok.decode(ids, skip_special_tokens=skip)


def test_fast_path_decodes_only_the_new_ids(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 4, add_special_tokens=False)
    counting = _Counting(tok)
    d = IncrementalDetokenizer(counting)
    text = "".join(d.update(ids[:n]) for n in range(1, len(ids) + 1))
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert max(counting.lengths) == 1  # plain ASCII: every step's text ends in a whole character


def test_a_split_character_waits_for_its_last_byte(tok):
    a, b = tok.encode("a", add_special_tokens=False), tok.encode("b", add_special_tokens=False)
    emoji = [tok.convert_tokens_to_ids(_BYTE_TOKEN[x]) for x in "😀".encode()]  # one byte token per byte
    seq = a + emoji + b
    d = IncrementalDetokenizer(tok)
    deltas = [d.update(seq[:n]) for n in range(1, len(seq) + 1)]
    assert deltas == ["a", "", "", "", "😀", "b"]


def _byte_tokens() -> dict[int, str]:
    """byte -> its byte-level (GPT-2) token string: printable bytes stand for themselves, the rest 256 + k."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_TOKEN = _byte_tokens()
