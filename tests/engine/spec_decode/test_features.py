"""Speculative decoding with the rest of the engine's decoding features: grammar-constrained requests (draft masks,
a draft the grammar refuses, a grammar completed inside an accepted run), logprobs, penalties, min_tokens and
logit_bias applied at every verified position, seeded sampling reproducible, the per-request opt-out, overlapped
scheduling, hidden states for proposers that ask, and the stats / Prometheus output."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine import SamplingParams
from loraplex.engine.spec_decode.proposer import Proposer
from loraplex.engine.spec_decode.replay import ReplayProposer
from loraplex.engine.structured import StructuredOutput
from tests.engine.spec_decode.conftest import assert_all_free, drive, make_engine, prompt_list

GREEDY = dict(temperature=0.0, ignore_eos=True)


def outputs(finals) -> dict:
    return {rid: o.output_token_ids for rid, o in finals.items()}


def with_replay(engine, requests, want, rate=0.6, k=4):
    engine.spec.proposer = ReplayProposer(k, rate, vocab_size=engine.model_config.vocab_size, forced=False)
    for rid, prompt, _, _ in requests:
        engine.spec.proposer.record(prompt, want[rid])


def replay_engine(path, **kw):
    return make_engine(path, dict(method="replay", num_speculative_tokens=4, replay_forced=False), **kw)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_structured_outputs(llama, perturbed_checkpoint):
    """Constrained and free requests in one batch: identical to the non-speculative run with replayed drafts (a
    planted wrong draft is mostly one the grammar refuses) and with a draft model (drafts past the grammar's end)."""
    kinds = [StructuredOutput(regex=r"[a-z]{2,6}( [a-z]{2,5}){2,3}"), StructuredOutput(choice=["alpha beta", "gamma"]),
             StructuredOutput(json_schema={"type": "object", "properties": {"n": {"type": "integer"}},
                                           "required": ["n"], "additionalProperties": False}), None]
    prompts = prompt_list((6, 8, 5, 7), seed=9)
    requests = [(f"r{i}", prompts[i], SamplingParams(max_tokens=40, temperature=0.0, structured=kind), None)
                for i, kind in enumerate(kinds)]
    want = outputs(drive(make_engine(llama), requests))
    texts = {}
    for name in ("replay", "draft"):
        if name == "replay":
            engine = replay_engine(llama)
            with_replay(engine, requests, want)
        else:
            engine = make_engine(llama, dict(method="draft", num_speculative_tokens=4,
                                             draft_model=perturbed_checkpoint(llama, 0.1)))
        finals = drive(engine, requests)
        assert outputs(finals) == want, name
        assert [finals[f"r{i}"].finish_reason for i in range(3)] == ["stop"] * 3
        texts[name] = [finals[f"r{i}"].text for i in range(3)]
        stats = engine.spec.snapshot()
        assert 0 < stats["accepted"] < stats["proposed"], (name, stats)
        assert_all_free(engine)
    assert texts["replay"] == texts["draft"] and texts["replay"][1] in ("alpha beta", "gamma")


def test_logprobs_penalties_min_tokens_logit_bias(llama):
    """Every per-request control at every verified position: the same tokens (and logprobs) as without speculation."""
    prompts = prompt_list((7, 9, 6, 8, 5), seed=10)
    params = [SamplingParams(max_tokens=14, logprobs=3, **GREEDY),
              SamplingParams(max_tokens=16, repetition_penalty=1.4, **GREEDY),
              SamplingParams(max_tokens=16, presence_penalty=0.8, frequency_penalty=0.6, **GREEDY),
              SamplingParams(max_tokens=12, temperature=0.0, min_tokens=10),
              SamplingParams(max_tokens=15, logit_bias={prompts[4][0]: 4.0, 7: -100.0}, **GREEDY)]
    requests = [(f"r{i}", prompts[i], p, None) for i, p in enumerate(params)]
    ref = drive(make_engine(llama), requests)
    want = outputs(ref)
    engine = replay_engine(llama)
    with_replay(engine, requests, want, rate=0.7)
    finals = drive(engine, requests)
    assert outputs(finals) == want
    got_lp, want_lp = finals["r0"].outputs[0].logprobs, ref["r0"].outputs[0].logprobs
    assert len(got_lp) == len(want_lp) == 14
    for g, w in zip(got_lp, want_lp):
        assert g.token_id == w.token_id and g.rank == w.rank and abs(g.logprob - w.logprob) < 1e-4
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
    assert abs(finals["r0"].outputs[0].cumulative_logprob - ref["r0"].outputs[0].cumulative_logprob) < 1e-3
    stats = engine.spec.snapshot()
    assert stats["accepted"] > 0 and stats["verified"] >= 5
    assert_all_free(engine)


def test_seeded_sampling_is_reproducible(llama, perturbed_checkpoint):
    prompts = prompt_list((6, 9, 7), seed=11)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    runs = []
    for _ in range(2):
        engine = make_engine(llama, dict(method="draft", num_speculative_tokens=3,
                                         draft_model=perturbed_checkpoint(llama, 0.1)))
        runs.append([o.output_token_ids for o in engine.generate(prompts, params)])
        assert engine.spec.snapshot()["accepted"] > 0
    assert runs[0] == runs[1] and all(len(r) == 12 for r in runs[0])


def test_opt_out_and_overlapped_scheduling(llama):
    """Requests with ``speculative=False`` never get drafts; with async scheduling, steps run synchronously while a
    sequence may speculate and overlap again once none can (all opted out); tokens are the same either way."""
    prompts = [p[:3] * 6 for p in prompt_list((6, 8, 7), seed=12)]  # repeats: prompt lookup always drafts
    requests = [(f"r{i}", p, SamplingParams(max_tokens=18, **GREEDY), None) for i, p in enumerate(prompts)]
    want = outputs(drive(make_engine(llama), requests))
    spec = dict(method="ngram", num_speculative_tokens=3)
    engine = make_engine(llama, spec, async_scheduling=True)
    assert outputs(drive(engine, requests)) == want
    # only a request's last token (no room for a draft) may overlap
    assert engine.spec.snapshot()["verified"] > 0 and engine.num_overlapped_steps <= len(requests)
    out_out = [(rid, p, SamplingParams(max_tokens=18, speculative=False, **GREEDY), a) for rid, p, _, a in requests]
    engine = make_engine(llama, spec, async_scheduling=True)
    assert outputs(drive(engine, out_out)) == want
    assert engine.spec.snapshot()["verified"] == 0 and engine.num_overlapped_steps > 10
    mixed = [requests[0]] + out_out[1:]
    engine = make_engine(llama, spec)
    assert outputs(drive(engine, mixed)) == want
    stats = engine.spec.snapshot()
    assert stats["verified"] > 0 and stats["proposer"]["sequences"] == 0  # state dropped at the end
    assert_all_free(engine)


def test_overlapped_steps_free_the_draft_models_blocks(llama, perturbed_checkpoint):
    """With a draft model and async scheduling, a request whose last token comes from an overlapped step (no room
    for drafts) still frees its draft-model KV blocks and proposer state; the tokens are the non-speculative ones."""
    prompts = prompt_list((6, 9, 4, 11, 7, 5), seed=3)
    requests = [(f"r{i}", p, SamplingParams(max_tokens=14 + i, **GREEDY), None) for i, p in enumerate(prompts)]
    want = outputs(drive(make_engine(llama), requests))
    spec = dict(method="draft", draft_model=perturbed_checkpoint(llama, 0.1), num_speculative_tokens=3)
    engine = make_engine(llama, spec, async_scheduling=True)
    assert outputs(drive(engine, requests)) == want
    assert engine.num_overlapped_steps > 0 and engine.spec.snapshot()["verified"] > 0
    assert_all_free(engine)


class _HiddenProbe(Proposer):
    """Asks for the target's hidden states, records what it is given, proposes the recorded next tokens."""

    name = "probe"
    needs_hidden_states = True

    def __init__(self, replay: ReplayProposer) -> None:
        self.replay = replay
        self.pieces: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def propose(self, batch):
        for s in batch:
            if s.hidden_states is not None:
                self.pieces.setdefault(s.seq_id, []).append((s.hidden_start, s.hidden_states))
        return self.replay.propose(batch)


def test_hidden_states_for_proposers_that_ask(llama):
    """A proposer with ``needs_hidden_states`` gets, for each sequence, the target's final hidden states of every
    position exactly once, in order, accepted tokens only: equal to transformers' last hidden states."""
    from transformers import AutoModelForCausalLM

    prompts = prompt_list((7, 10), seed=13)
    requests = [(f"r{i}", p, SamplingParams(max_tokens=14, **GREEDY), None) for i, p in enumerate(prompts)]
    want = outputs(drive(make_engine(llama), requests))
    engine = replay_engine(llama)
    replay = ReplayProposer(4, 0.6, vocab_size=engine.model_config.vocab_size, forced=False)
    for rid, prompt, _, _ in requests:
        replay.record(prompt, want[rid])
    probe = _HiddenProbe(replay)
    engine.spec.proposer = probe
    finals = drive(engine, requests)
    assert outputs(finals) == want and engine.spec.snapshot()["accepted"] > 0
    assert len(probe.pieces) == len(requests)
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32, attn_implementation="eager").eval()
    for (rid, prompt, _, _), pieces in zip(requests, probe.pieces.values()):
        starts = [s for s, _ in pieces]
        ends = [s + h.shape[0] for s, h in pieces]
        assert starts[0] == 0 and starts[1:] == ends[:-1], (starts, ends)  # contiguous, each position once
        got = torch.cat([h for _, h in pieces])
        ids = torch.tensor([prompt + want[rid]])
        with torch.no_grad():
            ref = hf(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, :got.shape[0]]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert_all_free(engine)


