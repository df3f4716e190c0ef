"""``EngineNotifier``: the control plane tells engines to drop an adapter version it deleted, and to warm the version
an alias now names (rollback, promotion), so its first request finds it loaded. The gateway wires an implementation
that reaches real engine replicas; the default does nothing, the in-memory one records."""
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


@dataclass(frozen=True)
class Promotion:
    """An alias of an adapter now names ``version_id`` instead of ``previous_version_id`` (None: a new alias).
    Engines that hold the previous version load the new one ahead of its first request."""

    tenant_id: str
    adapter_name: str
    alias: str
    version_id: str
    previous_version_id: str | None


@runtime_checkable
class EngineNotifier(Protocol):
    def evict(self, evictions: list[Eviction]) -> None:
        """Best effort, after the registry change is committed; must not raise for an unreachable engine."""

    def promote(self, promotions: list[Promotion]) -> None:
        """Best effort, after the alias move is committed; returns at once (the loads run in the background)."""


class NoopNotifier:
    """No engines to tell (the registry alone)."""

    def evict(self, evictions: list[Eviction]) -> None:
        return None

    def promote(self, promotions: list[Promotion]) -> None:
        return None


@dataclass
class InMemoryNotifier:
    """Records evictions and promotions (tests, and the embedded engine's poller)."""

    evicted: list[Eviction] = field(default_factory=list)
    promoted: list[Promotion] = field(default_factory=list)

    def evict(self, evictions: list[Eviction]) -> None:
        self.evicted.extend(evictions)

    def promote(self, promotions: list[Promotion]) -> None:
        self.promoted.extend(promotions)


def promote(notifier: EngineNotifier, promotions: list[Promotion]) -> None:
    """``notifier.promote`` when it has one (notifiers written before promotions existed only evict)."""
    fn = getattr(notifier, "promote", None)
    if fn is not None and promotions:
        fn(promotions)
