"""GCRA arithmetic (the generic cell rate algorithm), in plain Python; ``lua_scripts.py`` does the same in Lua.

A limit of R units per minute with burst B keeps one number per tenant, the theoretical arrival time ``tat``:

    T = 60 / R               emission interval (seconds per unit)
    tau = B * T              tolerance: how far ahead of now tat may run
    cost n at time now:      new_tat = max(tat, now) + n * T
                             allowed  iff  new_tat - now <= tau      (else retry after new_tat - tau - now)
    remaining (after)        floor((tau - (new_tat - now)) / T)
    reset (full again in)    new_tat - now
    refund u units           tat = max(tat - u * T, now)
    charge c units after     tat = max(tat, now) + c * T   (no check: a request that used more than it reserved
                                                          pays the rest; later requests wait for it)

From idle, exactly B units pass at once; afterwards one unit per T.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GcraResult:
    allowed: bool
    new_tat: float          # the tat to store if the whole request is admitted
    retry_after_s: float    # 0 when allowed
    remaining: int          # after the reservation when allowed; at ``now`` when denied
    reset_s: float          # until the bucket is full again


def gcra_check(tat: float | None, now: float, cost: int, interval_s: float, burst: int) -> GcraResult:
    """Check ``cost`` units against a bucket whose stored theoretical arrival time is ``tat`` (None: idle)."""
    tau = burst * interval_s
    base = now if tat is None or tat < now else tat
    new_tat = base + cost * interval_s
    excess = new_tat - now - tau
    if excess > 1e-9:
        return GcraResult(False, base, excess, _remaining(base, now, tau, interval_s), base - now)
    return GcraResult(True, new_tat, 0.0, _remaining(new_tat, now, tau, interval_s), new_tat - now)


def _remaining(tat: float, now: float, tau: float, interval_s: float) -> int:
    return max(0, int(math.floor((tau - (tat - now)) / interval_s + 1e-9)))


def gcra_refund(tat: float | None, now: float, units: int, interval_s: float) -> float | None:
    """The tat after giving back ``units`` (never earlier than now: a full bucket holds no credit)."""
    if tat is None:
        return None
    return max(tat - units * interval_s, now)


def gcra_charge(tat: float | None, now: float, units: int, interval_s: float) -> float:
    """The tat after taking ``units`` more without a check (tokens used past a request's reservation)."""
    base = now if tat is None or tat < now else tat
    return base + units * interval_s
