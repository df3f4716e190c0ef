"""The synchronous engine: requests in, one scheduling + model step at a time, outputs out.

    add_request ─▶ SequenceGroup ─▶ Scheduler.schedule() ─▶ SchedulerOutput ─▶ ModelRunner.execute()
                                          ▲                                            │ {seq_id: token}
                                          └──────────── Scheduler.update() ◀───────────┘ ─▶ RequestOutput

With ``enable_lora`` the engine also owns an AdapterManager (GPU memory ← CPU ← disk ← fetcher): the scheduler
makes each admitted request's adapter resident (its copy to the GPU runs beside the steps; the request is admitted
once it is done), every step passes ``{seq_id: slot}`` to the runner, and a request whose adapter fails to load
finishes with ``finish_reason="error"`` and the reason in ``error``.

Each sequence has its own detokenizer and stop-string matcher; a matched stop string ends the sequence through
``Scheduler.finish_seq``. A request with ``n > 1`` reports ``n`` completions in ``RequestOutput.outputs``
(``best_of``: the best by cumulative logprob; beam search: the best hypotheses, on the final output only).

Structured outputs (``SamplingParams.structured``, engine/structured/): ``add_request`` checks the spec and starts
its grammar's compile on a small executor (a cached grammar is ready at once; a cached failure raises here); the
scheduler skips the request while it compiles, like a loading adapter; a compile that fails finishes it with
``finish_reason="error"`` and ``error_type="invalid_request"``. Each step the constrained sequences' masks are
filled on the host and applied in the sampler; after the step each matcher consumes its sequence's token, and a
sequence whose grammar is complete finishes ("stop"). Overlapped steps launch the forward of step n+1 first, then
resolve step n's tokens (stop checks, matchers), fill the masks and launch the sampling of n+1, and only then build
step n's outputs (detokenizer, stop strings), so the device waits on the host's mask work at most.

With ``speculative`` set (engine/spec_decode/), each step first asks the proposer for drafts of the running
decodes, the scheduler gives a speculating decode 1 + k tokens, one forward verifies them all and the accepted
tokens are appended (several per step). With ``async_scheduling`` such a verify step stays in flight while the host
builds the previous step's outputs: ``step()`` reads verify step n back and appends its tokens, proposes, schedules
and launches step n+1 (``SpecDecoder.launch``), then builds and returns step n's outputs; a stop string found there
ends a sequence whose rows of n+1 are discarded when n+1 is read back (``SpecDecoder.finish``).

With ``async_scheduling`` on, plain decode steps overlap: ``step()`` launches the next step before it reads the
tokens of the one in flight, and returns that one's outputs (step_pipeline.py). One step may then be in flight
between two calls; ``has_unfinished_requests`` stays True until it is resolved.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.engine_config import EngineConfig, check_against_model, with_device_defaults
from loraplex.engine.fairness import check_weight
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.lora.manager import AdapterLoadError, AdapterManager, is_transient_failure
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.model_runner import ModelRunner
from loraplex.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.scheduler_output import ModelStepOutput, SchedulerOutput
from loraplex.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from loraplex.engine.step_pipeline import InflightStep, can_overlap, can_overlap_verify
from loraplex.engine.stop_strings import StopStringMatcher
from loraplex.engine.structured.decoding import StructuredDecoding

logger = logging.getLogger(__name__)



@dataclass
class _SeqState:
    """What the engine tracks per sequence: its text (after stop strings), reported tokens, logprobs."""

    detokenizer: IncrementalDetokenizer | None
    matcher: StopStringMatcher | None
    num_reported: int = 0   # output tokens already sent in some RequestOutput
    text: str = ""
    reported_text: str = ""  # text already sent
    closed: bool = False     # finished and its text final
    logprobs: list = field(default_factory=list)
    stop_reason: str | None = None
    num_detokenized: int = 0  # output tokens fed to the detokenizer


@dataclass
class _RequestState:
    group: SequenceGroup
    params: SamplingParams
    generators: list[torch.Generator | None]  # one per sequence index (parent 0, forks 1..); None: unseeded
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    seqs: dict[int, _SeqState] = field(default_factory=dict)
    prompt_logprobs: list | None = None
    fork_logprobs: list = field(default_factory=list)  # entries of forks' first tokens, until they exist

    @property
    def generator(self) -> torch.Generator | None:
        return self.generators[0]


def _child_seed(seed: int, index: int) -> int:
    """The seed of a request's ``index``-th sequence: the request's own for index 0, a fixed mix otherwise, so a
    seeded n > 1 request is reproducible however its sequences are scheduled, preempted or swapped."""
    return seed if index == 0 else (seed * 1_000_003 + index * 0x9E3779B97F4A7C15) % 2**63


def load_tokenizer(path: str):
    """The tokenizer saved beside the model, or None when the folder has none (token-id prompts only)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                              "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _generation_eos_ids(path: str) -> list[int]:
    gen = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen):
        return []
    with open(gen, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


class LLMEngine:
    """``add_request`` / ``step`` / ``abort``. Not thread-safe: one thread drives it (see AsyncEngine)."""

    def __init__(self, config: EngineConfig):
        from loraplex.engine.config import ModelConfig

        from loraplex.engine.model_runner import resolve_device

        config = with_device_defaults(config, resolve_device(config.device).type)
        self.config = config
        model_config = ModelConfig.from_pretrained(config.model)
        self.max_model_len = check_against_model(config, model_config)   # EngineSettingsError before any load
        if config.tensor_parallel_size > 1:
            from loraplex.engine.distributed.executor import start_tensor_parallel

            self.runner = start_tensor_parallel(config, self.max_model_len)  # rank 0; workers replay its steps
        else:
            self.runner = ModelRunner(config, self.max_model_len, config.max_num_seqs)
        self.model_config = self.runner.model_config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        eos = list(dict.fromkeys(self.model_config.eos_token_ids + _generation_eos_ids(config.model)))
        self.eos_token_ids = eos
        self.runner.sampler.eos_token_ids = list(eos)  # masked until min_tokens
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size,
                                       enable_prefix_caching=config.enable_prefix_caching,
                                       num_cpu_blocks=self.runner.num_cpu_blocks)
        self.adapters: AdapterManager | None = None
        if config.enable_lora:
            slots = self.runner.init_lora(max_rank=config.max_lora_rank)
            budget = self.runner.adapter_budget_bytes
            self.adapters = AdapterManager(
                slots, self.model_config, gpu_budget_bytes=budget, max_loras=config.max_loras,
                max_cpu_loras=config.max_cpu_loras, max_rank=config.max_lora_rank, cache_dir=config.adapter_cache_dir,
                dtype=self.runner.dtype, pin_memory=self.runner.device.type == "cuda",
                cache_max_bytes=config.adapter_cache_max_bytes)
            logger.info("adapter memory: %.2f GiB on %s (%s), up to %s resident adapters (%.0f MiB each at rank %d "
                        "on every target)%s", budget / 2**30, self.runner.device,
                        "adapter_memory_bytes" if config.adapter_memory_bytes is not None else
                        f"{config.adapter_memory_fraction:.0%} of the memory left after weights and headroom"
                        if self.runner.device.type == "cuda" else "the CPU default",
                        budget // max(1, self.adapters.pool.max_footprint), self.adapters.pool.max_footprint / 2**20,
                        config.max_lora_rank, f", at most {config.max_loras} (max_loras)" if config.max_loras else "")
        self.runner.init_decode_graphs()  # after init_lora: the graphs capture the LoRA kernels (CUDA only)
        self.warmup = self.runner.warm_up_eager_steps()  # eager steps' kernel variants compiled before serving
        self.async_scheduling = self._init_async_scheduling()
        self._inflight: InflightStep | None = None  # the overlapped step launched and not yet resolved
        self.num_overlapped_steps = 0         # plain decode steps launched before the previous one was read
        self.num_overlapped_verify_steps = 0  # verify steps left in flight while the previous one's outputs are built
        self.num_early_launched_steps = 0     # eager steps enqueued before the decode step in flight was read back
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
                            eos_token_ids=eos, max_loras=config.max_loras if config.enable_lora else None,
                            preemption_mode=config.preemption_mode, policy=config.scheduling_policy,
                            vtc_input_weight=config.vtc_input_weight, vtc_output_weight=config.vtc_output_weight,
                            vtc_preempt_gap=config.vtc_preempt_gap),
            self.kv_cache, can_admit=self._grammar_ready, adapter_slots=self.adapters)
        self.structured: StructuredDecoding | None = None  # made on the first constrained request
        self._requests: dict[str, _RequestState] = {}
        self._seq_ids = itertools.count()
        self.spec = self._init_speculative()  # after the decode graphs: verify graphs go above their buckets
        # steps with prefill chunks: after the warm-up (its compiles serve the capture) and the speculative decoder
        # (an EAGLE-3 proposer's aux layers are captured too)
        self.runner.init_mixed_graphs()

    def _init_speculative(self):
        """The SpecDecoder of ``EngineConfig.speculative`` (None: off)."""
        if self.config.speculative is None:
            return None
        from loraplex.engine.spec_decode.decoder import SpecDecoder

        return SpecDecoder(self.config.speculative, self.runner, max_model_len=self.max_model_len,
                           max_num_seqs=self.config.max_num_seqs,
                           max_num_batched_tokens=self.config.max_num_batched_tokens,
                           vocab_size=self.model_config.vocab_size)

    def _init_async_scheduling(self) -> bool:
        """Resolve ``EngineConfig.async_scheduling``: None = on when decode steps replay CUDA graphs; True = on,
        setting up the eager padded decode path when no graphs were captured (what overlapped steps run on)."""
        mode = self.config.async_scheduling
        if mode is None:
            on = self.runner.num_cuda_graphs > 0
        else:
            on = bool(mode)
            if on and self.runner.decode_graphs is None:
                self.runner.init_decode_graphs(capture=False)
        logger.info("overlapped (async) scheduling %s", "on" if on else "off")
        return on

    @classmethod
    def from_pretrained(cls, model: str, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(model=model, **kwargs))

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    adapter: AdapterRef | None = None, arrival_time: float | None = None, *,
                    tenant: str | None = None, weight: float = 1.0) -> None:
        """Queue a request (``adapter``: None = base model) of ``tenant`` (None: no tenant; such requests share
        one) with scheduling ``weight`` (> 0: its tenant's share of the engine when tenants compete; the latest
        request's weight is the tenant's). Raises ValueError naming the problem; nothing is queued then. The
        adapter's load starts now; an adapter that fails to load finishes the request with an error output, not
        an exception here."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"tenant must be a string or None, got {type(tenant).__name__}")
        check_weight(weight)
        if adapter is not None:
            if self.adapters is None:
                raise ValueError("this engine serves the base model only: start it with enable_lora=True to serve "
                                 "adapters")
            if not isinstance(adapter, AdapterRef):
                raise TypeError(f"adapter must be an AdapterRef, got {type(adapter).__name__}")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.verify(self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer, and the model at {self.config.model!r} has none; use "
                             "stop_token_ids")
        if params.structured is not None:
            self._structured_decoding()  # ValueError without a tokenizer
        token_ids = self.tokenize(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(next(self._seq_ids), request_id, token_ids, extra_key=adapter)
        group = SequenceGroup(request_id, [seq], params, arrival_time=arrival, adapter=adapter, tenant=tenant,
                              weight=weight)
        self.scheduler.add(group)  # validates budget fit; raises before anything is recorded here
        # after that check of n / best_of / beam_width against max_num_seqs: a huge n never stalls the loop here
        generators = [self.runner.make_generator(_child_seed(params.seed, i)) if params.seed is not None else None
                      for i in range(params.num_sequences)]
        if params.structured is not None:
            try:
                self.structured.add_request(request_id, params.structured)  # a known-bad grammar raises here
            except ValueError:
                self.scheduler.abort(request_id)
                raise
        self._requests[request_id] = _RequestState(group, params, generators, RequestMetrics(arrival))
        if adapter is not None and self.adapters.slot_of(adapter) is None:
            self.adapters.ensure_loading(adapter)  # off the step loop, from now on

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (a text through the tokenizer, special tokens added; ids checked against the
        vocabulary), refused when they leave no room to generate. Reads only the tokenizer: safe from any thread
        (``AsyncEngine`` tokenizes texts off the engine thread, which then checks at most ``max_model_len`` ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"the model at {self.config.model!r} has no tokenizer; pass token ids")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = list(prompt)
        if len(token_ids) >= self.max_model_len:   # before the per-id check: a huge list is refused at once
            raise ValueError(f"prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                             f"max_model_len={self.max_model_len}; shorten the prompt")
        if not isinstance(prompt, str):
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if not token_ids:
            raise ValueError("prompt is empty")
        return token_ids

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its KV blocks at once. False if it is unknown or done."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.abort(request_id)
        if self.structured is not None:
            self.structured.remove(request_id)
        if self.spec is not None:
            for seq in state.group.seqs:
                self.spec.release(seq.seq_id)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or an overlapped step is still to be resolved."""
        return bool(self._requests) or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the outputs of the requests it advanced (with overlapped
        scheduling: of the step before it, whose tokens it read after launching this one)."""
        failed = self._fail_adapter_requests() + self._fail_grammar_requests()
        unreported = None  # a step resolved here whose outputs are built once this one is launched
        if self._inflight is not None and self._inflight.verify:  # its tokens decide what this step computes
            unreported = self._resolve_verify()
        speculating = self.spec is not None and self.spec.has_candidates(self.scheduler.running, self._spec_request)
        if speculating:
            if self._inflight is not None:  # drafts follow the tokens of the step in flight
                unreported = self._resolve_tokens()
            self.spec.propose(self.scheduler.running, self._spec_request)
        out = self.scheduler.schedule()
        spec_step = self.spec is not None and self.spec.after_schedule(out, self._spec_request)
        now = time.monotonic()
        for request_id in out.preempted:
            if request_id in self._requests:
                self._requests[request_id].metrics.num_preemptions += 1
        moves = out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy
        if not out.scheduled and not moves:
            failed += self._report(unreported)
            if self._inflight is not None:
                return failed + self._resolve_inflight()
            if not failed and self.adapters is not None:
                self.adapters.wait_for_progress(0.01)  # everyone waits on an adapter load: don't spin
            if not failed and self.structured is not None:
                self.structured.wait_for_compiles(0.01)  # or on a grammar compile
            return failed
        sampling = self._sampling(out, now)
        lora_slots = self._lora_slots(out) if self.adapters is not None else None
        if self.async_scheduling and not speculating and not spec_step and can_overlap(
                out, self.runner, lambda rid: self._requests[rid].params):
            prev = self._inflight
            prev_tokens = prev.tokens if prev is not None else None
            if self._has_constrained(out):  # masks need step n's tokens: forward, resolve n, masks, sample, outputs
                logits = self.runner.launch_forward(out, lora_slots, prev_tokens)
                resolved = self._resolve_tokens() if prev is not None else None
                tokens = self.runner.sample_launched(out, sampling, logits, self._bitmask(out))
                outputs = self._resolved_outputs(*resolved) if resolved is not None else []
            else:
                tokens = self.runner.launch_decode(out, sampling, lora_slots, prev_tokens)
                outputs = self._resolve_inflight() if prev is not None else []
            outputs = self._report(unreported) + outputs
            self.scheduler.update_launched(out)
            self._inflight = InflightStep(out, tokens)
            self.num_overlapped_steps += 1
            return failed + outputs
        if (spec_step and self.async_scheduling and self._inflight is None
                and can_overlap_verify(out, lambda rid: self._requests[rid].params) and not self._has_constrained(out)):
            self.spec.launch(out, sampling, lora_slots, self.structured, self._spec_request)
            self._inflight = InflightStep(out, None, verify=True)
            self.num_overlapped_verify_steps += 1
            return failed + self._report(unreported)  # while the device verifies
        early = None  # an eager step enqueued behind the decode step in flight, before reading that one back
        if (self._inflight is not None and not self._inflight.verify and not spec_step
                and self.runner.can_launch_early(out)):
            early = self.runner.launch_eager(out, lora_slots, self._inflight.tokens)
            self.num_early_launched_steps += 1
        resolved_here = unreported is not None or self._inflight is not None
        drained: list[RequestOutput] = self._report(unreported)
        if self._inflight is not None:  # not overlappable: finish the step in flight, then run this one as usual
            drained += self._resolve_inflight()
        if resolved_here:  # a stop string (or a grammar) found in those outputs ends a sequence scheduled here
            out.scheduled = [s for s in out.scheduled if s.seq.status is SequenceStatus.RUNNING]
            if not out.scheduled and not moves:
                return failed + drained
        if spec_step:
            result = self.spec.execute(out, sampling, lora_slots, self.structured, self._spec_request)
        else:
            mask = self._bitmask(out)
            kw = {"token_bitmask": mask} if mask is not None else {}
            if early is not None:
                kw["launched"] = early
            if self.adapters is None:
                result = self.runner.execute(out, sampling, **kw)
            else:
                result = self.runner.execute(out, sampling, lora_slots=lora_slots, **kw)
        self._record_logprobs(out, result)
        finished = {g.request_id for g in self.scheduler.update(out, result.sampled, result.logprobs,
                                                                result.beam_logprobs)}
        if self.spec is not None:
            self.spec.after_update()
        sampled = [s.seq.request_id for s in out.scheduled if s.sample]
        failed += self._advance_grammars(sampled, finished)
        return failed + drained + self._step_outputs(sampled, finished)

    # ---- speculative decoding (engine/spec_decode/) ---------------------------------------------------------
    def _spec_request(self, request_id: str) -> tuple:
        """(params, adapter, generator) of a running request, for the SpecDecoder."""
        state = self._requests[request_id]
        return state.params, state.group.adapter, state.generators[0]

    def _drop_outputs_after(self, state: _RequestState, seq: Sequence, st: _SeqState, keep: int) -> None:
        """Forget the output tokens of ``seq`` past the first ``keep``: a verify step appended tokens after the one
        that completed a stop string, which non-speculative decoding would never have generated (their charge
        to the tenant is taken back)."""
        extra = seq.num_output_tokens - keep
        if extra <= 0:
            return
        dropped = st.logprobs[keep:] if state.params.logprobs is not None else []
        seq.cumulative_logprob -= sum(e.logprob for e in dropped if e is not None)
        del seq.output_token_ids[keep:]
        del st.logprobs[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        tenant = state.group.tenant_state
        if tenant is not None:
            tenant.output_tokens -= extra

    def _resolve_verify(self) -> tuple[list[str], set[str], list[RequestOutput]]:
        """The token half of an overlapped verify step: wait for its read-back, append the accepted tokens (rows of
        sequences finished or aborted since its launch are dropped), stop checks, grammar matchers. Returns what
        ``_resolve_tokens`` returns."""
        inflight, self._inflight = self._inflight, None
        out = inflight.out
        result = self.spec.finish(self._spec_request)
        alive = {s.seq.seq_id for s in out.scheduled if s.seq.status is SequenceStatus.RUNNING}
        for rows in (result.sampled, result.logprobs, result.prompt_logprobs, result.beam_logprobs):
            for seq_id in [i for i in rows if i not in alive]:
                del rows[seq_id]
        self._record_logprobs(out, result)
        finished = {g.request_id for g in self.scheduler.update(out, result.sampled, result.logprobs,
                                                                result.beam_logprobs)}
        self.spec.after_update()
        sampled = [s.seq.request_id for s in out.scheduled if s.sample and s.seq.seq_id in alive]
        return sampled, finished, self._advance_grammars(sampled, finished)

    def _report(self, resolved: tuple[list[str], set[str], list[RequestOutput]] | None) -> list[RequestOutput]:
        """The outputs of a step resolved earlier in this call (none: nothing)."""
        return self._resolved_outputs(*resolved) if resolved is not None else []

    def _resolve_inflight(self) -> list[RequestOutput]:
        """Wait for the overlapped step's tokens, write them into their sequences, stop checks, outputs."""
        return self._resolved_outputs(*self._resolve_tokens())

    def _resolve_tokens(self) -> tuple[list[str], set[str], list[RequestOutput]]:
        """The token half of ``_resolve_inflight``: wait for the tokens, write them in, stop checks, grammar
        matchers. Returns (requests that got a token, requests finished, outputs of requests failed)."""
        inflight, self._inflight = self._inflight, None
        accepted, finished = self.scheduler.update_resolved(inflight.out, inflight.tokens.wait())
        if self.spec is not None and finished:  # a sequence may finish in an overlapped step: its drafter's state
            self.spec.release_stopped()
        sampled, done = [seq.request_id for seq in accepted], {g.request_id for g in finished}
        return sampled, done, self._advance_grammars(sampled, done)

    def _resolved_outputs(self, sampled: list[str], done: set[str],
                          failed: list[RequestOutput]) -> list[RequestOutput]:
        """The output half: stop strings, detokenization, RequestOutputs."""
        return failed + self._step_outputs(sampled, done)

    def _step_outputs(self, sampled: list[str], finished: set[str]) -> list[RequestOutput]:
        """Stop strings and one RequestOutput per request that got a token or finished; finished ones are
        forgotten."""
        now = time.monotonic()
        touched = list(dict.fromkeys(sampled + sorted(finished)))
        outputs = []
        for request_id in touched:
            state = self._requests.get(request_id)
            if state is None:
                continue
            if self._apply_stop_strings(state):
                finished.add(request_id)
            done = request_id in finished
            if state.params.use_beam_search or (state.params.num_sequences > state.params.n):
                if not done:
                    continue  # beams and best_of candidates are reported once ranked, at the end
            outputs.append(self._make_output(state, done, now))
        for request_id in finished:
            state = self._requests.pop(request_id, None)
            if self.spec is not None and state is not None:  # its drafter's state (a draft model's KV blocks) now
                for seq in state.group.seqs:
                    self.spec.release(seq.seq_id)
            if self.structured is not None:
                self.structured.remove(request_id)
        return outputs

    def _sampling(self, out: SchedulerOutput, now: float) -> dict:
        """{seq_id: (params, generator)} of the step's sampling sequences (a list of generators at a fork step);
        records each request's first scheduling."""
        sampling = {}
        for s in out.scheduled:
            state = self._requests[s.seq.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                state.num_cached_tokens = s.seq.num_computed_tokens
            if s.sample:
                if s.num_samples > 1:  # fork step: one draw per future sequence, each from its own generator
                    gen = state.generators[:s.num_samples]
                else:
                    gen = state.generators[self._seq_index(state, s.seq)]
                sampling[s.seq.seq_id] = (state.params, gen)
        return sampling

    @staticmethod
    def _seq_index(state: _RequestState, seq: Sequence) -> int:
        """The sequence's index in its request (parent 0, forks in fork order); 0 for beams."""
        if state.params.use_beam_search:
            return 0
        return state.group.seqs.index(seq)

    def _record_logprobs(self, out: SchedulerOutput, result: ModelStepOutput) -> None:
        """Keep the sampled tokens' logprob entries (requests that ask) and the prompt logprobs."""
        for seq_id, (start, entries) in result.prompt_logprobs.items():
            seq = next(s.seq for s in out.scheduled if s.seq.seq_id == seq_id)
            state = self._requests[seq.request_id]
            if state.prompt_logprobs is None:
                state.prompt_logprobs = [None] * seq.num_prompt_tokens
            first = 0 if start == 0 else start + 1
            for pos, entry in enumerate(entries, first):
                if entry is not None:  # a recomputed chunk repeats positions: same values
                    state.prompt_logprobs[pos] = entry
        for s in out.scheduled:
            state = self._requests.get(s.seq.request_id)
            entries = result.logprobs.get(s.seq.seq_id)
            if state is None or not entries or state.params.logprobs is None:
                continue
            if s.draft_token_ids:  # a verify: one entry per appended token
                self._seq_state(state, s.seq).logprobs.extend(entries)
                continue
            self._seq_state(state, s.seq).logprobs.append(entries[0])
            if len(entries) > 1:  # fork step: the children do not exist yet
                state.fork_logprobs = list(entries[1:])

    def _seq_state(self, state: _RequestState, seq: Sequence) -> _SeqState:
        st = state.seqs.get(seq.seq_id)
        if st is None:
            params = state.params
            st = _SeqState(IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
                           StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None)
            parent = state.seqs.get(seq.parent_seq_id) if seq.parent_seq_id is not None else None
            if parent is not None and state.fork_logprobs:  # a fork's first token was drawn in its parent's row
                st.logprobs = parent.logprobs[:-1] + [state.fork_logprobs.pop(0)]
            state.seqs[seq.seq_id] = st
        return st

    def _apply_stop_strings(self, state: _RequestState) -> bool:
        """Detokenize the new tokens of every sequence, match stop strings and end sequences that hit one.
        True when that finished the request."""
        if state.params.use_beam_search:
            return False
        group_done = False
        for seq in state.group.seqs:
            st = self._seq_state(state, seq)
            if st.detokenizer is None or st.closed:
                continue
            finished = seq.status.is_finished
            st.closed = finished
            n = seq.num_output_tokens
            # one token at a time where a verify step appended several and a stop string may end inside them
            ends = [n] if st.matcher is None or n - st.num_detokenized <= 1 else range(st.num_detokenized + 1, n + 1)
            for end in ends:
                ids = seq.output_token_ids if end == n else seq.output_token_ids[:end]
                delta = st.detokenizer.update(ids, final=finished and end == n)
                st.num_detokenized = end
                if st.matcher is None:
                    st.text += delta
                    break
                match = st.matcher.append(delta)
                if match.stopped:
                    self._drop_outputs_after(state, seq, st, end)
                    break
            if st.matcher is None:
                continue
            if match.stopped:
                st.stop_reason, st.closed = match.stop_str, True
                if finished:
                    seq.status = SequenceStatus.FINISHED_STOPPED
                elif self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED) is not None:
                    group_done = True
            elif finished:
                st.matcher.flush()
            st.text = st.matcher.text
        return group_done

    # ---- structured outputs ---------------------------------------------------------------------------------
    def _structured_decoding(self) -> StructuredDecoding:
        if self.structured is None:
            if self.tokenizer is None:
                raise ValueError(f"structured outputs need a tokenizer, and the model at {self.config.model!r} has "
                                 "none")
            self.structured = StructuredDecoding(self.tokenizer, vocab_size=self.model_config.vocab_size,
                                                 eos_token_ids=self.eos_token_ids,
                                                 pin_memory=self.runner.device.type == "cuda")
        return self.structured

    def _grammar_ready(self, group: SequenceGroup) -> bool:
        """The scheduler's admission check: a constrained request waits until its grammar is compiled."""
        return self.structured is None or self.structured.state(group.request_id) in (None, "ready")

    def _has_constrained(self, out: SchedulerOutput) -> bool:
        return self.structured is not None and any(self.structured.is_constrained(s.seq.request_id)
                                                   for s in out.scheduled)

    def _bitmask(self, out: SchedulerOutput):
        """The grammar masks of the step's running constrained sequences that sample (None: none)."""
        if self.structured is None:
            return None
        return self.structured.bitmask([s.seq for s in out.scheduled
                                        if s.sample and s.seq.status is SequenceStatus.RUNNING])

    def _advance_grammars(self, sampled: list[str], finished: set[str]) -> list[RequestOutput]:
        """Feed the step's new tokens to the matchers of constrained requests that sampled; a sequence whose grammar
        is complete finishes ("stop"; its request joins ``finished`` when it was the last). Returns the outputs of
        requests failed because their grammar refused a token (an engine fault) or hit the parser's limits (an
        invalid request)."""
        if self.structured is None:
            return []
        seqs = [seq for rid in dict.fromkeys(sampled) if rid in self._requests and self.structured.is_constrained(rid)
                for seq in self._requests[rid].group.seqs]
        if not seqs:
            return []
        done, refused = self.structured.advance(seqs)
        for seq in done:
            if self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED) is not None:
                finished.add(seq.request_id)
        outputs = []
        for seq, error, error_type in refused:
            state = self._requests.get(seq.request_id)
            if state is not None:
                level = logging.ERROR if error_type == "engine_error" else logging.INFO
                logger.log(level, "request %s: %s", seq.request_id, error)
                outputs.append(self._fail_request(state, error, error_type))
                finished.discard(seq.request_id)
        return outputs

    def _fail_grammar_requests(self) -> list[RequestOutput]:
        """Finish requests whose grammar failed to compile, with finish_reason "error" (an invalid request)."""
        if self.structured is None:
            return []
        outputs = []
        for request_id in self.structured.failed_requests():
            state = self._requests.get(request_id)
            if state is None:
                self.structured.remove(request_id)
                continue
            kind = state.params.structured.kind
            reason = self.structured.error(request_id)
            logger.info("request %s failed: its %s did not compile", request_id, kind)
            outputs.append(self._fail_request(state, f"structured.{kind}: {reason}", "invalid_request"))
        return outputs

    def _fail_request(self, state: _RequestState, error: str, error_type: str,
                      retryable: bool = False) -> RequestOutput:
        """End a request with finish_reason "error": free everything it holds, return its last output."""
        request_id = state.group.request_id
        self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)
        if self.structured is not None:
            self.structured.remove(request_id)
        if self.spec is not None:
            for seq in state.group.seqs:
                self.spec.release(seq.seq_id)
        out = self._make_output(state, True, time.monotonic())
        out.finish_reason, out.error, out.error_retryable, out.error_type = "error", error, retryable, error_type
        for c in out.outputs:
            c.finish_reason = "error"
        return out

    # ---- adapters -------------------------------------------------------------------------------------------
    def _lora_slots(self, out) -> dict[int, int]:
        """{seq_id: GPU slot} of this step's sequences that use an adapter (the scheduler activated them)."""
        slots = {}
        for s in out.scheduled:
            adapter = self._requests[s.seq.request_id].group.adapter
            if adapter is not None:
                slot = self.adapters.slot_of(adapter)
                if slot is None:  # the scheduler admits only resident adapters and never evicts running ones
                    raise RuntimeError(f"adapter {adapter.adapter_id!r} of a running request has no slot")
                slots[s.seq.seq_id] = slot
        return slots

    def _fail_adapter_requests(self) -> list[RequestOutput]:
        """Finish waiting requests whose adapter failed to load, with finish_reason "error" and the reason."""
        if self.adapters is None:
            return []
        outputs = []
        for seq in list(self.scheduler.waiting):
            state = self._requests.get(seq.request_id)
            adapter = state.group.adapter if state is not None else None
            if adapter is None or self.adapters.state(adapter) != "failed":
                continue
            reason = self.adapters.error(adapter)
            err = AdapterLoadError(f"adapter {adapter.adapter_id!r} could not be loaded: {reason}",
                                   retryable=is_transient_failure(reason))
            logger.info("request %s failed: adapter %s did not load", seq.request_id, adapter.adapter_id)
            outputs.append(self._fail_request(state, str(err), "adapter_load_error", err.retryable))
        return outputs

    def load_adapter(self, adapter: AdapterRef, *, wait: bool = False, timeout: float | None = None) -> str:
        """Preload ``adapter`` into the CPU tier (retrying a remembered failure); GPU slots are filled on demand.
        Returns its state: "ready", "loading" or "failed" (``list_adapters()["failed"]`` says why)."""
        self._require_lora()
        state = self.adapters.ensure_loading(adapter, retry=True)
        return self.adapters.wait(adapter, timeout) if wait and state == "loading" else state

    def evict_adapter(self, adapter: AdapterRef) -> bool:
        """Drop ``adapter`` from GPU and CPU (the disk cache keeps it) and forget a failure. ValueError while a
        running request uses it. Call from the thread that steps the engine."""
        self._require_lora()
        users = [s.request_id for s in self.scheduler.running if self._requests[s.request_id].group.adapter == adapter]
        if users:
            raise ValueError(f"adapter {adapter.adapter_id!r} is in use by {len(users)} running request(s); abort "
                             "them or wait for them to finish")
        return self.adapters.evict(adapter)

    def pin_adapter(self, adapter: AdapterRef, pinned: bool = True) -> None:
        """Pin (never evict from CPU or its slot; starts its load) or unpin an adapter."""
        self._require_lora()
        if pinned:
            self.adapters.pin(adapter)
        else:
            self.adapters.unpin(adapter)

    def register_draft_adapter(self, adapter_id: str, path: str) -> None:
        """Make the LoRA of the draft model at ``path`` (the folder itself, or one holding it in ``draft/``) the
        draft of ``adapter_id``: that adapter's requests draft with it, the rest with the bare draft. Needs
        speculative method "draft" with ``draft_adapters`` set. Call from the thread that steps the engine."""
        if self.spec is None:
            raise ValueError("speculative decoding is off on this engine; per-adapter drafts need speculative "
                             "method 'draft' with draft_adapters set")
        self.spec.draft_adapters().register(adapter_id, path)

    def unregister_draft_adapter(self, adapter_id: str) -> bool:
        """Drop ``adapter_id``'s draft LoRA (its requests then draft with the bare draft); False when it had none."""
        if self.spec is None:
            raise ValueError("speculative decoding is off on this engine")
        return self.spec.draft_adapters().unregister(adapter_id)

    def list_adapters(self) -> dict:
        """Residency per tier, pins, failures and counters (see AdapterManager.residency)."""
        self._require_lora()
        return self.adapters.residency()

    def _require_lora(self) -> None:
        if self.adapters is None:
            raise ValueError("LoRA is disabled on this engine; start it with enable_lora=True")

    def close(self) -> None:
        """Stop background adapter loads (the engine's other resources go with the object); a step still in
        flight is waited for, its tokens dropped."""
        if self._inflight is not None:
            if self._inflight.verify:
                self.spec.finish(self._spec_request)
            else:
                self._inflight.tokens.wait()
            self._inflight = None
        if self.adapters is not None:
            self.adapters.close()
        if self.structured is not None:
            self.structured.close()
        if self.spec is not None:
            self.spec.close()
        shutdown = getattr(self.runner, "shutdown", None)  # tensor parallel: stop the workers
        if shutdown is not None:
            shutdown()

    def _make_output(self, state: _RequestState, finished: bool, now: float) -> RequestOutput:
        group, params = state.group, state.params
        if finished:
            state.metrics.finished_time = now
        if params.use_beam_search and group.beam_search is not None and group.beam_search.done:
            completions = [self._beam_completion(i, h) for i, h in enumerate(group.beam_search.best(params.n))]
        else:
            if finished and params.num_sequences > params.n:
                seqs = group.best_seqs(params.n)
            else:
                seqs = [s for s in group.seqs][:params.num_sequences]
            completions = [self._completion(i, state, s) for i, s in enumerate(seqs)]
        if not completions:  # aborted before it ran
            seq = group.seqs[0]
            completions = [CompletionOutput(0, list(seq.output_token_ids), [], "", "",
                                            seq.finish_reason if finished else None)]
        if any(c.new_token_ids for c in completions) and state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        first = completions[0]
        return RequestOutput(
            request_id=group.request_id, prompt_token_ids=group.seqs[0].prompt_token_ids,
            output_token_ids=list(first.output_token_ids), new_token_ids=list(first.new_token_ids), text=first.text,
            new_text=first.new_text, finished=finished, finish_reason=first.finish_reason if finished else None,
            num_cached_tokens=state.num_cached_tokens, metrics=state.metrics, adapter=group.adapter,
            outputs=completions, prompt_logprobs=state.prompt_logprobs if finished else None)

    def _completion(self, index: int, state: _RequestState, seq: Sequence) -> CompletionOutput:
        st = self._seq_state(state, seq)
        new_ids = seq.output_token_ids[st.num_reported:]
        st.num_reported = seq.num_output_tokens
        new_text, st.reported_text = st.text[len(st.reported_text):], st.text
        return CompletionOutput(
            index=index, output_token_ids=list(seq.output_token_ids), new_token_ids=list(new_ids), text=st.text,
            new_text=new_text, finish_reason=seq.finish_reason,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(st.logprobs) if state.params.logprobs is not None else None, stop_reason=st.stop_reason)

    def _beam_completion(self, index: int, h) -> CompletionOutput:
        text = self.tokenizer.decode(h.output_token_ids, skip_special_tokens=True) if self.tokenizer else ""
        return CompletionOutput(index=index, output_token_ids=list(h.output_token_ids),
                                new_token_ids=list(h.output_token_ids), text=text, new_text=text,
                                finish_reason=h.finish_reason, cumulative_logprob=h.cumulative_logprob,
                                beam_score=h.score)

    # ---- convenience ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 adapters: AdapterRef | list[AdapterRef | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion together (continuous batching); outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        alist = adapters if isinstance(adapters, list) else [adapters] * len(prompts)
        ids = [f"generate-{next(self._seq_ids)}" for _ in prompts]
        for rid, prompt, p, a in zip(ids, prompts, plist, alist):
            self.add_request(rid, prompt, p, a)
        final: dict[str, RequestOutput] = {}
        while any(rid not in final for rid in ids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[rid] for rid in ids]
