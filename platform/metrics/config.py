"""MetricsConfig: label caps, histogram buckets and the dashboard window of ``PlatformMetrics``."""
from __future__ import annotations

from dataclasses import dataclass

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ADAPTER_LOAD_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _check_buckets(name: str, buckets: tuple[float, ...]) -> None:
    if not buckets or any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"{name} must be non-empty, positive and strictly increasing, got {buckets!r}")


@dataclass(frozen=True)
class MetricsConfig:
    """``max_adapter_labels``: distinct values of the ``adapter`` label, ``_other`` included (the top adapters by
    traffic keep their name). ``max_tenant_labels``: distinct ``tenant`` values; the first tenants seen keep their
    name, later ones count as ``_other`` (tenants are few and long-lived, adapters are many)."""

    namespace: str = "loraplex"
    max_adapter_labels: int = 100
    max_tenant_labels: int = 1000
    ttft_buckets_s: tuple[float, ...] = TTFT_BUCKETS_S
    tpot_buckets_s: tuple[float, ...] = TPOT_BUCKETS_S
    e2e_buckets_s: tuple[float, ...] = E2E_BUCKETS_S
    adapter_load_buckets_s: tuple[float, ...] = ADAPTER_LOAD_BUCKETS_S
    window_horizon_s: int = 900        # dashboard: seconds of per-second history kept in memory
    max_recent_uploads: int = 20       # dashboard: finished uploads listed beside those in flight

    def __post_init__(self) -> None:
        if not self.namespace.replace("_", "").isalnum():
            raise ValueError(f"namespace must be letters, digits and underscores, got {self.namespace!r}")
        for name in ("max_adapter_labels", "max_tenant_labels"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 (one named value and '_other'), got {getattr(self, name)}")
        for name in ("ttft_buckets_s", "tpot_buckets_s", "e2e_buckets_s", "adapter_load_buckets_s"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            _check_buckets(name, getattr(self, name))
        if self.window_horizon_s < 60:
            raise ValueError(f"window_horizon_s must be >= 60, got {self.window_horizon_s}")
