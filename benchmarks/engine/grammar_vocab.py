"""A synthetic byte-level BPE tokenizer of GPT-OSS's vocabulary size (201,088 ids), built offline in seconds.

    tok = synthetic_bpe_tokenizer(201088)       # PreTrainedTokenizerFast; eos "<|endoftext|>" = the last ids

The o200k files are not available offline, so this builds a vocabulary of the same size and kind: the 256 byte
tokens of GPT-2's byte-to-unicode alphabet, then merges of existing tokens (each new token is the
concatenation of two earlier ones, so the BPE merge list is valid): mostly lower-case word pieces, space- and
capital-led words, digit runs, punctuation and whitespace pairs, and raw high-byte pairs (partial UTF-8), up to 16
characters. The mask cost of a grammar depends on how many tokens each lexer state admits and on the token trie,
which such a vocabulary reproduces in size and shape; it is no stand-in for the real tokenizer's text statistics.
"""
from __future__ import annotations

import random

SPECIAL_TOKENS = ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")


def _byte_chars() -> list[str]:
    """GPT-2's reversible byte -> printable unicode character map, indexed by byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = dict(zip(keep, keep)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in range(256)]


def synthetic_bpe_tokenizer(vocab_size: int = 201088, seed: int = 0):
    """A ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` ids; the special tokens are the last ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte = _byte_chars()
    vocab = {c: i for i, c in enumerate(byte)}
    letters = [byte[b] for b in b"abcdefghijklmnopqrstuvwxyz"]
    upper = [byte[b] for b in b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    digits = [byte[b] for b in b"0123456789"]
    punct = [byte[b] for b in b'{}[]":,.;!?()-_/\\\'<>=+*&%$#@'] + [byte[ord(" ")], byte[ord("\n")]]
    words, numbers = list(letters), list(digits)
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    target = vocab_size - len(SPECIAL_TOKENS)
    while len(vocab) < target:
        r = rng.random()
        if r < 0.55:
            a, b, pool = rng.choice(words), rng.choice(letters if rng.random() < 0.6 else words), words
        elif r < 0.75:
            a, b, pool = byte[ord(" ")] if rng.random() < 0.7 else rng.choice(upper), rng.choice(words), words
        elif r < 0.82:
            a, b, pool = rng.choice(numbers), rng.choice(digits), numbers
        elif r < 0.9:
            a, b, pool = rng.choice(punct), rng.choice(punct + letters), None
        else:
            a, b, pool = rng.choice(byte), rng.choice(byte[128:]), None
        new = a + b
        if new in vocab or len(new) > 16:
            continue
        vocab[new] = len(vocab)
        merges.append((a, b))
        if pool is not None:
            pool.append(new)
    for s in SPECIAL_TOKENS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|start|>")
