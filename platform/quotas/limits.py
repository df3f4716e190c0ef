"""QuotaLimits: one tenant's limits, resolved (tenant row, else the platform's defaults). None = unlimited."""
from __future__ import annotations

from dataclasses import dataclass

MINUTE_S = 60.0


def _check_positive(name: str, value: int | float | None, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number{' or None (unlimited)' if allow_none else ''}, "
                         f"got {value!r}")


@dataclass(frozen=True)
class QuotaLimits:
    """Per-tenant limits enforced on every inference request.

    GCRA (a leaky bucket kept as one timestamp): ``requests_per_minute`` refills one request every 60/rpm s; up
    to ``request_burst`` requests pass at once from idle (default: a full minute's worth, rpm). The same for
    tokens, where one request costs ``prompt + max_tokens`` tokens up front and gets the unused part back.
    ``max_concurrency`` caps leases held at once; a lease not released within ``lease_ttl_s`` (its holder died)
    expires. ``tokens_per_day`` caps reserved tokens per UTC day.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrency: int | None = None
    tokens_per_day: int | None = None
    request_burst: int | None = None   # default: requests_per_minute
    token_burst: int | None = None     # default: tokens_per_minute
    lease_ttl_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrency", "tokens_per_day",
                     "request_burst", "token_burst"):
            value = getattr(self, name)
            _check_positive(name, value)
            if value is not None and not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        _check_positive("lease_ttl_s", self.lease_ttl_s, allow_none=False)
        if self.request_burst is not None and self.requests_per_minute is None:
            raise ValueError("request_burst needs requests_per_minute; set both or neither")
        if self.token_burst is not None and self.tokens_per_minute is None:
            raise ValueError("token_burst needs tokens_per_minute; set both or neither")

    @property
    def effective_request_burst(self) -> int | None:
        return self.request_burst or self.requests_per_minute

    @property
    def effective_token_burst(self) -> int | None:
        return self.token_burst or self.tokens_per_minute

    @property
    def request_interval_s(self) -> float | None:
        """GCRA emission interval of one request (seconds), or None when unlimited."""
        return MINUTE_S / self.requests_per_minute if self.requests_per_minute else None

    @property
    def token_interval_s(self) -> float | None:
        """GCRA emission interval of one token (seconds), or None when unlimited."""
        return MINUTE_S / self.tokens_per_minute if self.tokens_per_minute else None

    @property
    def unlimited(self) -> bool:
        return not any((self.requests_per_minute, self.tokens_per_minute, self.max_concurrency,
                        self.tokens_per_day))

    @staticmethod
    def scheduling_weight(tenant: object, defaults: object | None = None) -> float:
        """The tenant's weight in the engines' tenant-fair scheduling: its ``scheduling_weight``, else
        ``defaults.default_scheduling_weight``, else 1."""
        value = getattr(tenant, "scheduling_weight", None)
        if value is None and defaults is not None:
            value = getattr(defaults, "default_scheduling_weight", None)
        return float(value) if value is not None else 1.0

    @classmethod
    def resolve(cls, tenant: object, defaults: object | None = None, **kw) -> "QuotaLimits":
        """From a tenant row's ``requests_per_minute``/``tokens_per_minute``/``max_concurrency``/``tokens_per_day``,
        each null one taken from ``defaults``' ``default_<name>`` (the platform Settings). The admin API refuses
        limits below 1; a stored 0 or less (written before it did) is read as 1, the most restrictive limit, rather
        than failing every request of the tenant."""
        values = {}
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrency", "tokens_per_day"):
            value = getattr(tenant, name, None)
            if value is None and defaults is not None:
                value = getattr(defaults, f"default_{name}", None)
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                value = 1
            values[name] = value
        return cls(**values, **kw)
