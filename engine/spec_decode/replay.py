"""Replay proposer (benchmarks only): proposes the tokens a recorded non-speculative run produced for the same
prompt, at a set acceptance rate, to measure the real cost of proposing and verifying at a chosen acceptance
length where acceptance itself means nothing (dummy weights).

    recording: prompt token ids -> the output token ids of a non-speculative run (``ReplayProposer.record``)
    a sequence at output position j with k drafts:
        L = leading successes of k Bernoulli(rate) draws (the planned number of accepted drafts)
        drafts = rec[j : j + L] + [a wrong token] + rec[j + L + 1 : j + k]     (always k tokens: the verify costs
                                                                               what it would with real drafts)
    with ``replay_forced`` the verifier accepts exactly L drafts and appends rec[j + L] as the target's token,
    whatever the target's logits say (they are still computed, sampled and compared: ``agreement``), so the run
    reproduces the recording token for token at mean acceptance length 1 + rate + ... + rate^k; without it the
    target decides (lossless; on exact float32 numerics it agrees with the plan).
    Forced replay also fixes every token a recorded sequence samples without drafts (the prefill's first token, a
    decode with no room for a draft): ``recorded_token`` gives rec[j] and the decoder keeps it in place of the
    target's own (still computed and discarded), so on a GPU, where bf16 numerics and near-flat dummy logits make
    the target's argmax differ from the recording's, a sequence never leaves its recording.

A sequence whose prompt is not in the recording, or that has left its recording, gets no proposal.
"""
from __future__ import annotations

import torch

from loraplex.engine.spec_decode.proposer import Proposal, Proposer, SpecSequence, Verified


class ReplayProposer(Proposer):
    name = "replay"

    def __init__(self, k: int, rate: float, *, vocab_size: int, forced: bool = True, seed: int = 0) -> None:
        self.k, self.rate, self.forced, self.vocab_size = k, rate, forced, vocab_size
        self._recording: dict[tuple[int, ...], list[int]] = {}
        self._cursor: dict[int, list] = {}  # seq_id -> [its recording, outputs already found on it]
        self._gen = torch.Generator().manual_seed(seed)
        self.num_planned_accepted = 0
        self.num_proposed = 0
        self.num_missing = 0

    def record(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        """Keep a non-speculative run's output for ``prompt_token_ids`` (the last one recorded wins)."""
        self._recording[tuple(prompt_token_ids)] = list(output_token_ids)
        self._cursor.clear()

    @property
    def num_recorded(self) -> int:
        return len(self._recording)

    def recorded_token(self, seq) -> int | None:
        """Forced replay: the recording's token at ``seq``'s next output position while ``seq`` is on its recording
        (None when not forced, not recorded, off the recording or past its end)."""
        if not self.forced:
            return None
        rec = self._recording.get(tuple(seq.prompt_token_ids))
        j = seq.num_output_tokens
        if rec is None or len(rec) <= j or rec[:j] != seq.output_token_ids:
            return None
        return rec[j]

    def _on_recording(self, seq) -> list[int] | None:
        """``seq``'s recording while its outputs are a prefix of it (else None). Each output token is compared
        once: the cursor remembers how many were found on the recording (a step appends a few)."""
        cur = self._cursor.get(seq.seq_id)
        if cur is None:
            cur = self._cursor[seq.seq_id] = [self._recording.get(tuple(seq.prompt_token_ids)), 0]
        rec, checked = cur
        out = seq.output_token_ids
        j = len(out)
        if rec is None or len(rec) <= j:
            return None
        if j < checked:  # outputs were dropped (a stop string): compare again from the start
            checked = 0
        if rec[checked:j] != out[checked:j]:
            return None
        cur[1] = j
        return rec

    def propose(self, batch: list[SpecSequence]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        hits_all = (torch.rand(len(batch), self.k, generator=self._gen) < self.rate).tolist() if batch else []
        for s, draws in zip(batch, hits_all):
            seq = s.seq
            rec = self._on_recording(seq)
            if rec is None:
                self.num_missing += 1
                out.append(None)
                continue
            j = seq.num_output_tokens
            k = min(self.k, s.num_draft_tokens, len(rec) - j - 1)
            if k < 1:
                out.append(None)
                continue
            hits = draws[:k]
            planned = hits.index(False) if False in hits else k
            drafts = rec[j:j + k]
            if planned < k:
                drafts[planned] = (drafts[planned] + 1) % self.vocab_size  # a token the recording did not produce
            self.num_proposed += k
            self.num_planned_accepted += planned
            out.append(Proposal(drafts, planned_num_accepted=planned if self.forced else None,
                                planned_tokens=rec[j:j + planned + 1] if self.forced else None))
        return out

    def release(self, seq_id: int) -> None:
        self._cursor.pop(seq_id, None)

    def observe(self, verified: list[Verified]) -> None:
        pass

    def stats(self) -> dict:
        return {"recorded": len(self._recording), "proposed": self.num_proposed,
                "planned_accepted": self.num_planned_accepted, "no_recording": self.num_missing,
                "rate": self.rate, "forced": self.forced}
