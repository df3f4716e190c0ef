"""Counters of speculative decoding, per adapter and in all (torch-free; read by ``engine_stats``).

    proposed      draft tokens verified (after the scheduler's cuts)
    accepted      of those, accepted by the target (forced replay: by the plan)
    verified      sequence verifications (one per speculating sequence per verify step)
    emitted       tokens appended by verifications (accepted drafts + the target's own, cut at stops)
    acceptance_length = (accepted + verified) / verified: tokens per verification before stop cuts (1 = none)
    acceptance_rate   = accepted / proposed

Adapters are keyed by id (None: the base model); past ``MAX_ADAPTERS`` records the least recently verified one is
folded into ``other``, so memory stays bounded however many adapters come and go. ``snapshot`` may be called from
another thread (``engine_stats``).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, fields

MAX_ADAPTERS = 1024
ADAPTER_STATS_LIMIT = 16  # adapters listed by name in a snapshot; the rest are summed


@dataclass
class SpecCounts:
    proposed: int = 0
    accepted: int = 0
    verified: int = 0
    emitted: int = 0

    def add(self, other: "SpecCounts") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["acceptance_length"] = (self.accepted + self.verified) / self.verified if self.verified else None
        d["acceptance_rate"] = self.accepted / self.proposed if self.proposed else None
        return d


class SpecDecodeStats:
    def __init__(self) -> None:
        self.total = SpecCounts()
        self.other = SpecCounts()
        self._adapters: OrderedDict[str | None, SpecCounts] = OrderedDict()
        self._lock = threading.Lock()
        self.verify_steps = 0        # engine steps with at least one verification
        self.graph_steps = 0         # of those, served by the padded decode path (CUDA graphs)
        self.propose_s = 0.0         # host time in the proposer (a draft model's forwards included)
        self.verify_s = 0.0          # host time of verify steps' execution (to the tokens on the host)
        self.replay_agreed = 0       # forced replay: verifications where the target's verdict matched the plan
        self.replay_checked = 0

    def record(self, adapter_id: str | None, proposed: int, accepted: int, emitted: int) -> None:
        with self._lock:
            c = self._adapters.pop(adapter_id, None) or SpecCounts()
            self._adapters[adapter_id] = c  # most recent last
            for counts in (c, self.total):
                counts.proposed += proposed
                counts.accepted += accepted
                counts.verified += 1
                counts.emitted += emitted
            if len(self._adapters) > MAX_ADAPTERS:
                _, oldest = self._adapters.popitem(last=False)
                self.other.add(oldest)

    def snapshot(self, limit: int = ADAPTER_STATS_LIMIT) -> dict:
        with self._lock:
            rows = [{"adapter": a, **c.as_dict()} for a, c in self._adapters.items()]
            total = self.total.as_dict()
            rest = SpecCounts()
            rest.add(self.other)
        rows.sort(key=lambda r: (-r["proposed"], str(r["adapter"])))
        for r in rows[limit:]:
            rest.add(SpecCounts(r["proposed"], r["accepted"], r["verified"], r["emitted"]))
        return {**total, "verify_steps": self.verify_steps, "graph_steps": self.graph_steps,
                "propose_ms": self.propose_s * 1e3, "verify_ms": self.verify_s * 1e3,
                "replay_agreement": self.replay_agreed / self.replay_checked if self.replay_checked else None,
                "adapters": rows[:limit], "adapters_other": {"adapters": max(0, len(rows) - limit), **rest.as_dict()}}
