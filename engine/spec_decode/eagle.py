"""EAGLE-style proposer: a draft head (eagle_head.py) on the target's own final hidden states drafts k tokens per
step, with the target's embedding and ``lm_head``; no draft model, no draft KV cache.

    the engine gives each candidate the target's hidden rows computed since it was last proposed for (accepted
    tokens only: ``SpecSequence.hidden_states`` from ``hidden_start``); the proposer keeps the last one, f at
    position p, per sequence
    propose, per sequence with N tokens (x_{N-1} not computed yet), when p == N - 2:
        f_1 = head(f, embed(x_{N-1}))   d_1 = draw(lm_head(f_1))       position N
        f_j = head(f_{j-1}, embed(d_{j-1}))   d_j = draw(lm_head(f_j)),  j = 2 .. k
    batched over the sequences; greedy requests: argmax; sampling requests: drawn with the request's generator from
    the head's distribution under its sampling controls (``Proposal.probs``, rejection sampling)

A sequence whose feature at N - 2 is not known (e.g. its prefill ran before it could speculate) proposes nothing
that step. The target's LoRA shapes the hidden states a head reads. Per-adapter heads (``adapter_heads``: adapter
id -> a head trained on the target's hidden states under that adapter) draft for that adapter's sequences; the
rest use the shared head. Each group of one head drafts batched.
"""
from __future__ import annotations

import time

import torch

from loraplex.engine.spec_decode.draft_model import draw_drafts
from loraplex.engine.spec_decode.eagle_head import EagleHead
from loraplex.engine.spec_decode.proposer import Proposal, Proposer, SpecSequence


class EagleProposer(Proposer):
    name = "eagle"
    needs_hidden_states = True

    def __init__(self, head: EagleHead, target_model, *, k: int, vocab_size: int,
                 adapter_heads: dict[str, EagleHead] | None = None) -> None:
        self.heads: dict[str | None, EagleHead] = {None: head, **(adapter_heads or {})}
        self.target = target_model  # CausalLM: model.embed_tokens, compute_logits
        self.k, self.vocab_size = k, vocab_size
        self._feature: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (position, f [H])
        self.num_forwards = 0
        self.num_missing = 0       # candidates without their feature at N - 2
        self.forward_s = 0.0

    def _take(self, s: SpecSequence) -> None:
        if s.hidden_states is not None and s.hidden_states.shape[0]:
            self._feature[s.seq_id] = (s.hidden_start + s.hidden_states.shape[0] - 1, s.hidden_states[-1])

    @torch.inference_mode()
    def propose(self, batch: list[SpecSequence]) -> list[Proposal | None]:
        t0 = time.perf_counter()
        out: list[Proposal | None] = [None] * len(batch)
        groups: dict[str | None, list[tuple[int, torch.Tensor, int]]] = {}  # head key -> (batch index, f, x)
        for i, s in enumerate(batch):
            self._take(s)
            n = s.seq.num_tokens
            known = self._feature.get(s.seq_id)
            if known is None or known[0] != n - 2:
                self.num_missing += 1
                continue
            adapter_id = getattr(s.adapter, "adapter_id", None)
            key = adapter_id if adapter_id in self.heads else None
            groups.setdefault(key, []).append((i, known[1], s.seq.token_ids_slice(n - 1, n)[0]))
        for key, rows in groups.items():
            entries = [batch[i] for i, _, _ in rows]
            proposals = self._draft(self.heads[key], entries, torch.stack([f for _, f, _ in rows]),
                                    [x for _, _, x in rows])
            for (i, _, _), p in zip(rows, proposals):
                out[i] = p
        self.forward_s += time.perf_counter() - t0
        return out

    def _draft(self, head: EagleHead, entries: list[SpecSequence], f: torch.Tensor,
               tokens: list[int]) -> list[Proposal]:
        """k drafts for each entry from its feature f [B, H] and last token (module docstring)."""
        f = f.to(next(head.parameters()).dtype)
        device = f.device
        ks = [min(self.k, s.num_draft_tokens) for s in entries]
        drafts: list[list[int]] = [[] for _ in entries]
        probs: list[list[torch.Tensor]] = [[] for _ in entries]
        live = list(range(len(entries)))
        x = torch.tensor(tokens, dtype=torch.int64, device=device)
        while live:
            f = head(f, self.target.model.embed_tokens(x).to(f.dtype))
            logits = self.target.compute_logits(f.to(self.target.lm_head.weight.dtype))
            self.num_forwards += 1
            drawn, q = draw_drafts(logits, [entries[a] for a in live], self.vocab_size)
            for a, t, qa in zip(live, drawn, q):
                drafts[a].append(t)
                if qa is not None:
                    probs[a].append(qa)
            keep = [j for j, a in enumerate(live) if len(drafts[a]) < ks[a]]
            if not keep:
                break
            f = f[torch.tensor(keep, dtype=torch.int64, device=device)]
            x = torch.tensor([drawn[j] for j in keep], dtype=torch.int64, device=device)
            live = [live[j] for j in keep]
        return [Proposal(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def release(self, seq_id: int) -> None:
        self._feature.pop(seq_id, None)

    @property
    def num_sequences(self) -> int:
        return len(self._feature)

    def stats(self) -> dict:
        return {"sequences": len(self._feature), "forwards": self.num_forwards, "missing_features": self.num_missing,
                "forward_ms": self.forward_s * 1e3}

    def close(self) -> None:
        self._feature.clear()
