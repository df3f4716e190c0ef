"""Replica: what the router knows about one engine replica (load, health, resident adapters)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Replica:
    """One engine replica. ``client`` is whatever the caller talks to it with (an ``EngineClient``)."""

    replica_id: str
    client: Any = None
    in_flight: int = 0
    down_until: float = 0.0          # monotonic time before which the replica is skipped (0: healthy)
    awaiting_probe: bool = False     # down until a health probe answers (RouterConfig.probe_interval_s set)
    consecutive_failures: int = 0
    failures: int = 0                # every mark down so far: a probe begun before the last one cannot clear it
    resident: frozenset[str] = field(default_factory=frozenset)   # adapter ids in its GPU/CPU tiers

    def __post_init__(self) -> None:
        if not isinstance(self.replica_id, str) or not self.replica_id:
            raise ValueError(f"replica_id must be a non-empty string, got {self.replica_id!r}")

    def is_up(self, now: float) -> bool:
        return not self.awaiting_probe and now >= self.down_until