def test_stats_and_metrics(llama):
    from loraplex.engine.server.metrics import render_metrics
    from loraplex.engine.stats import engine_stats

    prompts = [p * 3 for p in prompt_list((5, 6), seed=14)]
    engine = make_engine(llama, dict(method="ngram", num_speculative_tokens=3))
    engine.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    spec = engine_stats(engine)["speculative"]
    assert spec["method"] == "ngram" and spec["verified"] > 0 and spec["adapters"][0]["adapter"] is None
    assert spec["acceptance_length"] == pytest.approx((spec["accepted"] + spec["verified"]) / spec["verified"])
    assert spec["proposer"]["hits"] > 0
    text = render_metrics(engine_stats(engine), model="tiny").decode()
    for name in ("spec_proposed_tokens_total", "spec_accepted_tokens_total", "spec_verifications_total",
                 "spec_emitted_tokens_total", "spec_acceptance_length", "spec_verify_steps_total"):
        assert f"loraplex_engine_server_{name}" in text, name
    assert 'loraplex_engine_server_spec_proposed_tokens_total{adapter="_base"} ' + f"{float(spec['proposed'])}" in text
    assert engine_stats(make_engine(llama))["speculative"] is None
    assert "spec_proposed" not in render_metrics(engine_stats(make_engine(llama)), model="tiny").decode()


