"""Beam search through LLMEngine (fork / append / free on paged blocks) against transformers' beam search:
same hypotheses, same scores, on tiny checkpoints of two families, float32 on CPU."""
from __future__ import annotations

import math

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams

WIDTH, MAX_NEW = 4, 7


@pytest.mark.parametrize("family, length_penalty, early_stopping", [
    ("llama", 1.0, False), ("qwen3_moe", 0.7, True),
])
def test_beam_search_matches_transformers(tiny_checkpoint, family, length_penalty, early_stopping):
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = tiny_checkpoint(family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompt = torch.randint(3, 320, (11,), generator=torch.Generator().manual_seed(17)).tolist()
    with torch.no_grad():
        stop = model(torch.tensor([prompt])).logits[0, -1].argmax().item()
    # the stop id = the model's favourite first token: some hypotheses end on it, others run to the length limit
    gc = GenerationConfig(num_beams=WIDTH, num_return_sequences=WIDTH, max_new_tokens=MAX_NEW, do_sample=False,
                          eos_token_id=stop, pad_token_id=0, length_penalty=length_penalty,
                          early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=gc)

    def trimmed(ids):  # transformers pads finished hypotheses after the stop id
        return ids[:ids.index(stop) + 1] if stop in ids else ids
    expected = [(trimmed(ref.sequences[i, len(prompt):].tolist()), ref.sequences_scores[i].item())
                for i in range(WIDTH)]

    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                                       max_num_batched_tokens=32, progress=False)
    params = SamplingParams(n=WIDTH, use_beam_search=True, beam_width=WIDTH, max_tokens=MAX_NEW, ignore_eos=True,
                            stop_token_ids=[stop], length_penalty=length_penalty, early_stopping=early_stopping)
    engine.add_request("beam", prompt, params)
    copies, widths = 0, []
    final = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        copies += engine.kv_cache.num_cow_copies - copies
        group = engine.scheduler.get_group("beam")
        if group is not None:
            widths.append(len(group.unfinished_seqs()))
        engine.kv_cache.check_invariants()
        final = next((o for o in outs if o.finished), final)
    got = [(c.output_token_ids, c.beam_score) for c in final.outputs]
    assert got[0][0] == expected[0][0], f"{family}: best beam differs"
    assert math.isclose(got[0][1], expected[0][1], rel_tol=1e-5, abs_tol=1e-6)
    assert [g[0] for g in got] == [e[0] for e in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
    assert final.output_token_ids == got[0][0] and final.finish_reason in ("stop", "length")
    assert any(stop in g[0] for g in got)  # the case exercises hypotheses ended by the stop id
    assert max(widths) == WIDTH and copies > 0  # beams ran side by side, sharing blocks copied on write
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beams_preempted_in_a_tight_pool_give_the_same_hypotheses(tiny_checkpoint, mode):
    path = tiny_checkpoint("llama")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (13, 9, 17)]
    beam = SamplingParams(n=2, use_beam_search=True, beam_width=3, max_tokens=10, ignore_eos=True)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    params = [greedy, beam, beam]

    def run(**kw):
        engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, progress=False,
                                           max_num_batched_tokens=12, **kw)  # small budget: prompts chunk
        outs = engine.generate(prompts, params)
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
        return engine, [[(c.output_token_ids, c.beam_score) for c in o.outputs] for o in outs]

    _, expected = run(num_kv_blocks=128)
    engine, got = run(num_kv_blocks=21, num_cpu_blocks=64, preemption_mode=mode)
    assert engine.scheduler.num_preemptions > 0, "the pool was not small enough to preempt"
    assert (engine.scheduler.num_swap_outs > 0) == (mode == "swap")
    # same hypotheses; scores to float32 rounding (a recomputed prefill batches its K/V differently)
    assert [[c[0] for c in o] for o in got] == [[c[0] for c in o] for o in expected]
    for o_got, o_exp in zip(got, expected):
        for (_, a), (_, b) in zip(o_got, o_exp):
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-5)
    assert engine.kv_cache.num_free_cpu_blocks == 64
