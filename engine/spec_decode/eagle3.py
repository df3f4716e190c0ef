"""EAGLE-3 proposer: a published EAGLE-3 draft (eagle3_draft.py, read by eagle3_checkpoint.py) drafts a chain of k
tokens per step from the target's aux hidden states, with its own paged KV cache.

    the engine runs the target with ``aux_layer_ids``: every computed position's residual stream entering those
    layers (accepted tokens only) reaches the proposer in ``SpecSequence.hidden_states`` [n, 3 H_t]; fc turns each
    row into g_t [H] at once (kept until the draft has run over it)

    per sequence with N tokens x_0 .. x_{N-1} (the target has computed positions 0 .. N - 2):
        catch-up  the draft runs at every position t not yet run, t <= N - 2, on (x_{t+1}, g_t): its K/V at t is
                  written from the target's features (within ``max_batched_tokens`` per step; a sequence still
                  catching up proposes nothing) -> logits at N - 2 -> d_1, prenorm h
        chain     d_j at position N + j - 3 on (d_{j-1}, h), j = 2 .. k -> d_j, h (one-token rows, batched)
    draft KV:  [ target-fed: 0 .. N - 2 | chain: N - 1 .. N + k - 3 ]; only the target-fed part counts as computed,
               so after verification the next catch-up overwrites the chain's K/V with the accepted positions' (a
               rejection rolls back by construction) and the blocks past them are released
    vocabulary: the draft's logits over its V_d ids are scattered to the target's ids through d2t (-inf elsewhere);
               greedy requests: argmax; sampling requests: drawn with the request's generator under its sampling
               controls, ``Proposal.probs`` over the target's vocabulary (0 outside the draft's)

A sequence whose target features start after position 0 (a prefix-cache hit skipped the target's forward there)
drafts over the positions it has: its draft KV starts at that position (``_State.offset``). One draft serves every
adapter: the target's LoRA shapes the aux states it reads.
"""
from __future__ import annotations

import time

import torch

from loraplex.engine.sequence import Sequence
from loraplex.engine.spec_decode.batch_inputs import paged_batch
from loraplex.engine.spec_decode.draft_model import DraftKVPool, draw_drafts
from loraplex.engine.spec_decode.eagle3_draft import Eagle3Draft
from loraplex.engine.spec_decode.proposer import Proposal, Proposer, SpecSequence


