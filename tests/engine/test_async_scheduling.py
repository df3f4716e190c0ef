"""Overlapped ("async") scheduling (engine/step_pipeline.py) on CPU, through the eager padded decode path that CUDA
graphs replay on a GPU: step n+1 is launched before step n's tokens are read.

Against the same engine run synchronously (the same padded decode path): identical tokens, texts, finish reasons
and logprobs for greedy and seeded requests, base and two PEFT adapters mixed, a dense and an MoE family, with
requests arriving mid-run, finishing at different steps by length, stop token and stop string; greedy tokens also
match transformers / PEFT. Under a small KV pool (recompute and swap preemption) and with a request aborted while
its step is in flight: identical outputs for the others, one final output per request and none after it, every
block free at the end. The order of calls proves that steps really overlap.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict

import pytest
import torch

from loraplex.engine import AsyncEngine, LLMEngine, SamplingParams
from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.sequence import SequenceGroup, SequenceStatus
from loraplex.engine.step_pipeline import PendingTokens
from tests.utils.adapters import peft_adapter_of

BASE = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=32, progress=False)


# ---- fixtures and drivers -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def peft_folders(tmp_path_factory):
    """``peft_folders(base_path) -> {"a": folder (rank 4), "b": folder (rank 8)}``: PEFT adapters with random
    non-zero weights on attention and the MLP (the fused experts on MoE families)."""
    cache: dict = {}

    def make(base: str) -> dict[str, str]:
        if base not in cache:
            cache[base] = {name: peft_adapter_of(base, str(tmp_path_factory.mktemp(f"lora-{name}")), r=r, seed=seed)
                           for name, r, seed in (("a", 4, 1), ("b", 8, 2))}
        return cache[base]

    return make


def make_engine(path: str, overlap: bool, **kw) -> LLMEngine:
    """``async_scheduling=overlap``; the synchronous engine is given the same padded decode path."""
    engine = LLMEngine.from_pretrained(path, async_scheduling=overlap, **{**BASE, **kw})
    if not overlap:
        engine.runner.init_decode_graphs(capture=False)
    assert engine.async_scheduling is overlap and engine.runner.decode_graphs is not None
    return engine


def drive(engine: LLMEngine, arrivals: dict[int, list[tuple]], before_step=None) -> dict:
    """Step until every request is done; ``arrivals[k]``: (request id, prompt, params, adapter) added before step k;
    ``before_step(k, engine)`` runs before step k. Checks the stream: outputs extend each other, no pending token
    leaks out, at most one final output per request and nothing after it. Returns {request id: final output}."""
    finals, tokens = {}, defaultdict(list)
    k = 0
    while k <= max(arrivals) or engine.has_unfinished_requests():
        for request in arrivals.get(k, []):
            engine.add_request(*request)
        if before_step is not None:
            before_step(k, engine)
        for o in engine.step():
            assert o.request_id not in finals, f"{o.request_id}: output after its final output"
            assert o.output_token_ids == tokens[o.request_id] + o.new_token_ids
            assert all(t >= 0 for t in o.output_token_ids), "a pending token reached an output"
            tokens[o.request_id] = list(o.output_token_ids)
            if o.finished:
                finals[o.request_id] = o
        k += 1
        assert k < 1000, "requests did not finish"
    return finals


def summary(o) -> tuple:
    """What must be identical between two runs: tokens, text, finish and stop reasons, and per logprob entry its
    token, rank and top-k tokens (the logprob values: ``logprob_values``, compared within float32 noise)."""
    c = o.outputs[0]
    lp = [(e.token_id, e.rank, [t for t, _ in e.top]) for e in c.logprobs] if c.logprobs is not None else None
    return o.output_token_ids, o.text, o.finish_reason, c.stop_reason, lp


def logprob_values(o) -> list[float]:
    c = o.outputs[0]
    return [v for e in (c.logprobs or []) for v in [e.logprob] + [lv for _, lv in e.top]]


def assert_same_output(got, want, rid: str) -> None:
    """``summary`` identical; logprob values within 1e-4 (a step batched differently sums in another order, so the
    float32 values may differ in their last digits)."""
    assert summary(got) == summary(want), rid
    assert logprob_values(got) == pytest.approx(logprob_values(want), abs=1e-4), rid


def assert_all_free(engine: LLMEngine) -> None:
    kv = engine.kv_cache
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.swap_space.num_free_blocks == (kv.swap_space.num_blocks if kv.swap_space.pool is not None else 0)
    assert not engine.scheduler.has_unfinished() and engine._inflight is None


def prompt_list(vocab: int, lens, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


# ---- async on vs off ------------------------------------------------------------------------------------------
def mixed_workload(prompts, refs, stop_token: int | None, stop_str: str | None) -> dict[int, list[tuple]]:
    """Ten requests over steps 0, 3, 6, 9: base and adapters, greedy and seeded, lengths 1..20, a stop token, a
    stop string, one asking for logprobs (its steps run synchronously)."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    sp = SamplingParams
    reqs = [
        ("r0", None, sp(max_tokens=16, **greedy)),
        ("r1", "a", sp(max_tokens=12, **greedy)),
        ("r2", "b", sp(max_tokens=14, temperature=0.9, top_p=0.9, top_k=30, seed=11, ignore_eos=True)),
        ("r3", None, sp(max_tokens=10, temperature=1.0, min_p=0.05, seed=5, ignore_eos=True)),
        ("r4", "a", sp(max_tokens=18, stop_token_ids=[stop_token] if stop_token is not None else [], **greedy)),
        ("r5", None, sp(max_tokens=18, stop=[stop_str] if stop_str else [], **greedy)),
        ("r6", "b", sp(max_tokens=8, logprobs=3, **greedy)),
        ("r7", None, sp(max_tokens=1, **greedy)),
        ("r8", "a", sp(max_tokens=9, temperature=0.8, seed=3, ignore_eos=True)),
        ("r9", None, sp(max_tokens=20, **greedy)),
    ]
    at = {0: [0, 1, 2, 3, 4, 5], 3: [7, 9], 6: [6], 9: [8]}
    return {k: [(reqs[i][0], prompts[i], reqs[i][2], refs[reqs[i][1]] if reqs[i][1] else None) for i in idx]
            for k, idx in at.items()}


