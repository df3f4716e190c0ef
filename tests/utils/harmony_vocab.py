"""The o200k_base vocabulary for tests, offline: rebuilt from the copy the ``quicktok-v1`` wheel ships
(``quicktok/data/o200k.vocab``: a little-endian u32 count, then per token a u16 length, its bytes, a u32 rank)
into the ``.tiktoken`` text openai-harmony reads. The result must hash to ``O200K_BASE_SHA256``, the digest
harmony itself checks, so a changed source fails here loudly instead of testing against a wrong vocabulary.

    folder = o200k_vocab_dir(tmp)          # holds o200k_base.tiktoken
    tokenizer_json = o200k_tokenizer_json(tmp)   # a GPT-OSS-shaped tokenizer.json (vocab + harmony specials)
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct

from loraplex.platform.inference.harmony.vocab import O200K_BASE_SHA256, O200K_RANKS, VOCAB_FILE, tiktoken_file

HARMONY_SPECIALS = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002,
                    "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007,
                    "<|message|>": 200008, "<|call|>": 200012}


def o200k_ranked() -> list[bytes]:
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the harmony tests need the dev dependency quicktok-v1 (its o200k vocabulary); "
                           "pip install -e '.[dev]'")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "o200k.vocab")
    with open(path, "rb") as f:
        data = f.read()
    (n,), off = struct.unpack_from("<I", data, 0), 4
    ranked: list[bytes | None] = [None] * n
    for _ in range(n):
        (length,) = struct.unpack_from("<H", data, off)
        token = data[off + 2:off + 2 + length]
        (rank,) = struct.unpack_from("<I", data, off + 2 + length)
        off += 6 + length
        ranked[rank] = token
    assert n == O200K_RANKS and all(t is not None for t in ranked), "quicktok's o200k.vocab is not o200k_base"
    return ranked  # type: ignore[return-value]


def o200k_vocab_dir(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    data = tiktoken_file(o200k_ranked())
    digest = hashlib.sha256(data).hexdigest()
    assert digest == O200K_BASE_SHA256, f"rebuilt o200k_base.tiktoken hashes to {digest}, not o200k_base's"
    with open(os.path.join(folder, VOCAB_FILE), "wb") as f:
        f.write(data)
    return folder


def _byte_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def o200k_tokenizer_json(folder: str) -> str:
    """A tokenizer.json laid out as GPT-OSS's (byte-level BPE vocab of the o200k ranks, harmony specials as
    added tokens; no merges: for the vocabulary rebuild only, not for tokenizing)."""
    os.makedirs(folder, exist_ok=True)
    table = _byte_to_unicode()
    vocab = {"".join(table[b] for b in tok): rank for rank, tok in enumerate(o200k_ranked())}
    doc = {"version": "1.0", "added_tokens": [{"id": i, "content": t, "special": True}
                                              for t, i in HARMONY_SPECIALS.items()],
           "model": {"type": "BPE", "vocab": vocab, "merges": []}}
    path = os.path.join(folder, "tokenizer.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return path
