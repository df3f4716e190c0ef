"""Speculative decoding against the KV cache and the scheduler: preemption by recompute and by swapping, prefix hits
on blocks that verify steps computed, chunked prefill sharing the token budget with verify steps, aborts in the
middle of a verify step and between proposing and scheduling, tenant-fair charging. Greedy tokens equal the
non-speculative run under the same limits; invariants hold after every step; every block is free at the end."""
from __future__ import annotations

import pytest

from loraplex.engine import SamplingParams
from loraplex.engine.spec_decode.replay import ReplayProposer
from tests.engine.spec_decode.conftest import assert_all_free, drive, make_engine, prompt_list

GREEDY = dict(temperature=0.0, ignore_eos=True)


def reqs(prompts, lengths, prefix="r"):
    return [(f"{prefix}{i}", p, SamplingParams(max_tokens=n, **GREEDY), None)
            for i, (p, n) in enumerate(zip(prompts, lengths))]


def outputs(finals) -> dict:
    return {rid: o.output_token_ids for rid, o in finals.items()}


def replay_spec(k=3, rate=0.6):
    return dict(method="replay", num_speculative_tokens=k, replay_acceptance_rate=rate, replay_forced=False)


def record(engine, requests, want):
    for rid, prompt, _, _ in requests:
        engine.spec.proposer.record(prompt, want[rid])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("proposer", ["replay", "draft"])
def test_preemption(mode, proposer, tiny_checkpoint, perturbed_checkpoint):
    """A 22-block pool (block size 4) for six requests of up to 8 blocks each: sequences are preempted with drafts
    around; a preempted sequence's proposer state (the draft's K/V) is dropped and rebuilt when it runs again."""
    path = tiny_checkpoint("qwen3")
    limits = dict(num_kv_blocks=22, preemption_mode=mode, num_cpu_blocks=40 if mode == "swap" else 0,
                  max_num_seqs=6)
    requests = reqs(prompt_list((9, 6, 12, 7, 10, 5), seed=4), (20, 18, 16, 22, 14, 19))
    ref = make_engine(path, **limits)
    want = outputs(drive(ref, requests))
    assert ref.scheduler.num_preemptions > 0
    spec = replay_spec() if proposer == "replay" else dict(method="draft", num_speculative_tokens=3,
                                                           draft_model=perturbed_checkpoint(path, 0.1))
    engine = make_engine(path, spec, **limits)
    if proposer == "replay":
        record(engine, requests, want)
    got = outputs(drive(engine, requests))
    assert got == want
    assert engine.scheduler.num_preemptions > 0 and engine.spec.snapshot()["accepted"] > 0
    if mode == "swap":
        assert engine.scheduler.num_swap_outs > 0
    assert_all_free(engine)


def test_prefix_hits_on_blocks_computed_by_verify_steps(tiny_checkpoint):
    """Wave 2 prompts are wave 1's prompts plus their outputs: their prefix hits take blocks whose tokens were
    computed in verify steps (with rejected drafts written into some of their slots before); the outputs still
    equal the non-speculative run's, so only accepted tokens' K/V was cached."""
    path = tiny_checkpoint("mixtral")
    first = reqs(prompt_list((9, 13, 6), seed=5), (24, 20, 22), "a")
    ref = make_engine(path)
    want1 = outputs(drive(ref, first))
    second = reqs([p + want1[rid] for rid, p, _, _ in first], (10, 12, 9), "b")
    want2 = outputs(drive(ref, second))
    engine = make_engine(path, replay_spec(k=4, rate=0.5))
    record(engine, first, want1)
    record(engine, second, want2)
    got1 = outputs(drive(engine, first))
    hits0 = engine.kv_cache.prefix_cache_hits
    finals2 = drive(engine, second)
    assert got1 == want1 and outputs(finals2) == want2
    for rid, prompt, _, _ in second:  # most of each prompt came from the cache, blocks written by verify steps
        assert finals2[rid].num_cached_tokens >= len(prompt) - 8, (rid, finals2[rid].num_cached_tokens, len(prompt))
    assert engine.kv_cache.prefix_cache_hits > hits0
    stats = engine.spec.snapshot()
    assert 0 < stats["accepted"] < stats["proposed"]
    assert_all_free(engine)


