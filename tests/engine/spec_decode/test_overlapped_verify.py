"""Overlapped verify steps (async scheduling with speculation): step n+1 is proposed, scheduled and launched after
step n's tokens are read back and before step n's outputs (detokenizer, stop strings) are built.

Against plain greedy decoding (no speculation, synchronous): identical tokens, texts and finish reasons with the
replay and draft-model proposers, under a small KV pool (preemption), with stop strings that end a sequence
while the next verify step holding it is in flight and a request aborted while a verify step holding it is in
flight; every target and draft KV block free at the end and no proposer state left. The order of calls and the
engine's counter prove that verify steps overlap. The n-gram proposer seldom drafts on the tiny random model's
outputs, so its runs check tokens, the counter and the blocks only.
"""
from __future__ import annotations

import pytest

from loraplex.engine import SamplingParams
from tests.engine.spec_decode.conftest import assert_all_free, drive, make_engine, prompt_list
from tests.engine.test_async_scheduling import pick_stop_string

GREEDY = dict(temperature=0.0, ignore_eos=True)
KV = dict(num_kv_blocks=16)  # 4-token blocks for six requests of up to 11 blocks each: preemption


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def summary(finals) -> dict:
    return {rid: (o.output_token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for rid, o in finals.items()}


def workload(stops: dict[str, str] | None = None) -> list[tuple]:
    prompts = [p[:3] * 5 for p in prompt_list((6, 8, 7, 9, 5, 10), seed=21)]  # repeats: the n-gram proposer drafts
    lengths = (24, 20, 17, 26, 22, 12)
    stops = stops or {}
    return [(f"r{i}", p, SamplingParams(max_tokens=n, stop=[stops[f"r{i}"]] if f"r{i}" in stops else [], **GREEDY),
             None) for i, (p, n) in enumerate(zip(prompts, lengths))]


def spec_config(method: str, llama: str, perturbed_checkpoint) -> dict:
    if method == "draft":
        return dict(method="draft", num_speculative_tokens=3, draft_model=perturbed_checkpoint(llama, 0.1))
    if method == "replay":
        return dict(method="replay", num_speculative_tokens=3, replay_acceptance_rate=0.6, replay_forced=False)
    return dict(method="ngram", num_speculative_tokens=3)


@pytest.mark.parametrize("method", ["replay", "draft"])
def test_overlapped_verify_matches_plain_greedy(method, llama, perturbed_checkpoint):
    free = drive(make_engine(llama, **KV), workload())
    stops = {rid: pick_stop_string(free[rid].text) for rid in ("r0", "r1", "r2", "r4")}
    requests = workload(stops)
    want = summary(drive(make_engine(llama, **KV), requests))
    assert all(want[rid][3] == stop for rid, stop in stops.items())

    engine = make_engine(llama, spec_config(method, llama, perturbed_checkpoint), async_scheduling=True, **KV)
    if method == "replay":
        for rid, prompt, _, _ in requests:
            engine.spec.proposer.record(prompt, free[rid].output_token_ids)
    events, late_stops, aborted = [], [], []
    spec, finish_seq, step_outputs = engine.spec, engine.scheduler.finish_seq, engine._step_outputs

    def in_flight(seq) -> bool:
        inflight = engine._inflight
        return inflight is not None and inflight.verify and any(s.seq is seq for s in inflight.out.scheduled)

    def spy_finish_seq(seq, status):
        if in_flight(seq):
            late_stops.append(seq.request_id)
        return finish_seq(seq, status)

    def spy(name, fn):
        def call(*a, **kw):
            events.append(name)
            return fn(*a, **kw)
        return call

    engine.scheduler.finish_seq = spy_finish_seq
    spec.launch, spec.finish = spy("launch", spec.launch), spy("finish", spec.finish)
    engine._step_outputs = spy("outputs", step_outputs)

    def abort_r3(k, engine):
        inflight = engine._inflight
        if not aborted and k >= 6 and inflight is not None and inflight.verify and any(
                s.seq.request_id == "r3" for s in inflight.out.scheduled):
            aborted.append(k)
            assert engine.abort("r3")

    got = summary(drive(engine, requests, before_step=abort_r3))
    assert aborted and "r3" not in got
    assert got == {rid: v for rid, v in want.items() if rid != "r3"}
    assert late_stops, "no stop string ended a sequence of a verify step in flight"
    assert engine.scheduler.num_preemptions > 0
    assert engine.spec.snapshot()["verified"] > 0 and engine.num_overlapped_verify_steps > 0
    # a verify step launched between the read-back of the one before and that one's outputs
    trace = "".join({"launch": "L", "finish": "F", "outputs": "O"}[e] for e in events)
    assert "FLO" in trace
    assert_all_free(engine)
    assert engine._inflight is None


def test_ngram_overlapped_and_not(llama):
    """Prompt lookup with async scheduling on (verify steps overlap) and off (none does): plain greedy tokens."""
    requests = workload()
    want = summary(drive(make_engine(llama), requests))
    for overlap in (True, False):
        engine = make_engine(llama, spec_config("ngram", llama, None), async_scheduling=overlap)
        assert summary(drive(engine, requests)) == want
        assert engine.spec.snapshot()["verified"] > 0
        assert (engine.num_overlapped_verify_steps > 0) is overlap
        assert_all_free(engine)
