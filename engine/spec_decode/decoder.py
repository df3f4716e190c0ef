"""The engine's speculative decoding: which sequences speculate, their proposals, the verify step, the counters.

    LLMEngine.step() with a SpecDecoder:
      1. has_candidates(running)?   a step in flight is resolved first (drafts need its tokens)
      2. propose(running)           candidates -> proposer.propose -> seq.spec_token_ids (k_i drafts each)
      3. Scheduler.schedule()       a decode with drafts gets 1 + k_i tokens (fewer if the budget or the KV pool is
                                    short: speculation never preempts); after_schedule clears spec_token_ids
      4. execute(out)               verifier.py: one target forward, acceptance, tokens per sequence
      5. Scheduler.update()         accepted tokens appended with stop checks, num_computed_tokens over accepted
                                    tokens only, rejected drafts' trailing blocks released
         (counters per adapter, proposer.observe)
      6. after_update()             proposer state of sequences that left the running set is dropped

Forced replay (benchmarks): a step holding a sampling entry without drafts of a sequence on its recording (the
prefill's last chunk, a decode with no room or no proposal) also runs through ``execute``, which keeps the
recording's token in place of the target's own (drawn, compared: ``replay_agreement``, discarded); with the
verifier keeping the planned tokens of verify entries, such a sequence never leaves its recording.

A candidate: a running sequence with one token left to compute and no pending token, of a request with
``SamplingParams.speculative`` on, one sequence (no n > 1, best_of, beam search), and room for a draft
(k_i = min(k, max_tokens - outputs - 1, max_model_len - tokens) >= 1). With overlapped scheduling, 4 is split:
``launch`` enqueues the step and the engine builds the previous step's outputs before ``finish`` reads it back
(step_pipeline.py); a sequence finished or aborted in between appends nothing and is released.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from loraplex.engine.scheduler_output import ModelStepOutput, SchedulerOutput
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.spec_decode.config import SpeculativeConfig
from loraplex.engine.spec_decode.proposer import (PROPOSERS, Proposal, Proposer, ProposerContext, SpecSequence,
                                                  Verified, register_proposer)
from loraplex.engine.spec_decode.stats import SpecDecodeStats
from loraplex.engine.spec_decode.verifier import VerifyExecutor

logger = logging.getLogger(__name__)

# request_of(request_id) -> (SamplingParams, adapter or None, generator or None)
RequestLookup = Callable[[str], tuple[Any, Any, Any]]


def _ngram(config: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    from loraplex.engine.spec_decode.ngram import NgramProposer

    return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)


def _replay(config: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    from loraplex.engine.spec_decode.replay import ReplayProposer

    return ReplayProposer(config.num_speculative_tokens, config.replay_acceptance_rate, vocab_size=ctx.vocab_size,
                          forced=config.replay_forced, seed=config.replay_seed)


def _draft(config: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    from loraplex.engine.spec_decode.draft_model import DraftModelProposer, DraftRunner

    r = ctx.runner
    per_adapter = config.draft_adapters is not None or config.discover_draft_adapters
    runner = DraftRunner(config.draft_model, device=r.device, dtype=r.dtype, block_size=ctx.block_size,
                         max_model_len=ctx.max_model_len, max_num_seqs=ctx.max_num_seqs,
                         num_blocks=config.draft_num_kv_blocks, target_kv_tokens=r.num_blocks * r.block_size,
                         load_format=config.draft_load_format, graphs=r.graphs_enabled(),
                         lora_max_rank=config.draft_max_lora_rank if per_adapter else None,
                         discover_adapters=config.discover_draft_adapters)
    for adapter_id, folder in (config.draft_adapters or {}).items():
        runner.adapters.register(adapter_id, folder)
    return DraftModelProposer(runner, k=config.num_speculative_tokens, vocab_size=ctx.vocab_size,
                              max_batched_tokens=config.draft_max_batched_tokens or ctx.max_num_batched_tokens)


def _eagle(config: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    from loraplex.engine.spec_decode.eagle import EagleProposer
    from loraplex.engine.spec_decode.eagle_head import load_eagle_head

    r = ctx.runner
    def load(folder: str):
        return load_eagle_head(folder, hidden_size=r.model_config.hidden_size, device=r.device, dtype=r.dtype)

    return EagleProposer(load(config.draft_head), r.model, k=config.num_speculative_tokens, vocab_size=ctx.vocab_size,
                         adapter_heads={a: load(f) for a, f in (config.draft_heads or {}).items()})


def _eagle3(config: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    from loraplex.engine.spec_decode.draft_model import DraftKVPool
    from loraplex.engine.spec_decode.eagle3 import Eagle3Proposer, Eagle3Runner
    from loraplex.engine.spec_decode.eagle3_checkpoint import load_eagle3_draft

    r = ctx.runner
    draft, aux = load_eagle3_draft(config.draft_head, target=r.model_config, max_model_len=ctx.max_model_len,
                                   device=r.device, dtype=r.dtype)
    c = draft.layer_config
    pool = DraftKVPool(1, c.num_kv_heads, c.head_dim, device=r.device, dtype=r.dtype, block_size=ctx.block_size,
                       max_model_len=ctx.max_model_len, max_num_seqs=ctx.max_num_seqs,
                       num_blocks=config.draft_num_kv_blocks, target_kv_tokens=r.num_blocks * r.block_size)
    logger.info("EAGLE-3 draft: hidden %d, draft vocabulary %d, aux layers %s, %d KV blocks", c.hidden_size,
                c.vocab_size, list(aux), pool.num_blocks)
    return Eagle3Proposer(Eagle3Runner(draft, r.model, pool, block_size=ctx.block_size), aux,
                          k=config.num_speculative_tokens, vocab_size=ctx.vocab_size,
                          max_batched_tokens=config.draft_max_batched_tokens or ctx.max_num_batched_tokens)


for _name, _factory in (("ngram", _ngram), ("replay", _replay), ("draft", _draft), ("eagle", _eagle),
                        ("eagle3", _eagle3)):
    register_proposer(_name, _factory)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, runner, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, vocab_size: int) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens  # k; benchmarks may lower it between runs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        ctx = ProposerContext(runner=runner, vocab_size=vocab_size, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              block_size=runner.block_size)
        self.proposer: Proposer = PROPOSERS[config.method](config, ctx)
        verify_graphs = decode_graphs = None
        if config.verify_cuda_graphs:
            from loraplex.engine.spec_decode.verify_graphs import make_verify_graphs

            rows = min(config.verify_graph_max_rows, max_num_seqs * (config.num_speculative_tokens + 1))
            verify_graphs, decode_graphs = make_verify_graphs(runner, rows, max_model_len,
                                                              aux_layer_ids=self.proposer.aux_layer_ids)
        # steps with a prompt give the proposer its aux rows too (the engine captures the mixed-step graphs after
        # this; graphs a caller set up earlier are rebuilt)
        aux = tuple(self.proposer.aux_layer_ids)
        if aux and runner.mixed_aux_layer_ids != aux:
            runner.mixed_aux_layer_ids = aux
            if runner.mixed_graphs is not None:
                runner.init_mixed_graphs(capture=runner.mixed_graphs.capture, granule=runner.mixed_graphs.granule)
        self.executor = VerifyExecutor(runner, max_model_len=max_model_len, verify_graphs=verify_graphs,
                                       decode_graphs=decode_graphs, aux_layer_ids=self.proposer.aux_layer_ids)
        self.stats = SpecDecodeStats()
        self._proposals: dict[int, Proposal] = {}
        self._drafted: dict[int, Sequence] = {}      # sequences given drafts for the coming step
        self._tracked: dict[int, Sequence] = {}      # sequences the proposer may hold state for
        self._hidden: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self._launched: tuple | None = None          # (LaunchedVerify, forced, kept, seconds) until finish
        logger.info("speculative decoding: %s, k=%d, verify steps %s", config.method, config.num_speculative_tokens,
                    "through the padded decode path (CUDA graphs on CUDA)" if config.verify_cuda_graphs else "eager")

    # ---- candidates ---------------------------------------------------------------------------------------
    def _room(self, seq: Sequence, params) -> int:
        """Drafts the sequence may verify this step, 0 when it may not speculate (module docstring)."""
        if (not params.speculative or params.num_sequences != 1 or params.use_beam_search
                or seq.status is not SequenceStatus.RUNNING or seq.num_tokens - seq.num_computed_tokens != 1):
            return 0
        return max(0, min(self.num_speculative_tokens, params.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens))

    def has_candidates(self, running: list[Sequence], request_of: RequestLookup) -> bool:
        """Whether a running sequence may speculate this step (its pending token, if any, aside)."""
        return any(self._room(seq, request_of(seq.request_id)[0]) for seq in running)

    def propose(self, running: list[Sequence], request_of: RequestLookup) -> int:
        """Ask the proposer for the candidates' drafts; returns how many sequences got some."""
        t0 = time.perf_counter()
        batch = []
        for seq in running:
            params, adapter, gen = request_of(seq.request_id)
            k = self._room(seq, params)
            if k and not seq.num_pending_tokens:
                batch.append(SpecSequence(seq, seq.request_id, adapter, params, gen, k))
        self._proposals, self._drafted = {}, {}
        if not batch:
            return 0
        if self.proposer.needs_hidden_states:
            for s in batch:
                s.hidden_start, s.hidden_states = self._take_hidden(s.seq_id)
        proposals = self.proposer.propose(batch)
        if len(proposals) != len(batch):
            raise RuntimeError(f"proposer {self.proposer.name!r} returned {len(proposals)} proposals for "
                               f"{len(batch)} sequences")
        for s, p in zip(batch, proposals):
            self._tracked[s.seq_id] = s.seq
            if p is None or not p.token_ids:
                continue
            tokens = [int(t) for t in p.token_ids[:s.num_draft_tokens]]
            if any(not 0 <= t < self.vocab_size for t in tokens):
                raise ValueError(f"proposer {self.proposer.name!r} drafted a token outside [0, {self.vocab_size})")
            if p.probs is not None and (p.probs.dim() != 2 or p.probs.shape[0] < len(tokens)
                                        or p.probs.shape[1] != self.vocab_size):
                raise ValueError(f"proposer {self.proposer.name!r} gave draft probabilities of shape "
                                 f"{tuple(p.probs.shape)} for {len(tokens)} drafts; expected [{len(tokens)}, "
                                 f"{self.vocab_size}]")
            p.token_ids = tokens
            s.seq.spec_token_ids = tokens
            self._proposals[s.seq_id] = p
            self._drafted[s.seq_id] = s.seq
        self.stats.propose_s += time.perf_counter() - t0
        return len(self._drafted)

    def after_schedule(self, out: SchedulerOutput, request_of: RequestLookup) -> bool:
        """Clear the drafts off the sequences (what was scheduled is in ``out``); True when this step must run
        through ``execute``: it verifies drafts, or the proposer needs the target's hidden states of a
        sequence in it."""
        for seq in self._drafted.values():
            seq.spec_token_ids = []
        if any(s.draft_token_ids for s in out.scheduled) or self._forced_rows(out, request_of):
            return True
        return self.proposer.needs_hidden_states and any(self._may_speculate(s.seq, request_of)
                                                         for s in out.scheduled)

    def _forced_rows(self, out: SchedulerOutput, request_of: RequestLookup) -> dict[int, int]:
        """Forced replay (benchmarks): {seq_id: the recording's token} of this step's sampling entries without
        drafts (a prefill's last chunk, a decode with no room or no proposal) of speculating requests on their
        recording; empty for every other proposer."""
        if self.config.method != "replay" or not self.config.replay_forced:
            return {}
        forced = {}
        for s in out.scheduled:
            if s.sample and not s.draft_token_ids and self._may_speculate(s.seq, request_of):
                token = self.proposer.recorded_token(s.seq)
                if token is not None:
                    forced[s.seq.seq_id] = token
        return forced

    def _may_speculate(self, seq: Sequence, request_of: RequestLookup) -> bool:
        params = request_of(seq.request_id)[0]
        return params.speculative and params.num_sequences == 1 and not params.use_beam_search

    # ---- the step -----------------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, sampling: dict, lora_slots: dict[int, int] | None, structured,
                request_of: RequestLookup) -> ModelStepOutput:
        """Run a step through the verify executor and wait for it: ``launch`` then ``finish``."""
        self.launch(out, sampling, lora_slots, structured, request_of)
        return self.finish(request_of)

    def launch(self, out: SchedulerOutput, sampling: dict, lora_slots: dict[int, int] | None, structured,
               request_of: RequestLookup) -> None:
        """Enqueue the step on the device (forward, logits, acceptance, the read-back's copy); ``finish`` waits for
        it. The host may build the previous step's outputs in between (overlapped verify steps)."""
        t0 = time.perf_counter()
        keep = {}
        if self.proposer.needs_hidden_states:
            keep = {s.seq.seq_id: s.seq for s in out.scheduled if self._may_speculate(s.seq, request_of)}
        forced = self._forced_rows(out, request_of)  # before the step: the tokens it would append are not in yet
        launched = self.executor.launch(out, sampling, lora_slots, self._proposals, structured, set(keep) or None)
        self._launched = (launched, forced, keep, time.perf_counter() - t0)

    def finish(self, request_of: RequestLookup) -> ModelStepOutput:
        """Read the launched step back: the tokens per sequence; counters and ``proposer.observe`` for the
        sequences still running (one finished or aborted since the launch appends nothing)."""
        t0 = time.perf_counter()
        launched, forced, keep, launch_s = self._launched
        self._launched = None
        result, outcomes, hidden = self.executor.finish(launched)
        for seq_id, token in forced.items():  # the target's token was drawn (a real cost) and is discarded
            drawn = result.sampled.get(seq_id)
            if drawn:
                self.stats.replay_checked += 1
                self.stats.replay_agreed += int(drawn == [token])
                result.sampled[seq_id] = [token]
        outcomes = [o for o in outcomes if self._drafted[o.seq_id].status is SequenceStatus.RUNNING]
        if outcomes:
            self.stats.verify_steps += 1
            self.stats.verify_s += launch_s + time.perf_counter() - t0
            self.stats.graph_steps += int(self.executor.last_on_graphs)  # verify steps only
            self._observe(outcomes, request_of)
        accepted = {o.seq_id: o.num_accepted for o in outcomes}
        for seq_id, (start, rows) in hidden.items():
            if keep[seq_id].status is not SequenceStatus.RUNNING:
                continue  # finished or aborted since the launch (released)
            if seq_id in accepted:
                rows = rows[:accepted[seq_id] + 1]  # rejected drafts' rows are not the sequence's
            self._add_hidden(seq_id, start, rows)
        return result

    def _observe(self, outcomes: list, request_of: RequestLookup) -> None:
        """Counters per adapter and ``proposer.observe`` for the step's verifications."""
        verified = []
        for o in outcomes:
            seq = self._drafted[o.seq_id]
            adapter = request_of(seq.request_id)[1]
            self.stats.record(getattr(adapter, "adapter_id", None), len(o.draft_token_ids), o.num_accepted,
                              len(o.token_ids))
            if o.agreed is not None:
                self.stats.replay_checked += 1
                self.stats.replay_agreed += int(o.agreed)
            verified.append(Verified(o.seq_id, adapter, o.draft_token_ids, o.num_accepted, o.token_ids))
        self.proposer.observe(verified)

    def after_update(self) -> None:
        """End of a step: this step's proposals dropped, and the state of sequences no longer running."""
        self._proposals, self._drafted = {}, {}
        self.release_stopped()

    def release_stopped(self) -> None:
        """Drop proposer state (a draft model's KV blocks too) of sequences that are no longer running (finished,
        aborted, preempted); also after an overlapped step's tokens are resolved, where no verify step ran."""
        for seq_id, seq in list(self._tracked.items()):
            if seq.status is not SequenceStatus.RUNNING:
                self.release(seq_id)

    def release(self, seq_id: int) -> None:
        self._tracked.pop(seq_id, None)
        self._hidden.pop(seq_id, None)
        self.proposer.release(seq_id)

    # ---- hidden states ------------------------------------------------------------------------------------
    def _add_hidden(self, seq_id: int, start: int, rows: torch.Tensor) -> None:
        pieces = [(s, r[:max(0, start - s)]) for s, r in self._hidden.get(seq_id, []) if s < start]
        self._hidden[seq_id] = [(s, r) for s, r in pieces if r.shape[0]] + [(start, rows)]

    def _take_hidden(self, seq_id: int) -> tuple[int, torch.Tensor | None]:
        pieces = self._hidden.pop(seq_id, None)
        if not pieces:
            return 0, None
        return pieces[0][0], torch.cat([r for _, r in pieces])

    # ---- per-adapter drafts -------------------------------------------------------------------------------
    def draft_adapters(self):
        """The draft model's ``DraftAdapters`` (draft_lora.py); ValueError when this engine has none."""
        adapters = getattr(getattr(self.proposer, "runner", None), "adapters", None)
        if adapters is None:
            raise ValueError("per-adapter drafts need speculative method 'draft' with draft_adapters set (a dict, "
                             "empty to register drafts later; --speculative-draft-adapter on the command line) or "
                             "discover_draft_adapters on")
        return adapters

    # ---- reporting ----------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {"method": self.config.method, "num_speculative_tokens": self.num_speculative_tokens,
                "verify_cuda_graphs": self.config.verify_cuda_graphs, **self.stats.snapshot(),
                "proposer": self.proposer.stats()}

    def close(self) -> None:
        self.proposer.close()

