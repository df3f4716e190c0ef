"""benchmarks/engine/grammar_vocab.py at a small size: exactly the ids asked for, the special tokens last, a valid
byte-level BPE (any UTF-8 text round-trips, word pieces merge), and the same vocabulary for the same seed."""
from __future__ import annotations

from tests.utils.scripts import load_script

grammar_vocab = load_script("engine", "grammar_vocab")


def test_synthetic_tokenizer_is_a_byte_level_bpe_of_the_size_asked_for():
    tok = grammar_vocab.synthetic_bpe_tokenizer(2000)
    vocab = tok.get_vocab()
    assert len(tok) == len(vocab) == 2000 and sorted(vocab.values()) == list(range(2000))
    specials = grammar_vocab.SPECIAL_TOKENS
    assert tok.convert_ids_to_tokens(list(range(2000 - len(specials), 2000))) == list(specials)
    assert (tok.eos_token, tok.bos_token) == ("<|endoftext|>", "<|start|>")
    assert tok.eos_token_id == 2000 - len(specials)
    byte_chars = grammar_vocab._byte_chars()
    assert len(set(byte_chars)) == 256 and all(vocab[c] == b for b, c in enumerate(byte_chars))
    assert max(len(t) for t in vocab if t not in specials) <= 16
    for text in ('{"name": "alpha", "score": [1, 22, 333]}\n', "héllo wörld — 日本語 \x00\x7f", "  the the the"):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text and all(0 <= i < 2000 - len(specials) for i in ids)
    words = "the quick brown fox jumps over the lazy dog and then some more words " * 4
    assert len(tok.encode(words, add_special_tokens=False)) < len(words.encode())  # merges apply


def test_same_seed_same_vocabulary():
    a = grammar_vocab.synthetic_bpe_tokenizer(600).get_vocab()
    assert grammar_vocab.synthetic_bpe_tokenizer(600).get_vocab() == a
    assert grammar_vocab.synthetic_bpe_tokenizer(600, seed=1).get_vocab() != a
