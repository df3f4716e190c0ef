"""The synchronous engine: requests in, one scheduling + model step at a time, outputs out.

    add_request ─▶ SequenceGroup ─▶ Scheduler.schedule() ─▶ SchedulerOutput ─▶ ModelRunner.execute()
                                          ▲                                            │ {seq_id: token}
                                          └──────────── Scheduler.update() ◀───────────┘ ─▶ RequestOutput
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.model_runner import ModelRunner
from loraplex.engine.outputs import RequestMetrics, RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.sequence import Sequence, SequenceGroup

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN_CAP = 8192


@dataclass
class _RequestState:
    group: SequenceGroup
    params: SamplingParams
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0


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

        self.config = config
        model_config = ModelConfig.from_pretrained(config.model)
        self.max_model_len = config.max_model_len or min(model_config.max_position_embeddings,
                                                         DEFAULT_MAX_MODEL_LEN_CAP)
        self.runner = ModelRunner(config, self.max_model_len, config.max_num_seqs)
        self.model_config = self.runner.model_config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        eos = list(dict.fromkeys(self.model_config.eos_token_ids + _generation_eos_ids(config.model)))
        self.eos_token_ids = eos
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size,
                                       enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
                            eos_token_ids=eos),
            self.kv_cache)
        self._requests: dict[str, _RequestState] = {}
        self._seq_ids = itertools.count()

    @classmethod
    def from_pretrained(cls, model: str, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(model=model, **kwargs))

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    adapter: object | None = None, arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError naming the problem; nothing is queued then."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.verify(self.model_config.vocab_size)
        token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                             f"max_model_len={self.max_model_len}; shorten the prompt")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(next(self._seq_ids), request_id, token_ids, extra_key=adapter)
        group = SequenceGroup(request_id, [seq], params, arrival_time=arrival, adapter=adapter)
        generator = self.runner.make_generator(params.seed) if params.seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.scheduler.add(group)  # validates budget fit; raises before anything is recorded here
        self._requests[request_id] = _RequestState(group, params, generator, detok, RequestMetrics(arrival))

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"the model at {self.config.model!r} has no tokenizer; pass token ids")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = list(prompt)
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
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        now = time.monotonic()
        for request_id in out.preempted:
            if request_id in self._requests:
                self._requests[request_id].metrics.num_preemptions += 1
        if not out.scheduled:
            return []
        sampling = {}
        for s in out.scheduled:
            state = self._requests[s.seq.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                state.num_cached_tokens = s.seq.num_computed_tokens
            if s.sample:
                sampling[s.seq.seq_id] = (state.params, state.generator)
        sampled = self.runner.execute(out, sampling)
        finished = {g.request_id for g in self.scheduler.update(out, sampled)}
        now = time.monotonic()
        outputs = []
        for s in out.scheduled:
            if s.seq.seq_id not in sampled and s.seq.request_id not in finished:
                continue
            state = self._requests[s.seq.request_id]
            outputs.append(self._make_output(state, [sampled[s.seq.seq_id]] if s.seq.seq_id in sampled else [],
                                             s.seq.request_id in finished, now))
        for request_id in finished:
            self._requests.pop(request_id, None)
        return outputs

    def _make_output(self, state: _RequestState, new_ids: list[int], finished: bool, now: float) -> RequestOutput:
        seq = state.group.seqs[0]
        if new_ids and state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        if finished:
            state.metrics.finished_time = now
        text = new_text = ""
        if state.detokenizer is not None:
            new_text = state.detokenizer.update(seq.output_token_ids, final=finished)
            text = state.detokenizer.text
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=list(seq.output_token_ids), new_token_ids=new_ids, text=text, new_text=new_text,
            finished=finished, finish_reason=seq.finish_reason if finished else None,
            num_cached_tokens=state.num_cached_tokens, metrics=state.metrics, adapter=state.group.adapter)

    # ---- convenience ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion together (continuous batching); outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._seq_ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while any(rid not in final for rid in ids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[rid] for rid in ids]
