"""``EngineNotifier``: the control plane tells engines to drop an adapter version it deleted. The gateway
wires an implementation that reaches real engine replicas; the default does nothing, the in-memory one records."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Eviction:
    """An adapter version that engines must stop serving and drop from every cache tier."""

    tenant_id: str
    adapter_name: str
    version_id: str
    sha256: str | None


@runtime_checkable
class EngineNotifier(Protocol):
    def evict(self, evictions: list[Eviction]) -> None:
        """Best effort, after the registry change is committed; must not raise for an unreachable engine."""


class NoopNotifier:
    """No engines to tell (the registry alone)."""

    def evict(self, evictions: list[Eviction]) -> None:
        return None


@dataclass
class InMemoryNotifier:
    """Records evictions (tests, and the embedded engine's poller)."""

    evicted: list[Eviction] = field(default_factory=list)

    def evict(self, evictions: list[Eviction]) -> None:
        self.evicted.extend(evictions)