def test_requests_that_cannot_speculate_share_verify_steps_unchanged(llama):
    """Beam search, n > 1 and prompt logprobs ride in verify steps as plain entries: their tokens are those of the
    non-speculative engine (same sampler, same generators), while the others speculate."""
    prompts = [p[:3] * 5 for p in prompt_list((6, 8, 7, 9), seed=15)]
    params = [SamplingParams(max_tokens=12, **GREEDY), SamplingParams(max_tokens=10, use_beam_search=True, beam_width=2,
                                                                      temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, n=2, temperature=0.8, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=9, prompt_logprobs=2, **GREEDY)]
    requests = [(f"r{i}", prompts[i], p, None) for i, p in enumerate(params)]
    ref = drive(make_engine(llama), requests, arrivals={0: [0, 1, 2], 3: [3]})
    engine = make_engine(llama, dict(method="ngram", num_speculative_tokens=3))
    shared = set()
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        if any(s.draft_token_ids for s in out.scheduled):
            shared.update(s.seq.request_id for s in out.scheduled if not s.draft_token_ids)
        return out

    engine.scheduler.schedule = watched
    finals = drive(engine, requests, arrivals={0: [0, 1, 2], 3: [3]})
    assert {"r1", "r2"} <= shared, shared
    for rid in ref:
        assert [c.output_token_ids for c in finals[rid].outputs] == [c.output_token_ids for c in ref[rid].outputs]
    assert [e.token_id if e else None for e in finals["r3"].prompt_logprobs] == \
        [e.token_id if e else None for e in ref["r3"].prompt_logprobs]
    assert engine.spec.snapshot()["verified"] > 0
    assert_all_free(engine)
