"""Rendezvous (highest-random-weight) hashing: every key ranks every replica by a hash of (key, replica); the
top replica owns the key. Adding or removing a replica moves only the keys it wins or owned."""
from __future__ import annotations

import hashlib
from typing import Iterable


def hrw_score(key: str, replica_id: str) -> int:
    """A stable 64-bit weight of ``replica_id`` for ``key`` (the same in every process, unlike ``hash()``)."""
    digest = hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def hrw_rank(key: str, replica_ids: Iterable[str]) -> list[str]:
    """Replica ids best first for ``key``."""
    return sorted(replica_ids, key=lambda r: (-hrw_score(key, r), r))
