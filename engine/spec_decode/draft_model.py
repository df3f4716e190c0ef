"""Draft-model proposer: a small causal LM that shares the target's tokenizer proposes k tokens per step,
autoregressively and batched over the speculating sequences, from its own paged KV cache.

    draft runner: the engine's own model code and loader (any family the engine implements), its own K/V tensors,
                  its own KVCacheManager (no prefix caching); one shadow ``Sequence`` per target sequence holds
                  its block table and how many of the target's tokens have draft K/V
    propose, per sequence with N tokens:
        sync      draft K/V at positions >= P (the drafts proposed last step, computed while drafting) is valid
                  only as far as the target accepted them: computed = P + (leading drafts equal to the target's
                  tokens there), at most N - 1 (the last token is always computed again, for its logits)
        forward 1 the tokens [computed, N) of every sequence (catch-up: the last one or two after a verify, a
                  chunk of the prompt at first, within ``draft_max_batched_tokens`` per step; a sequence still
                  catching up proposes nothing this step) -> logits at N - 1 -> d1
        forward j d_{j-1} at position N + j - 2 for every sequence still drafting (one token each: the padded
                  decode path, CUDA graphs on a GPU) -> d_j, for j = 2 .. k
        d_1 .. d_{k-1} now have draft K/V: kept if the target accepts them, overwritten otherwise
    greedy requests: argmax drafts (no probabilities); sampling requests: drafts drawn with the request's generator
    from the draft's distribution under the request's temperature / top-k / top-p / min-p and logit_bias, which is
    returned as ``Proposal.probs`` for rejection sampling

The draft's vocabulary may be larger than the target's (ids past the target's are never drafted) or smaller
(the target's extra ids get draft probability 0).

Per-adapter drafts (``lora_max_rank`` set): multi-LoRA is attached to the draft model as the target runner attaches
it (``LoRASlots``, before the decode graphs are captured, so they hold its kernels), and ``DraftAdapters``
(draft_lora.py) maps a target adapter to the resident slot of its draft LoRA. Every draft forward routes each row to
its sequence's slot (-1: the bare draft), so one propose step mixes adapters with and without a draft LoRA.
"""
from __future__ import annotations

import logging
import time

import torch

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sampler import Sampler
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec_decode import rejection
from loraplex.engine.spec_decode.batch_inputs import DecodeRow, RowStep, paged_batch
from loraplex.engine.spec_decode.draft_lora import DraftAdapters
from loraplex.engine.spec_decode.proposer import Proposal, Proposer, SpecSequence

logger = logging.getLogger(__name__)

CUDA_DRAFT_KV_FRACTION = 0.5  # of the memory free after the draft's weights, at most, for its KV pool


