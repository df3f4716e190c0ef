"""One engine step that verifies drafts: a single target forward over every scheduled sequence (prefill chunks and
plain decodes may ride along), then acceptance per speculating sequence.

    scheduled: [ verify s0: x d1 d2 d3 | prefill chunk s1 | decode s2: x | verify s3: x d1 ]
    forward:   eager (one multi-token paged forward; the request's LoRA slot on every token of it), or, when every
               entry is a decode or a verify and ``verify_cuda_graphs`` is on, the flattened decode rows through
               CUDA graphs (verify_graphs.py)
    logits:    every row of a verify entry (k + 1), the last row of a plain sampling entry
    verify rows, per sequence, in the sampler's order with a history per position:
               + logit_bias -> grammar masks (GrammarMatcher.fill_draft_bitmasks: row j = the mask after d1..dj; a
               draft the grammar refuses gets probability 0, so it is rejected whatever the model says) ->
               penalties and min_tokens over prompt + outputs + d1..dj -> greedy argmax | temperature, top-k,
               top-p, min-p -> rejection.py (accepted count, the target's own token)
    tokens:    accepted drafts + the target's token, cut at EOS / a stop token / max_tokens / max_model_len and
               where the grammar completes (what non-speculative decoding would have stopped at)
    plain rows: the model runner's own sampling (``ModelRunner._draw``, beam rows), with their grammar masks

Logprobs (requests that ask) are those of the raw target logits at each kept token's row, as without speculation.
Kept rows (``keep_hidden``, a proposer that needs hidden states): the final hidden states of those sequences'
positions, or, with ``aux_layer_ids`` (EAGLE-3), the target's residual stream entering those layers, concatenated
(``CausalLM.forward``); with ``verify_cuda_graphs`` such steps run on verify graphs that also give those rows
(``make_verify_graphs``), else eagerly.
``launch`` enqueues everything up to the acceptance and starts the one read-back ([S, 2] accepted counts and
tokens, to pinned memory on CUDA); ``finish`` waits for it and cuts the tokens (``execute``: both).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.engine.logprobs import compute_logprobs
from loraplex.engine.sampler import Sampler, row_tensor
from loraplex.engine.scheduler_output import ModelStepOutput, SchedulerOutput
from loraplex.engine.spec_decode import rejection
from loraplex.engine.spec_decode.batch_inputs import paged_batch
from loraplex.engine.spec_decode.proposer import Proposal
from loraplex.engine.spec_decode.verify_graphs import can_run_rows
from loraplex.engine.step_pipeline import PendingTokens
from loraplex.engine.structured.bitmask import apply_token_bitmask, bitmask_width


class _History:
    """A sampler ``TokenHistory`` at a draft position: the sequence's outputs plus the drafts before it."""

    __slots__ = ("prompt_token_ids", "output_token_ids")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt_token_ids, self.output_token_ids = prompt, output


@dataclass
class Outcome:
    """One sequence's verification: ``num_accepted`` drafts kept (``target_accepted``: what the target decided; they
    differ only for forced replay), ``token_ids`` appended."""

    seq_id: int
    draft_token_ids: list[int]
    target_accepted: int
    num_accepted: int
    token_ids: list[int]
    agreed: bool | None = None  # forced replay: did the target's verdict and token match the plan


@dataclass
class _VerifyRows:
    """The verify entries of a launched step, per sequence, and their acceptance on its way to the host."""

    seqs: list
    drafts: list[list[int]]
    params: list
    offs: list[int]               # first row of each sequence in ``raw``
    matchers: list
    raw: torch.Tensor             # the target's logits of the verify rows
    proposals: dict[int, Proposal]
    read_back: PendingTokens      # {seq_id: [accepted, token]}


@dataclass
class LaunchedVerify:
    """A verify step launched (``VerifyExecutor.launch``) and not yet read back (``finish``)."""

    result: ModelStepOutput
    kept: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    rows: _VerifyRows | None = None


