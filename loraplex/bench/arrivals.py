"""Open-loop send times: a steady rate, fixed or Poisson (seeded, so a run and its repeat send at the same times).

    arrival_times(rate=2.0, duration=10.0, kind="poisson", seed=0)   # [0.31, 0.52, ...] seconds from the start
"""
from __future__ import annotations

import random


def arrival_times(*, rate: float, duration: float, kind: str = "poisson", seed: int = 0,
                  limit: int | None = None) -> list[float]:
    """Send offsets in [0, duration): every 1/rate s from 0 (``fixed``) or exponential gaps of mean 1/rate
    (``poisson``); at most ``limit`` of them; at least one (at 0) so a short window still sends a request."""
    if rate <= 0 or duration <= 0:
        raise ValueError(f"need rate > 0 and duration > 0, got {rate} and {duration}")
    if kind not in ("poisson", "fixed"):
        raise ValueError(f"arrival kind {kind!r} is not supported; choose poisson or fixed")
    times: list[float] = []
    rng = random.Random(seed)
    t = 0.0 if kind == "fixed" else rng.expovariate(rate)
    while t < duration and (limit is None or len(times) < limit):
        times.append(t)
        t = len(times) / rate if kind == "fixed" else t + rng.expovariate(rate)  # fixed: k / rate, no drift
    return times or [0.0]
