"""N-gram (prompt lookup) proposer: no model. The longest suffix of the sequence (``ngram_max`` down to
``ngram_min`` tokens) that occurred earlier in its prompt or output proposes the tokens that followed its most
recent earlier occurrence.

    tokens:  ... a b c d e ... x y a b c | ?          suffix "a b c" (n = 3) last occurred at i
                       ^ i                           proposal: d e ... (up to k tokens after it)

Each sequence keeps its tokens in a growing numpy buffer (appended incrementally, so a step costs the new tokens
plus one vectorised comparison per n, not a copy of the whole history). Drafts are deterministic (q one-hot).
"""
from __future__ import annotations

import numpy as np

from loraplex.engine.spec_decode.proposer import Proposal, Proposer, SpecSequence


class _History:
    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, seq) -> np.ndarray:
        """The sequence's tokens as an array view (rebuilt if they changed other than by appending)."""
        total = seq.num_tokens
        if total < self.n:
            self.n = 0
        if total > self.buf.shape[0]:
            grown = np.empty(max(total, 2 * self.buf.shape[0]), dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if total > self.n:
            self.buf[self.n:total] = seq.token_ids_slice(self.n, total)
            self.n = total
        return self.buf[:total]


def find_continuation(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    total = tokens.shape[0]
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)  # starts 0 .. total - 1 - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, k: int, n_min: int = 1, n_max: int = 4) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self._hist: dict[int, _History] = {}
        self.num_lookups = 0
        self.num_hits = 0

    def propose(self, batch: list[SpecSequence]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for s in batch:
            hist = self._hist.get(s.seq_id)
            if hist is None:
                hist = self._hist[s.seq_id] = _History()
            tokens = hist.sync(s.seq)
            self.num_lookups += 1
            draft = find_continuation(tokens, min(self.k, s.num_draft_tokens), self.n_min, self.n_max)
            if draft:
                self.num_hits += 1
            out.append(Proposal(draft) if draft else None)
        return out

    def release(self, seq_id: int) -> None:
        self._hist.pop(seq_id, None)

    def stats(self) -> dict:
        return {"lookups": self.num_lookups, "hits": self.num_hits, "sequences": len(self._hist)}
