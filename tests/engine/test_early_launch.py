"""An eager step (a prefill chunk beside decodes: an arrival) scheduled while an overlapped decode step is in flight
is enqueued before that step is read back (``ModelRunner.launch_eager``; engine/step_pipeline.py): its decode rows
take their pending input tokens from the step in flight on the device, and rows of sequences that finish when that
step is read (stop token, stop string) are dropped before sampling.

Against the same engine run synchronously: identical tokens, texts and finish reasons for greedy and seeded
requests, base and two PEFT adapters mixed, arrivals at many steps, stops that land on an arrival's step; every
block free at the end; the early launches and the dropped rows really happen."""
from __future__ import annotations

import pytest

from loraplex.engine import SamplingParams
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from tests.engine.test_async_scheduling import assert_all_free, assert_same_output, drive, make_engine, prompt_list
from tests.utils.adapters import peft_adapter_of


def arrivals(prompts, refs, stops: dict[str, int]) -> dict[int, list[tuple]]:
    """Twelve requests: three at step 0, then one every third step (between arrivals the batch decodes, so each
    arrival's step finds a decode step in flight), each decoding while later ones arrive; the greedy ones stop at
    a token their free run produced a few tokens in (``stops``)."""
    sp = SamplingParams
    out: dict[int, list[tuple]] = {}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        adapter = (None, "a", "b")[i % 3]
        if i % 4 == 2:
            params = sp(max_tokens=10 + i, temperature=0.9, top_k=20, seed=100 + i, ignore_eos=True)
        else:
            params = sp(max_tokens=10 + i, temperature=0.0, ignore_eos=True,
                        stop_token_ids=[stops[rid]] if rid in stops else [])
        out.setdefault(3 * max(0, i - 2), []).append((rid, prompt, params, refs[adapter] if adapter else None))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_arrivals_launched_before_the_step_in_flight_match_the_synchronous_engine(family, tiny_checkpoint,
                                                                                  tmp_path):
    path = tiny_checkpoint(family)
    refs = {name: AdapterRef(f"t/{name}/1", "file://" + peft_adapter_of(path, str(tmp_path / name), r=r, seed=s))
            for name, r, s in (("a", 4, 1), ("b", 8, 2))}
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8)

    def run(overlap: bool, stops: dict[str, int], tag: str):
        engine = make_engine(path, overlap, adapter_cache_dir=str(tmp_path / f"cache-{tag}"), **lora)
        for ref in refs.values():
            assert engine.load_adapter(ref, wait=True) == "ready"
        early = []  # per early-launched step: (rows sampled at launch, rows sampled after the read-back)
        execute = engine.runner.execute

        def spy(out, sampling, *a, launched=None, **kw):
            if launched is not None:
                early.append((len(launched.sample_seqs), sum(s.sample for s in out.scheduled)))
            return execute(out, sampling, *a, launched=launched, **kw)

        engine.runner.execute = spy
        prompts = prompt_list(engine.model_config.vocab_size, [5 + (3 * i) % 11 for i in range(12)], seed=7)
        finals = drive(engine, arrivals(prompts, refs, stops))
        assert_all_free(engine)
        return engine, finals, early

    _, free, _ = run(False, {}, "probe")
    greedy = [i for i in range(12) if i % 4 != 2]
    stops = {f"r{i}": free[f"r{i}"].output_token_ids[3 + i % 5] for i in greedy}
    sync, want, _ = run(False, stops, "sync")
    engine, got, early = run(True, stops, "async")
    assert sorted(got) == sorted(want) == sorted(f"r{i}" for i in range(12))
    for rid in want:
        assert_same_output(got[rid], want[rid], rid)
    assert all(want[rid].finish_reason == "stop" for rid in stops)
    assert sync.num_early_launched_steps == 0 and engine.num_early_launched_steps == len(early) >= 8
    # some stop was read back while an arrival's step was already enqueued: its row computed and dropped
    assert any(after < launched for launched, after in early)


def test_a_pending_input_needs_the_step_that_samples_it(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("llama"), True)
    engine.add_request("r", [5, 6], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill: its first token read back at once
    engine.step()  # an overlapped decode: its token pending
    seq = engine._inflight.out.scheduled[0].seq
    assert seq.num_pending_tokens == 1 and seq.num_tokens == 4  # its pending input at position 3: block 0
    out = SchedulerOutput([ScheduledSequence(seq, 1, list(seq.block_ids), True)], 1)
    with pytest.raises(RuntimeError, match="pending and no step in flight holds it"):
        engine.runner.prepare(out)
    inputs = engine.runner.prepare(out, engine._inflight.tokens)  # gathered from the tokens in flight
    assert inputs.input_ids.tolist() == [engine._inflight.tokens.wait()[seq.seq_id]]
