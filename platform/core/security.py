"""Tenant API keys: ``lpx_<prefix>_<secret>``. Only an HMAC of the whole key is stored; the prefix (public, unique)
finds the row. The key is shown once, when it is issued."""
from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_SCHEME = "lpx"
PREFIX_CHARS = 10


def new_api_key() -> tuple[str, str]:
    """(full key, public prefix)."""
    prefix = secrets.token_hex(PREFIX_CHARS // 2)
    return f"{KEY_SCHEME}_{prefix}_{secrets.token_urlsafe(32)}", prefix


def key_prefix(key: str) -> str | None:
    """The public prefix of a well-formed key, else None."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_SCHEME or len(parts[1]) != PREFIX_CHARS:
        return None
    return parts[1]


def hash_api_key(key: str, secret: str) -> str:
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()


def verify_api_key(key: str, stored_hash: str, secret: str) -> bool:
    return hmac.compare_digest(hash_api_key(key, secret), stored_hash)


def same_secret(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
