"""The ``o200k_base`` vocabulary that ``openai-harmony`` needs, found or built locally (never downloaded).

openai-harmony loads ``o200k_base.tiktoken`` (one ``<base64 token bytes> <rank>`` line per rank, 0..199997) from
the folder named by ``TIKTOKEN_ENCODINGS_BASE``, checking its sha256 against ``O200K_BASE_SHA256``; without the
variable it downloads the file. GPT-OSS checkpoints ship the same vocabulary in ``tokenizer.json`` (the
``o200k_harmony`` tokenizer: byte-level BPE, ids 0..199997 = the o200k ranks, the harmony specials above), so
the file is rebuilt from it, byte for byte, into a cache folder. Where it comes from, first found wins:

  1. ``$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`` (the operator's copy; harmony's own variable)
  2. ``<cache>/o200k_base.tiktoken`` built from the served model's ``tokenizer.json`` when its vocabulary hashes
     to ``O200K_BASE_SHA256``; ``<cache>``: ``$LORAPLEX_HARMONY_CACHE``, else ``~/.cache/loraplex/harmony``,
     else a temporary folder when neither is writable

Any other vocabulary (a tiny test tokenizer, a modified one) builds nothing: ``vocab_from_tokenizer_json``
returns None and harmony can only be loaded from (1).
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tempfile
from functools import lru_cache

logger = logging.getLogger(__name__)

VOCAB_FILE = "o200k_base.tiktoken"
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_RANKS = 199998           # ids 0..199997; the specials start at 199998 (<|startoftext|>)
ENV_BASE = "TIKTOKEN_ENCODINGS_BASE"
ENV_CACHE = "LORAPLEX_HARMONY_CACHE"


class HarmonyVocabError(RuntimeError):
    """No o200k vocabulary could be found or built (the message says why and what to set)."""


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2's ``bytes_to_unicode``): printable bytes stand for
    themselves, the others for code points from 256 up, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def tiktoken_file(ranked: list[bytes]) -> bytes:
    """The ``.tiktoken`` text of token byte strings in rank order."""
    return b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n" for rank, tok in enumerate(ranked))


def vocab_from_tokenizer_json(path: str) -> bytes | None:
    """``o200k_base.tiktoken``'s exact bytes rebuilt from a GPT-OSS ``tokenizer.json``; None when the file holds
    another vocabulary (not byte-level BPE, other ranks, or a hash that is not o200k_base's)."""
    with open(path, encoding="utf-8") as f:
        model = json.load(f).get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or len(vocab) < O200K_RANKS:
        return None
    ranked: list[bytes | None] = [None] * O200K_RANKS
    table = _unicode_to_byte()
    for token, rank in vocab.items():
        if not isinstance(rank, int) or rank >= O200K_RANKS:
            continue
        try:
            ranked[rank] = bytes(table[c] for c in token)
        except KeyError:   # not the byte-level alphabet
            return None
    if any(t is None for t in ranked):
        return None
    data = tiktoken_file(ranked)  # type: ignore[arg-type]
    return data if hashlib.sha256(data).hexdigest() == O200K_BASE_SHA256 else None


def _cache_dirs() -> list[str]:
    if os.environ.get(ENV_CACHE):
        return [os.environ[ENV_CACHE]]
    return [os.path.join(os.path.expanduser("~"), ".cache", "loraplex", "harmony")]


def _file_ok(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest() == O200K_BASE_SHA256


def _write(folder: str, data: bytes) -> str:
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".o200k-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(folder, VOCAB_FILE))   # atomic: concurrent starts never see half a file
    return folder


def find_vocab_dir(model_folder: str | None) -> str:
    """A folder holding a verified ``o200k_base.tiktoken`` (see the module docstring for the order)."""
    base = os.environ.get(ENV_BASE)
    if base:
        if _file_ok(os.path.join(base, VOCAB_FILE)):
            return base
        raise HarmonyVocabError(f"{ENV_BASE}={base} holds no valid {VOCAB_FILE} (sha256 {O200K_BASE_SHA256}); "
                                "fix the folder or unset the variable")
    for folder in _cache_dirs():
        if _file_ok(os.path.join(folder, VOCAB_FILE)):
            return folder
    tokenizer_json = os.path.join(model_folder, "tokenizer.json") if model_folder else None
    if not tokenizer_json or not os.path.isfile(tokenizer_json):
        raise HarmonyVocabError(f"the model folder has no tokenizer.json to build {VOCAB_FILE} from; set "
                                f"{ENV_BASE} to a folder holding it")
    data = vocab_from_tokenizer_json(tokenizer_json)
    if data is None:
        raise HarmonyVocabError(f"the model's tokenizer.json is not the o200k_harmony vocabulary; set {ENV_BASE} to a "
                                f"folder holding {VOCAB_FILE} to render harmony prompts with it")
    for folder in _cache_dirs():
        try:
            return _write(folder, data)
        except OSError as e:
            logger.info("harmony vocabulary cache %s is not writable (%s); using a temporary folder", folder, e)
    return _write(tempfile.mkdtemp(prefix="loraplex-harmony-"), data)