class DraftKVPool:
    """A draft's own paged KV: one (k, v) pair per layer, each [num_blocks, block_size, KV, D], and the
    ``KVCacheManager`` of its blocks (no prefix caching). ``num_blocks`` None: ``max_num_seqs`` full sequences,
    at most the target pool's tokens, on CUDA at most ``CUDA_DRAFT_KV_FRACTION`` of the free memory."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, device: torch.device,
                 dtype: torch.dtype, block_size: int, max_model_len: int, max_num_seqs: int,
                 num_blocks: int | None = None, target_kv_tokens: int | None = None) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * elem
        per_seq = -(-max_model_len // block_size)
        if num_blocks is None:
            tokens = max_num_seqs * max_model_len if target_kv_tokens is None else min(max_num_seqs * max_model_len,
                                                                                     target_kv_tokens)
            num_blocks = max(per_seq, -(-tokens // block_size))
            if device.type == "cuda":
                free = torch.cuda.mem_get_info(device)[0]
                num_blocks = min(num_blocks, int(free * CUDA_DRAFT_KV_FRACTION) // self.bytes_per_block)
                if num_blocks < per_seq:
                    raise RuntimeError(f"not enough GPU memory for the draft's KV cache ({num_blocks} blocks, "
                                       f"one sequence of {max_model_len} tokens needs {per_seq}); lower "
                                       f"gpu_memory_utilization so the target leaves room for the draft")
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype,
                                                                                        device=device))
                          for _ in range(num_layers)]
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)


class DraftRunner:
    """The draft model, its KV tensors and block manager (satisfies ``cuda_graphs.DecodeRunner``)."""

    def __init__(self, path: str, *, device: torch.device, dtype: torch.dtype, block_size: int, max_model_len: int,
                 max_num_seqs: int, num_blocks: int | None = None, target_kv_tokens: int | None = None,
                 load_format: str = "auto", graphs: bool = False, lora_max_rank: int | None = None,
                 discover_adapters: bool = False) -> None:
        from loraplex.engine.loader import load_model

        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.model, self.model_config = load_model(path, device=device, dtype=dtype, load_format=load_format,
                                                   progress=False)
        cfg = self.model_config
        pool = DraftKVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=dtype,
                           block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           num_blocks=num_blocks, target_kv_tokens=target_kv_tokens)
        self.num_blocks, self.bytes_per_block = pool.num_blocks, pool.bytes_per_block
        self.kv_caches, self.kv = pool.kv_caches, pool.kv
        self.lora = None
        self.adapters: DraftAdapters | None = None
        if lora_max_rank is not None:  # before the graphs: they capture the LoRA kernels
            from loraplex.engine.lora.slots import LoRASlots

            self.lora = LoRASlots(self.model, cfg, max_rank=lora_max_rank, max_step_slots=max(1, max_num_seqs),
                                  device=device, dtype=dtype)
            self.adapters = DraftAdapters(self.lora, cfg, max_rank=lora_max_rank, dtype=dtype,
                                          discover=discover_adapters)
        self.graphs = None
        if graphs:  # one-token draft steps through the padded decode path: CUDA graphs on CUDA, eager elsewhere
            from loraplex.engine.cuda_graphs import DecodeGraphs

            capture = device.type == "cuda"
            g = DecodeGraphs(self, max(1, max_num_seqs), max_model_len, capture=capture)
            self.graphs = g if not capture or g.capture_all() else None
        logger.info("draft model: %s, %d KV blocks (%.2f GiB), decode %s", cfg.family, self.num_blocks,
                    self.num_blocks * self.bytes_per_block / 2**30,
                    "CUDA graphs" if self.graphs is not None and self.graphs.capture else "eager")

    @torch.inference_mode()
    def forward_chunks(self, entries: list[tuple[list[int], int, list[int]]],
                       lora_slots: list[int] | None = None) -> torch.Tensor:
        """Logits [len(entries), V] at each entry's last token (tokens, start, block ids); ``lora_slots[i]``: the
        draft LoRA slot of entry i (-1: none; None: no LoRA at all)."""
        batch = paged_batch(entries, self.block_size, self.device)
        self._set_lora_tokens([len(t) for t, _, _ in entries], lora_slots)
        try:
            hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_caches)
        finally:
            if self.lora is not None:
                self.lora.set_token_slots(None)
        last = [f + len(t) - 1 for f, (t, _, _) in zip(batch.first_rows, entries)]
        return self.model.compute_logits(hidden[torch.tensor(last, dtype=torch.int64, device=hidden.device)])

    @torch.inference_mode()
    def forward_decode(self, rows: list[DecodeRow], lora_slots: list[int] | None = None) -> torch.Tensor:
        """Logits [len(rows), V] of one-token rows (the padded decode path when it serves them); ``lora_slots`` as
        in ``forward_chunks``."""
        step = RowStep(rows)
        if self.graphs is not None and self.graphs.can_run(step):
            by_seq = None if lora_slots is None else {r.seq_id: c for r, c in zip(rows, lora_slots) if c >= 0}
            return self.model.compute_logits(self.graphs.run(step, by_seq or None))
        return self.forward_chunks([([r.token], r.num_computed_tokens, r.block_ids) for r in rows], lora_slots)

    def _set_lora_tokens(self, counts: list[int], lora_slots: list[int] | None) -> None:
        if self.lora is None:
            if lora_slots is not None and any(c >= 0 for c in lora_slots):
                raise ValueError("draft LoRA slots given but the draft model has no LoRA attached")
            return
        if lora_slots is None or all(c < 0 for c in lora_slots):
            self.lora.set_token_slots(None)
            return
        self.lora.set_token_slots(torch.tensor(lora_slots, dtype=torch.int32).repeat_interleave(
            torch.tensor(counts)))


class _Shadow:
    __slots__ = ("seq", "drafted_from", "drafted")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq            # the draft's own Sequence: block table and num_computed_tokens
        self.drafted_from = 0     # position of the first draft token with draft K/V (the target's N then)
        self.drafted: list[int] = []


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, runner: DraftRunner, *, k: int, vocab_size: int, max_batched_tokens: int,
                 eos_token_ids: list[int] | None = None) -> None:
        self.runner = runner
        self.k = k
        self.vocab_size = vocab_size
        self.max_batched_tokens = max_batched_tokens
        self.max_positions = runner.model_config.max_position_embeddings
        self._shadows: dict[int, _Shadow] = {}
        self.num_forwards = 0
        self.num_catchup_tokens = 0
        self.forward_s = 0.0
        if runner.model_config.vocab_size != vocab_size:
            logger.warning("draft vocabulary %d != target vocabulary %d: drafts use the ids both have",
                           runner.model_config.vocab_size, vocab_size)

    # ---- state --------------------------------------------------------------------------------------------
    def _shadow(self, seq) -> _Shadow:
        sh = self._shadows.get(seq.seq_id)
        if sh is None:
            sh = self._shadows[seq.seq_id] = _Shadow(Sequence(seq.seq_id, seq.request_id, []))
        return sh

    def _sync(self, sh: _Shadow, seq) -> int:
        """Positions of ``seq`` whose draft K/V is valid (module docstring), at most num_tokens - 1."""
        n = seq.num_tokens
        computed = sh.seq.num_computed_tokens
        if sh.drafted and computed > sh.drafted_from:
            target = seq.token_ids_slice(sh.drafted_from, min(n, sh.drafted_from + len(sh.drafted)))
            same = 0
            while same < len(target) and target[same] == sh.drafted[same]:
                same += 1
            computed = min(computed, sh.drafted_from + same)
        sh.drafted = []
        computed = min(computed, n - 1)
        sh.seq.num_computed_tokens = computed
        self.runner.kv.trim(sh.seq, computed)
        return computed

    def release(self, seq_id: int) -> None:
        sh = self._shadows.pop(seq_id, None)
        if sh is not None:
            self.runner.kv.free(sh.seq)

    @property
    def num_sequences(self) -> int:
        return len(self._shadows)

    # ---- propose ------------------------------------------------------------------------------------------
    def propose(self, batch: list[SpecSequence]) -> list[Proposal | None]:
        t0 = time.perf_counter()
        kv = self.runner.kv
        out: list[Proposal | None] = [None] * len(batch)
        budget = self.max_batched_tokens
        active: list[tuple[int, SpecSequence, _Shadow, int]] = []  # (batch index, entry, shadow, k)
        active_rows: list[int] = []                                # their rows in the first forward
        chunks: list[tuple[list[int], int, list[int]]] = []
        chunk_slots: list[int] = []                                # their draft LoRA slots (-1: the bare draft)
        adapters = self.runner.adapters
        if adapters is not None and adapters.discovering:
            for s in batch:
                adapters.discover(s.adapter)
            adapters.poll()
        for i, s in enumerate(batch):
            seq = s.seq
            n = seq.num_tokens
            k = min(self.k, s.num_draft_tokens, self.max_positions - n)
            if k < 1 or budget <= 0:
                continue
            sh = self._shadow(seq)
            start = self._sync(sh, seq)
            todo = min(n - start, budget)
            caught_up = todo == n - start
            if not kv.allocate_slots(sh.seq, todo + (k - 1 if caught_up else 0)):
                continue  # the draft's pool is full: no draft for it this step
            budget -= todo
            if caught_up:
                active.append((i, s, sh, k))
                active_rows.append(len(chunks))
            else:  # still catching up on its prompt
                sh.seq.num_computed_tokens = start + todo
            chunks.append((seq.token_ids_slice(start, start + todo), start, list(sh.seq.block_ids)))
            chunk_slots.append(adapters.slot_of(s.adapter) if adapters is not None else -1)
        if not chunks:
            self.forward_s += time.perf_counter() - t0
            return out
        logits = self.runner.forward_chunks(chunks, chunk_slots if adapters is not None else None)
        self.num_forwards += 1
        self.num_catchup_tokens += sum(len(c[0]) for c in chunks)
        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        current = logits[torch.tensor(active_rows, dtype=torch.int64, device=logits.device)] if active else None
        live = list(range(len(active)))
        step = 0
        while live:
            tokens, q = self._draw(current, [active[a][1] for a in live])
            for a, t, qa in zip(live, tokens, q):
                drafts[a].append(t)
                if qa is not None:
                    probs[a].append(qa)
            step += 1
            live = [a for a in live if len(drafts[a]) < active[a][3]]
            if not live:
                break
            rows = [DecodeRow(active[a][1].seq_id, active[a][1].seq.num_tokens + step - 1, drafts[a][-1],
                              list(active[a][2].seq.block_ids)) for a in live]  # d_step at its position
            slots = None if adapters is None else [chunk_slots[active_rows[a]] for a in live]
            current = self.runner.forward_decode(rows, slots)
            self.num_forwards += 1
        for a, (i, s, sh, k) in enumerate(active):
            n = s.seq.num_tokens
            sh.seq.num_computed_tokens = n + len(drafts[a]) - 1
            sh.drafted_from, sh.drafted = n, drafts[a][:-1]
            out[i] = Proposal(drafts[a], torch.stack(probs[a]) if probs[a] else None)
        self.forward_s += time.perf_counter() - t0
        return out

    def _draw(self, logits: torch.Tensor, entries: list[SpecSequence]) -> tuple[list[int], list]:
        return draw_drafts(logits, entries, self.vocab_size)

    def stats(self) -> dict:
        kv = self.runner.kv
        return {"sequences": len(self._shadows), "forwards": self.num_forwards,
                "draft_adapters": len(self.runner.adapters) if self.runner.adapters is not None else 0,
                "catchup_tokens": self.num_catchup_tokens, "kv_blocks_total": kv.num_blocks,
                "kv_blocks_free": kv.num_free_blocks, "forward_ms": self.forward_s * 1e3}

    def close(self) -> None:
        for seq_id in list(self._shadows):
            self.release(seq_id)
        if self.runner.adapters is not None:
            self.runner.adapters.close()


def draw_drafts(logits: torch.Tensor, entries: list[SpecSequence], vocab_size: int) -> tuple[list[int], list]:
    """One draft token per row of ``logits`` [B, V']: argmax for greedy requests, else drawn with the request's
    generator from the processed draft distribution (returned, over the target's ``vocab_size`` ids)."""
    v = vocab_size
    if logits.shape[1] > v:
        logits = logits[:, :v]
    elif logits.shape[1] < v:
        logits = torch.cat([logits, logits.new_full((logits.shape[0], v - logits.shape[1]), float("-inf"))], 1)
    params = [s.params for s in entries]
    logits = Sampler.apply_logit_bias(logits.float(), params)
    tokens = logits.argmax(dim=-1)
    q: list = [None] * len(entries)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        pr = Sampler.probs(logits[idx], [params[i] for i in rows])
        tokens[idx] = rejection._race(pr, [entries[i].generator for i in rows], None)
        for j, i in enumerate(rows):
            q[i] = pr[j]
    return tokens.tolist(), q