def test_chunked_prefill_shares_the_budget(tiny_checkpoint):
    """A 7-token budget: long prompts are chunked over several steps while others verify; drafts are cut to what
    the budget leaves (a decode never waits for its drafts)."""
    path = tiny_checkpoint("gpt_oss")
    requests = reqs(prompt_list((23, 5, 17, 6, 30), seed=6), (14, 18, 10, 16, 12))
    limits = dict(max_num_batched_tokens=7, max_num_seqs=5)
    ref = make_engine(path, **limits)
    want = outputs(drive(ref, requests, arrivals={0: [0, 1], 3: [2, 3], 6: [4]}))
    engine = make_engine(path, replay_spec(k=4, rate=0.8), **limits)
    record(engine, requests, want)
    mixed, cut = [], []
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        verify = [s for s in out.scheduled if s.draft_token_ids]
        if verify and any(s.is_prefill_chunk for s in out.scheduled):
            mixed.append(len(out.scheduled))
        cut.append(sum(len(s.draft_token_ids) for s in verify))
        assert out.num_batched_tokens <= 7
        return out

    engine.scheduler.schedule = watched
    got = outputs(drive(engine, requests, arrivals={0: [0, 1], 3: [2, 3], 6: [4]}))
    assert got == want
    stats = engine.spec.snapshot()
    assert mixed, "no step mixed a prefill chunk with a verify"
    assert stats["proposed"] == sum(cut) < engine.spec.proposer.num_proposed  # the budget cut some drafts
    assert_all_free(engine)


class _Aborting(ReplayProposer):
    """Replay proposer that aborts a request while proposing (between proposing and scheduling)."""

    engine = None
    victim: str | None = None

    def propose(self, batch):
        out = super().propose(batch)
        if self.victim is not None and any(s.request_id == self.victim for s in batch):
            self.engine.abort(self.victim)
            self.victim = None
        return out


def test_aborts_mid_verify(tiny_checkpoint, perturbed_checkpoint):
    """One request aborted from the logits hook, i.e. after the verify forward and before acceptance; another while
    the proposer drafts for it. The rest finish with the reference tokens; no block leaks (target or draft)."""
    path = tiny_checkpoint("llama")
    requests = reqs(prompt_list((8, 11, 6, 9), seed=7), (20, 20, 20, 20))
    want = outputs(drive(make_engine(path), requests))
    for proposer in ("replay", "draft"):
        if proposer == "replay":
            engine = make_engine(path, replay_spec(k=3, rate=0.7))
            aborting = _Aborting(3, 0.7, vocab_size=engine.model_config.vocab_size, forced=False)
            aborting.engine, aborting.victim = engine, "r2"
            engine.spec.proposer = aborting
            record(engine, requests, want)
        else:
            engine = make_engine(path, dict(method="draft", num_speculative_tokens=3,
                                            draft_model=perturbed_checkpoint(path, 0.1)))
        state = {"n": 0}

        def hook(seqs, logits, engine=engine, state=state):
            state["n"] += 1
            if state["n"] == 4 and len(seqs) > len({s.seq_id for s in seqs}):  # a verify step: rows repeat
                engine.abort("r1")

        engine.runner.logits_hook = hook
        finals = drive(engine, requests)
        assert "r1" not in finals and (proposer != "replay" or "r2" not in finals)
        for rid, toks in outputs(finals).items():
            assert toks == want[rid], (proposer, rid)
        assert_all_free(engine)


def test_tenant_charges_count_each_accepted_token_once(tiny_checkpoint):
    """Under the tenant-fair policy a verify step charges its tenant for the tokens it appended, once each: charged
    output tokens equal the tokens returned, prompt tokens the prompts (stop strings cut inside a verified run of
    tokens are taken back)."""
    path = tiny_checkpoint("llama")
    prompts = prompt_list((7, 9, 8, 6), seed=8)
    ref = make_engine(path)
    probe = drive(ref, [("p", prompts[2], SamplingParams(max_tokens=16, **GREEDY), None)])["p"]
    stop = probe.text[5:7]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (15, 11, 16, 13)]
    params[2] = SamplingParams(max_tokens=16, stop=[stop], **GREEDY)
    requests = [(f"r{i}", p, sp, None) for i, (p, sp) in enumerate(zip(prompts, params))]
    tenants = ["t1", "t2", "t1", "t2"]
    want = outputs(drive(ref, requests))
    engine = make_engine(path, replay_spec(k=4, rate=0.9))
    record(engine, requests, {**want, "r2": probe.output_token_ids})
    finals = {}
    for rid, prompt, sp, _ in requests:
        engine.add_request(rid, prompt, sp, tenant=tenants[int(rid[1:])])
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
        engine.kv_cache.check_invariants()
    assert outputs(finals) == want
    assert finals["r2"].outputs[0].stop_reason == stop
    charged = {r["tenant"]: r for r in engine.scheduler.counters.snapshot()}
    for t in ("t1", "t2"):
        mine = [rid for rid in finals if tenants[int(rid[1:])] == t]
        assert charged[t]["output_tokens"] == sum(len(finals[r].output_token_ids) for r in mine)
        assert charged[t]["input_tokens"] == sum(len(prompts[int(r[1:])]) for r in mine)
    assert_all_free(engine)