def pick_stop_string(text: str) -> str:
    """Two printable characters of ``text`` (past its start) that do not occur earlier in it."""
    for k in range(3, len(text) - 1):
        s = text[k:k + 2]
        if s.isascii() and s.isprintable() and not s.isspace() and s not in text[:k + 1]:
            return s
    raise AssertionError(f"no stop string in {text!r}")


def peft_argmax(base: str, folder: str | None, prompt: list[int], output: list[int]) -> list[int]:
    """transformers (+ PEFT with ``folder``) greedy tokens at the output positions, one teacher-forced forward."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model = (PeftModel.from_pretrained(model, folder) if folder else model).eval()
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1:].argmax(-1).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_async_matches_sync_with_adapters_arrivals_and_stops(family, tiny_checkpoint, peft_folders, tmp_path):
    path = tiny_checkpoint(family)
    folders = peft_folders(path)
    refs = {name: AdapterRef(f"t/{name}/1", f"file://{folder}") for name, folder in folders.items()}
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    engines = {}

    def run(overlap: bool, stop_token=None, stop_str=None, tag=""):
        engine = make_engine(path, overlap, adapter_cache_dir=str(tmp_path / f"cache{tag}{int(overlap)}"), **lora)
        for ref in refs.values():
            assert engine.load_adapter(ref, wait=True) == "ready"
        prompts = prompt_list(engine.model_config.vocab_size, (5, 9, 3, 12, 7, 6, 10, 4, 8, 11), seed=3)
        finals = drive(engine, mixed_workload(prompts, refs, stop_token, stop_str))
        assert_all_free(engine)
        engines[(overlap, tag)] = engine
        return prompts, finals

    _, probe = run(False, tag="probe")  # free runs of r4 and r5 give a stop token and a stop string that occur
    stop_token = probe["r4"].output_token_ids[6]
    stop_str = pick_stop_string(probe["r5"].text)
    prompts, want = run(False, stop_token, stop_str)
    _, got = run(True, stop_token, stop_str)
    assert sorted(got) == sorted(want) == [f"r{i}" for i in range(10)]
    for rid in want:
        assert_same_output(got[rid], want[rid], rid)
    # the workload covers what it claims
    assert want["r4"].finish_reason == "stop" and len(want["r4"].output_token_ids) <= 7
    assert want["r5"].outputs[0].stop_reason == stop_str and stop_str not in want["r5"].text
    assert want["r0"].finish_reason == want["r7"].finish_reason == "length"
    assert len(want["r6"].outputs[0].logprobs) == 8
    overlapped = engines[(True, "")].num_overlapped_steps
    assert overlapped >= 10 and engines[(False, "")].num_overlapped_steps == 0
    if family == "llama":  # greedy tokens against transformers / PEFT
        for rid, name in (("r0", None), ("r1", "a"), ("r9", None)):
            i = int(rid[1:])
            assert peft_argmax(path, folders[name] if name else None, prompts[i],
                               got[rid].output_token_ids) == got[rid].output_token_ids, rid


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_abort_in_flight(mode, tiny_checkpoint):
    """A 20-block pool for six requests of up to 8 blocks each: sequences are preempted (some while their token is
    pending); r2 is aborted while a step holding it is in flight."""
    path = tiny_checkpoint("llama")
    kw = dict(num_kv_blocks=20, preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0)
    sp = SamplingParams
    results, aborted_in_flight = {}, []

    def abort_r2(k, engine):
        if k == 8:
            inflight = engine._inflight
            if inflight is not None:
                aborted_in_flight.append(any(s.seq.request_id == "r2" for s in inflight.out.scheduled))
            assert engine.abort("r2")

    for overlap in (False, True):
        engine = make_engine(path, overlap, **kw)
        prompts = prompt_list(engine.model_config.vocab_size, (6, 12, 9, 10, 7, 11), seed=8)
        params = [sp(max_tokens=18, temperature=0.0, ignore_eos=True) if i % 2 else
                  sp(max_tokens=16 + i, temperature=0.9, seed=20 + i, ignore_eos=True) for i in range(6)]
        arrivals = {0: [(f"r{i}", prompts[i], params[i], None) for i in range(4)],
                    2: [(f"r{i}", prompts[i], params[i], None) for i in range(4, 6)]}
        finals = drive(engine, arrivals, before_step=abort_r2)
        assert "r2" not in finals and sorted(finals) == ["r0", "r1", "r3", "r4", "r5"]
        assert engine.scheduler.num_preemptions > 0
        if mode == "swap":
            assert engine.scheduler.num_swap_outs > 0
        assert_all_free(engine)
        results[overlap] = (finals, engine.num_overlapped_steps)
    assert sorted(results[True][0]) == sorted(results[False][0])
    for rid, o in results[False][0].items():
        assert_same_output(results[True][0][rid], o, rid)
    assert results[True][1] > 0 and aborted_in_flight == [True]


def test_step_n_plus_1_is_launched_before_step_n_tokens_are_read(tiny_checkpoint, monkeypatch):
    engine = make_engine(tiny_checkpoint("qwen3_moe"), True)
    events = []
    launch = engine.runner.launch_decode

    def spy_launch(*args, **kw):
        tokens = launch(*args, **kw)
        events.append(("launch", tokens))
        return tokens

    wait = PendingTokens.wait
    monkeypatch.setattr(engine.runner, "launch_decode", spy_launch)
    monkeypatch.setattr(PendingTokens, "wait", lambda self: (events.append(("wait", self)), wait(self))[1])
    prompts = prompt_list(engine.model_config.vocab_size, (4, 7, 5), seed=1)
    outs = engine.generate(prompts, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [9, 9, 9]
    launched = [t for e, t in events if e == "launch"]
    assert len(launched) == 8 == engine.num_overlapped_steps  # the first token comes from the prefill step
    for k in range(len(launched) - 1):  # step k's tokens are read only after step k+1 is on its way
        assert events.index(("launch", launched[k + 1])) < events.index(("wait", launched[k]))
    assert events[-1] == ("wait", launched[-1])


def test_async_engine_streams_overlapped_steps(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    sync = make_engine(path, False)
    prompts = prompt_list(sync.model_config.vocab_size, (5, 13, 8), seed=5)
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=2, ignore_eos=True)
    expected = [o.output_token_ids for o in sync.generate(prompts, params)]
    llm = make_engine(path, True)
    engine = AsyncEngine(llm)

    async def consume(rid, prompt, stop_after=None):
        tokens = []
        async for out in engine.generate(rid, prompt, params):
            assert out.output_token_ids == tokens + out.new_token_ids
            tokens = list(out.output_token_ids)
            if stop_after is not None and len(tokens) >= stop_after:
                break  # the consumer leaves: its request is aborted
        return tokens

    async def main():
        return await asyncio.gather(*(consume(f"r{i}", p) for i, p in enumerate(prompts)),
                                    consume("leaver", prompts[0], stop_after=3))

    try:
        *results, left = asyncio.run(main())
        for _ in range(250):  # the leaver's abort reaches the engine thread
            if not llm.has_unfinished_requests():
                break
            time.sleep(0.02)
    finally:
        engine.shutdown()
    assert results == expected and left == expected[0][:len(left)] and len(left) >= 3
    assert llm.num_overlapped_steps > 0
    assert_all_free(llm)


# ---- scheduler: pending tokens ----------------------------------------------------------------------------------
def two_decoding(mode: str, stop_token: int):
    """A 4-block pool, two requests of 7-token prompts decoding (2 blocks each, full after one more token); "b"
    (the later arrival, the preemption victim) stops at ``stop_token``."""
    kv = KVCacheManager(4, 4, num_cpu_blocks=8 if mode == "swap" else 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                      preemption_mode=mode), kv)
    a = SequenceGroup.from_prompt("a", list(range(10, 17)), SamplingParams(max_tokens=5), arrival_time=1.0)
    b = SequenceGroup.from_prompt("b", list(range(20, 27)), SamplingParams(max_tokens=5, stop_token_ids=[stop_token]),
                                  arrival_time=2.0)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), {a.seq.seq_id: 5, b.seq.seq_id: 6})
    return sched, kv, a.seq, b.seq


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_pending_token_preempted_then_resolved_finishes_where_it_is(mode):
    sched, kv, a, b = two_decoding(mode, stop_token=99)
    step1 = sched.schedule()
    sched.update_launched(step1)
    assert a.num_pending_tokens == b.num_pending_tokens == 1 and a.num_computed_tokens == 8
    step2 = sched.schedule()  # a needs a third block: b (pending token still on the device) is preempted
    assert step2.preempted == ["b"] and [s.seq for s in step2.scheduled] == [a]
    assert b.status is (SequenceStatus.SWAPPED if mode == "swap" else SequenceStatus.WAITING)
    accepted, finished = sched.update_resolved(step1, {a.seq_id: 7, b.seq_id: 99})
    assert accepted == [a, b] and [g.request_id for g in finished] == ["b"]
    assert b.status is SequenceStatus.FINISHED_STOPPED and b.output_token_ids == [6, 99]
    assert not sched.waiting and not sched.swapped and sched.get_group("b") is None
    assert a.output_token_ids == [5, 7] and a.status is SequenceStatus.RUNNING
    sched.update_launched(step2)
    sched.update_resolved(step2, {a.seq_id: 8})
    assert a.output_token_ids == [5, 7, 8] and not a.num_pending_tokens
    sched.abort("a")
    kv.check_invariants()
    assert kv.num_free_blocks == 4 and kv.swap_space.num_free_blocks == (8 if mode == "swap" else 0)


def test_a_pending_last_token_is_not_scheduled_again_and_hashes_skip_it():
    kv = KVCacheManager(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    g = SequenceGroup.from_prompt("a", list(range(10, 17)), SamplingParams(max_tokens=2))
    sched.add(g)
    sched.update(sched.schedule(), {g.seq.seq_id: 5})  # 8 tokens: two full blocks once the 8th is computed
    step = sched.schedule()
    sched.update_launched(step)
    assert g.seq.num_computed_tokens == 8 and g.seq.num_tokens == 9
    assert len(kv._block_hashes[g.seq.seq_id]) == 2  # both full blocks hold real tokens only
    assert sched.schedule().is_empty  # its pending token is its 2nd and last: nothing to run
    _, finished = sched.update_resolved(step, {g.seq.seq_id: 42})
    assert finished == [g] and g.seq.finish_reason == "length" and g.seq.output_token_ids == [5, 42]
    assert kv.num_free_blocks == 8


# ---- configuration ----------------------------------------------------------------------------------------------
def test_config_and_flags(tiny_checkpoint, monkeypatch):
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(model="/m", async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling must be"):
        EngineConfig(model="/m", async_scheduling="yes")
    auto = LLMEngine.from_pretrained(tiny_checkpoint("llama"), **BASE)  # auto: no CUDA graphs on CPU -> off
    assert auto.async_scheduling is False and auto.runner.decode_graphs is None

    import loraplex.engine.server.serve as serve_mod
    from loraplex.cli import main

    seen = []
    monkeypatch.setattr(serve_mod, "real_service", lambda model, **kw: seen.append(kw["async_scheduling"]))
    monkeypatch.setattr(serve_mod, "serve", lambda make, **kw: make())
    for flags in ([], ["--async-scheduling"], ["--no-async-scheduling"]):  # a real folder: settings are checked
        main(["engine", "serve", "--model", tiny_checkpoint("llama"), *flags])
    assert seen == [None, True, False]
    from loraplex.commands.bench import config_from_args, register  # the bench's flag too

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    for flags, want in (([], None), (["--no-async-scheduling"], False)):
        args = parser.parse_args(["bench", "serve", "--scale", "tiny", *flags])
        cfg = config_from_args(args)
        assert cfg.async_scheduling is want
        assert ("--no-async-scheduling" in cfg.command) is (want is False)