class VerifyExecutor:
    def __init__(self, runner, *, max_model_len: int, verify_graphs=None, decode_graphs=None,
                 aux_layer_ids: tuple[int, ...] = ()) -> None:
        self.runner = runner
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.max_model_len = max_model_len
        self.verify_graphs = verify_graphs
        self.decode_graphs = decode_graphs
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self.num_mixed_steps = 0     # steps with prefill chunks on the runner's mixed-step path (mixed_graphs.py)
        self.last_on_graphs = False  # the last step's forward ran through the padded decode path

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sampling: dict, lora_slots: dict[int, int] | None,
                proposals: dict[int, Proposal], structured=None, keep_hidden: set[int] | None = None
                ) -> tuple[ModelStepOutput, list[Outcome], dict[int, tuple[int, torch.Tensor]]]:
        """Run step ``out`` (``sampling`` / ``lora_slots`` as ``ModelRunner.execute``; ``proposals`` by seq_id for
        the verify entries). Returns (the step's output: ``sampled[seq_id]`` lists every appended token, the
        verify outcomes, {seq_id: (first position, hidden rows)} of the sequences in ``keep_hidden``)."""
        return self.finish(self.launch(out, sampling, lora_slots, proposals, structured, keep_hidden))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, sampling: dict, lora_slots: dict[int, int] | None,
               proposals: dict[int, Proposal], structured=None, keep_hidden: set[int] | None = None
               ) -> "LaunchedVerify":
        """The device half of ``execute``: the forward, the logits, the acceptance, and the copy of the accepted
        counts and tokens to the host started; ``finish`` reads them back."""
        runner = self.runner
        launched = LaunchedVerify(ModelStepOutput())
        runner.move_blocks(out)
        if not out.scheduled:
            return launched
        entries = []
        for s in out.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            if s.draft_token_ids:
                tokens = seq.token_ids_slice(start, seq.num_tokens) + list(s.draft_token_ids)
            else:
                tokens = seq.token_ids_slice(start, start + s.num_new_tokens)
            entries.append((tokens, start, s.block_ids))
        aux_layers = self.aux_layer_ids if keep_hidden else ()
        hidden, first, aux = self._forward(out, entries, lora_slots, launched.result, aux_layers)
        if keep_hidden:
            kept = hidden if aux is None else aux
            launched.kept = {s.seq.seq_id: (e[1], kept[f:f + len(e[0])].clone())
                             for s, e, f in zip(out.scheduled, entries, first) if s.seq.seq_id in keep_hidden}
        index, plain, verify = [], [], []
        for s, (tokens, _, _), f in zip(out.scheduled, entries, first):
            if not s.sample:
                continue
            if s.draft_token_ids:
                verify.append((s, len(index)))
                index += range(f, f + len(tokens))
            else:
                plain.append((s, len(index)))
                index.append(f + len(tokens) - 1)
        if not index:
            return launched
        # every row kept in order (a step of verifies and decodes only): no gather. A gather's index goes up through
        # pinned memory: a pageable copy would wait for the forward, and every launch after it would leave the
        # device idle; so the host enqueues logits and acceptance while the forward runs and waits once, at the
        # read-back
        rows_t = None if index == list(range(hidden.shape[0])) else row_tensor(index, torch.int64, hidden.device)
        logits = runner.model.compute_logits(hidden if rows_t is None else hidden[rows_t])
        if runner.logits_hook is not None:
            row_seqs = [s.seq for s, _ in sorted(plain + verify, key=lambda e: e[1])
                        for _ in range(1 + len(s.draft_token_ids))]
            runner.logits_hook(row_seqs, logits)
        if plain:
            self._sample_plain(logits, plain, sampling, launched.result, structured)
        if verify:
            launched.rows = self._verify(logits, verify, sampling, proposals, structured)
        return launched

    @torch.inference_mode()
    def finish(self, launched: "LaunchedVerify"
               ) -> tuple[ModelStepOutput, list[Outcome], dict[int, tuple[int, torch.Tensor]]]:
        """The host half of ``execute``: wait for the launched step's read-back, cut each sequence's tokens."""
        outcomes = self._verify_outcomes(launched.rows, launched.result) if launched.rows is not None else []
        return launched.result, outcomes, launched.kept

    # ---- the forward --------------------------------------------------------------------------------------
    def _forward(self, out: SchedulerOutput, entries: list, lora_slots, result: ModelStepOutput,
                 aux_layer_ids: tuple[int, ...] = ()):
        """(hidden [T, H], each entry's first row, aux rows [T, n * H] or None without ``aux_layer_ids``)."""
        runner = self.runner
        graphs = self._graphs_for(out, entries)
        if graphs is not None and (not aux_layer_ids or graphs.aux_layer_ids == aux_layer_ids):
            runner._check_lora_slots(out, lora_slots)
            row_slots = [-1 if lora_slots is None else lora_slots.get(s.seq.seq_id, -1) for s in out.scheduled]
            hidden = self._run_rows(graphs, entries, row_slots)
            self.num_graph_steps += 1
            self.last_on_graphs = True
            first, row = [], 0
            for tokens, _, _ in entries:
                first.append(row)
                row += len(tokens)
            return hidden, first, graphs.last_aux if aux_layer_ids else None
        mixed = runner.mixed_graphs
        row_slots = [-1 if lora_slots is None else lora_slots.get(s.seq.seq_id, -1) for s in out.scheduled]
        if (mixed is not None and (not aux_layer_ids or mixed.aux_layer_ids == tuple(aux_layer_ids))
                and all(s.prompt_logprobs is None for s in out.scheduled) and mixed.can_run_entries(entries, row_slots)):
            runner._check_lora_slots(out, lora_slots)
            hidden, first = mixed.run_entries(entries, row_slots)
            self.num_mixed_steps += 1
            self.last_on_graphs = False  # (the verify graphs' count: a mixed step is not one)
            return hidden, first, mixed.last_aux if aux_layer_ids else None
        batch = paged_batch(entries, runner.block_size, runner.device)
        runner._set_lora_tokens(out, lora_slots)
        aux = None
        if aux_layer_ids:
            hidden, aux = runner.model(batch.input_ids, batch.positions, batch.attn, runner.kv_caches, aux_layer_ids)
        else:
            hidden = runner.model(batch.input_ids, batch.positions, batch.attn, runner.kv_caches)
        runner._prompt_logprobs(out, hidden, result)
        self.num_eager_steps += 1
        self.last_on_graphs = False
        return hidden, batch.first_rows, aux

    @staticmethod
    def _run_rows(graphs, entries: list, row_slots: list[int]) -> torch.Tensor:
        return graphs.run_rows(entries, row_slots)

    def _graphs_for(self, out: SchedulerOutput, entries: list):
        """The padded decode path (decode graphs when the rows fit them, else the verify graphs) when every entry
        is a decode or a verify; None: the eager multi-token forward."""
        if self.verify_graphs is None and self.decode_graphs is None:
            return None
        if any(not s.sample or s.prompt_logprobs is not None or s.num_new_tokens != 1 + len(s.draft_token_ids)
               for s in out.scheduled):
            return None
        for graphs in (self.decode_graphs, self.verify_graphs):
            if graphs is not None and can_run_rows(graphs, entries):
                return graphs
        return None

    # ---- plain rows ---------------------------------------------------------------------------------------
    def _sample_plain(self, logits, plain, sampling, result, structured) -> None:
        runner = self.runner
        sub = logits[row_tensor([j for _, j in plain], torch.int64, logits.device)]
        seqs = [s.seq for s, _ in plain]
        by_id = {s.seq.seq_id: s for s, _ in plain}
        draw = [i for i, (s, _) in enumerate(plain) if not s.beam]
        beam = [i for i, (s, _) in enumerate(plain) if s.beam]
        if beam:
            bseqs = [seqs[i] for i in beam]
            lp = runner.sampler.beam_logprobs(sub[beam], [sampling[s.seq_id][0] for s in bseqs], bseqs)
            for i, seq in enumerate(bseqs):
                result.beam_logprobs[seq.seq_id] = lp[i]
        if draw:
            mask = structured.bitmask([seqs[i] for i in draw]) if structured is not None else None
            runner._draw(sub, draw, seqs, by_id, sampling, result, mask)

    # ---- verify rows --------------------------------------------------------------------------------------
    def _verify(self, logits, verify, sampling, proposals, structured) -> "_VerifyRows":
        """Acceptance of the verify rows, enqueued; the accepted counts and tokens on their way to the host."""
        runner = self.runner
        device = logits.device
        rows, params_rows, hist_rows = [], [], []
        seqs, drafts, params, gens, offs = [], [], [], [], []
        history = False
        for s, j in verify:
            seq = s.seq
            p, g = sampling[seq.seq_id]
            d = list(s.draft_token_ids)
            n = len(d) + 1
            offs.append(len(rows))
            rows += range(j, j + n)
            params_rows += [p] * n
            if p.needs_token_history:
                history = True
                hist_rows += [_History(seq.prompt_token_ids, seq.output_token_ids + d[:i]) for i in range(n)]
            else:
                hist_rows += [seq] * n
            seqs.append(seq)
            drafts.append(d)
            params.append(p)
            gens.append(g)
        raw = logits if rows == list(range(logits.shape[0])) else logits[row_tensor(rows, torch.int64, device)]
        x = Sampler.apply_logit_bias(raw, params_rows)
        matchers = self._matchers(structured, seqs)
        if any(m is not None for m in matchers):
            host = torch.full((len(rows), bitmask_width(raw.shape[1])), -1, dtype=torch.int32)
            for m, d, off in zip(matchers, drafts, offs):
                if m is not None:
                    m.fill_draft_bitmasks(d, host, off)
            x = apply_token_bitmask(x, host.to(device))
        if history:
            x = runner.sampler.apply_penalties(x, params_rows, hist_rows)
        greedy_flags = [p.greedy for p in params]
        if all(greedy_flags):  # one group: no gathers, no scatters
            accepted, tokens = rejection.verify_greedy(x.argmax(dim=-1), drafts)
        else:
            accepted = torch.zeros(len(seqs), dtype=torch.int64, device=device)
            tokens = torch.zeros(len(seqs), dtype=torch.int64, device=device)
            for greedy in (True, False):
                group = [i for i, g in enumerate(greedy_flags) if g == greedy]
                if not group:
                    continue
                grows = [offs[i] + r for i in group for r in range(len(drafts[i]) + 1)]
                gx = x if len(grows) == len(rows) else x[row_tensor(grows, torch.int64, device)]
                gd = [drafts[i] for i in group]
                if greedy:
                    a, t = rejection.verify_greedy(gx.argmax(dim=-1), gd)
                else:
                    probs = Sampler.probs(gx, [params_rows[r] for r in grows])
                    q = [self._draft_probs(proposals.get(seqs[i].seq_id), len(drafts[i])) for i in group]
                    a, t = rejection.verify_sampled(probs, gd, q, [gens[i] for i in group],
                                                    runner.sampler._shared_generator(device))
                if len(group) == len(seqs):
                    accepted, tokens = a, t
                else:
                    idx = row_tensor(group, torch.int64, device)
                    accepted[idx], tokens[idx] = a, t
        # the one read-back of the verify: [S, 2] (accepted, token) per sequence, waited for in finish()
        return _VerifyRows(seqs, drafts, params, offs, matchers, raw, proposals,
                           PendingTokens([seq.seq_id for seq in seqs], torch.stack([accepted, tokens], dim=1)))

    def _verify_outcomes(self, v: "_VerifyRows", result: ModelStepOutput) -> list[Outcome]:
        both = v.read_back.wait()
        seqs, drafts, params, offs, matchers, proposals = v.seqs, v.drafts, v.params, v.offs, v.matchers, v.proposals
        device = v.raw.device
        outcomes, lp_rows, lp_tokens, lp_top, lp_owner = [], [], [], [], []
        for i, seq in enumerate(seqs):
            a, t = both[seq.seq_id]
            kept_a, kept_t, agreed = a, t, None
            plan = proposals.get(seq.seq_id)
            if plan is not None and plan.planned_num_accepted is not None:
                kept_a = min(plan.planned_num_accepted, len(drafts[i]))
                kept_t = plan.planned_tokens[kept_a]
                agreed = kept_a == a and kept_t == t
            out_tokens = self._cut(seq, params[i], drafts[i][:kept_a] + [kept_t], matchers[i])
            outcomes.append(Outcome(seq.seq_id, drafts[i], a, kept_a, out_tokens, agreed))
            result.sampled[seq.seq_id] = out_tokens
            if params[i].logprobs is not None:
                lp_rows += [offs[i] + r for r in range(len(out_tokens))]
                lp_tokens += out_tokens
                lp_top += [params[i].logprobs] * len(out_tokens)
                lp_owner += [seq.seq_id] * len(out_tokens)
        if lp_rows:
            entries = compute_logprobs(v.raw[row_tensor(lp_rows, torch.int64, device)], lp_tokens, lp_top)
            for owner, entry in zip(lp_owner, entries):
                result.logprobs.setdefault(owner, []).append(entry)
        return outcomes

    @staticmethod
    def _draft_probs(proposal: Proposal | None, k: int):
        if proposal is None or proposal.probs is None:
            return None
        return proposal.probs[:k]

    @staticmethod
    def _matchers(structured, seqs) -> list:
        """Each sequence's grammar matcher, caught up with its tokens (None: a free request)."""
        if structured is None:
            return [None] * len(seqs)
        return [structured.matcher_for(seq) for seq in seqs]

    def _cut(self, seq, params, tokens: list[int], matcher) -> list[int]:
        """``tokens`` up to where non-speculative decoding would have stopped: max_tokens, max_model_len, EOS (unless
        ignore_eos), a stop token, or the token that completes the grammar."""
        limit = max(1, min(params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens))
        tokens = tokens[:limit]
        eos = () if params.ignore_eos else self.runner.sampler.eos_token_ids
        for i, t in enumerate(tokens):
            if t in eos or t in params.stop_token_ids:
                tokens = tokens[:i + 1]
                break
        if matcher is not None and len(tokens) > 1:
            taken = 0
            for t in tokens:
                if not matcher.accept(t):
                    break
                taken += 1
                if matcher.is_terminated:
                    break
            matcher.rollback(taken)
            tokens = tokens[:max(1, taken)]
        return tokens