class Eagle3Runner:
    """The draft network, its KV pool and the target's embedding (``kv``: the pool's ``KVCacheManager``)."""

    def __init__(self, draft: Eagle3Draft, target_model, pool: DraftKVPool, *, block_size: int) -> None:
        self.draft, self.target, self.block_size = draft, target_model, block_size
        self.kv, self.kv_caches = pool.kv, pool.kv_caches
        self.device = draft.fc.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        own = self.draft.embed_tokens
        return (own if own is not None else self.target.model.embed_tokens)(ids).to(self.draft.fc.weight.dtype)

    @torch.inference_mode()
    def forward(self, entries: list[tuple[list[int], int, list[int]]], offsets: list[int],
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries (tokens, first slot, block ids) at positions slot + offset, with their hidden rows [T, H] ->
        (normed, prenorm) [T, H]."""
        batch = paged_batch(entries, self.block_size, self.device)
        positions = batch.positions
        if any(offsets):
            shift = torch.cat([torch.full((len(t),), o, dtype=torch.int64) for (t, _, _), o in zip(entries, offsets)])
            positions = positions + shift.to(positions.device)
        return self.draft(positions, self.embed(batch.input_ids), hidden, batch.attn, self.kv_caches[0])


class _State:
    __slots__ = ("seq", "offset", "pending")

    def __init__(self, seq: Sequence, offset: int) -> None:
        self.seq = seq            # the draft's own Sequence: block table; num_computed_tokens = target-fed slots
        self.offset = offset      # the position of slot 0
        self.pending: torch.Tensor | None = None  # g [m, H] of positions offset + computed .. (not run yet)

    @property
    def next_position(self) -> int:
        """The first position without a target feature."""
        m = 0 if self.pending is None else self.pending.shape[0]
        return self.offset + self.seq.num_computed_tokens + m


class Eagle3Proposer(Proposer):
    name = "eagle3"
    needs_hidden_states = True

    def __init__(self, runner: Eagle3Runner, aux_layer_ids: tuple[int, ...], *, k: int, vocab_size: int,
                 max_batched_tokens: int) -> None:
        self.runner = runner
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.k, self.vocab_size, self.max_batched_tokens = k, vocab_size, max_batched_tokens
        self._states: dict[int, _State] = {}
        self.num_forwards = 0
        self.num_catchup_tokens = 0
        self.num_missing = 0      # candidates whose target features do not reach N - 2
        self.forward_s = 0.0

    # ---- state --------------------------------------------------------------------------------------------
    def _take(self, batch: list[SpecSequence]) -> None:
        """fc (after the draft's aux norms, ``Eagle3Draft.combine``) over every candidate's new aux rows (one batched
        projection), appended to its pending features."""
        rows = [s for s in batch if s.hidden_states is not None and s.hidden_states.shape[0]]
        if not rows:
            return
        w = self.runner.draft.fc.weight
        with torch.inference_mode():
            g = self.runner.draft.combine(torch.cat([s.hidden_states for s in rows]).to(w.dtype))
        first = 0
        for s in rows:
            n = s.hidden_states.shape[0]
            self._append(s, s.hidden_start, g[first:first + n])
            first += n

    def _append(self, s: SpecSequence, start: int, g: torch.Tensor) -> None:
        st = self._states.get(s.seq_id)
        if st is not None and not st.offset <= start <= st.next_position:
            self.release(s.seq_id)  # a gap, or features from before its first: start over from these
            st = None
        if st is None:
            st = self._states[s.seq_id] = _State(Sequence(s.seq_id, s.request_id, []), start)
        elif start < st.next_position:  # positions given again: what was kept from them is stale
            keep = start - st.offset
            if keep < st.seq.num_computed_tokens:
                st.seq.num_computed_tokens, st.pending = keep, None
            else:
                st.pending = st.pending[:keep - st.seq.num_computed_tokens]
        st.pending = g if st.pending is None or not st.pending.shape[0] else torch.cat([st.pending, g])

    def release(self, seq_id: int) -> None:
        st = self._states.pop(seq_id, None)
        if st is not None:
            self.runner.kv.free(st.seq)

    @property
    def num_sequences(self) -> int:
        return len(self._states)

    # ---- propose ------------------------------------------------------------------------------------------
    def propose(self, batch: list[SpecSequence]) -> list[Proposal | None]:
        t0 = time.perf_counter()
        self._take(batch)
        kv = self.runner.kv
        out: list[Proposal | None] = [None] * len(batch)
        budget = self.max_batched_tokens
        entries, offsets, feats = [], [], []
        active: list[tuple[int, SpecSequence, _State, int, int]] = []  # (batch index, entry, state, k, its row)
        for i, s in enumerate(batch):
            st = self._states.get(s.seq_id)
            n = s.seq.num_tokens
            if st is None or st.next_position != n - 1:
                self.num_missing += 1
                continue
            k = min(self.k, s.num_draft_tokens)
            computed = st.seq.num_computed_tokens
            kv.trim(st.seq, computed)  # the last chain's slots
            m = st.pending.shape[0]
            todo = min(m, budget)
            if todo < 1 or not kv.allocate_slots(st.seq, todo + (k - 1 if todo == m else 0)):
                continue
            budget -= todo
            start = st.offset + computed
            entries.append((s.seq.token_ids_slice(start + 1, start + todo + 1), computed, list(st.seq.block_ids)))
            offsets.append(st.offset)
            feats.append(st.pending[:todo])
            st.seq.num_computed_tokens = computed + todo
            st.pending = st.pending[todo:]
            self.num_catchup_tokens += todo
            if todo == m:
                active.append((i, s, st, k, sum(len(e[0]) for e in entries) - 1))
        if not entries:
            self.forward_s += time.perf_counter() - t0
            return out
        normed, prenorm = self.runner.forward(entries, offsets, torch.cat(feats))
        self.num_forwards += 1
        rows = torch.tensor([a[4] for a in active], dtype=torch.int64, device=normed.device)
        self._chain(active, normed[rows], prenorm[rows], out)
        self.forward_s += time.perf_counter() - t0
        return out

    def _chain(self, active: list, normed: torch.Tensor, h: torch.Tensor, out: list) -> None:
        """Draw d_1 from ``normed`` rows, then the one-token chain steps, for every caught-up sequence."""
        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        live = list(range(len(active)))
        step = 0
        while live:
            logits = self.runner.draft.target_logits(normed, self.vocab_size)
            tokens, q = draw_drafts(logits, [active[a][1] for a in live], self.vocab_size)
            for a, t, qa in zip(live, tokens, q):
                drafts[a].append(t)
                if qa is not None:
                    probs[a].append(qa)
            step += 1
            keep = [j for j, a in enumerate(live) if len(drafts[a]) < active[a][3]]
            if not keep:
                break
            live = [live[j] for j in keep]
            h = h[torch.tensor(keep, dtype=torch.int64, device=h.device)]
            entries = []
            for a in live:
                _, s, st, _, _ = active[a]
                slot = s.seq.num_tokens - 2 + step - st.offset  # d_step at position N - 2 + step
                entries.append(([drafts[a][-1]], slot, list(st.seq.block_ids)))
            normed, h = self.runner.forward(entries, [active[a][2].offset for a in live], h)
            self.num_forwards += 1
        for a, (i, _, _, _, _) in enumerate(active):
            out[i] = Proposal(drafts[a], torch.stack(probs[a]) if probs[a] else None)

    def stats(self) -> dict:
        kv = self.runner.kv
        return {"sequences": len(self._states), "forwards": self.num_forwards,
                "catchup_tokens": self.num_catchup_tokens, "missing_features": self.num_missing,
                "kv_blocks_total": kv.num_blocks, "kv_blocks_free": kv.num_free_blocks,
                "forward_ms": self.forward_s * 1e3}

    def close(self) -> None:
        for seq_id in list(self._states):
            self.release(seq_id)
