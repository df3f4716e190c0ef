"""Beam search bookkeeping: fork / append / free keep the KV invariants, and the result equals transformers'."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from loraplex.engine.beam_search import BeamSearchState
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import SequenceGroup, SequenceStatus

BS = 4


def start(prompt, width, kv, **kw) -> BeamSearchState:
    g = SequenceGroup.from_prompt(f"beam{next(_n)}", prompt, SamplingParams(max_tokens=kw.get("max_new_tokens", 8),
                                                                             use_beam_search=True, beam_width=width))
    assert kv.allocate_slots(g.seq, len(prompt))
    g.seq.num_computed_tokens = len(prompt)
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("stop_token_ids", [])
    return BeamSearchState(g, width, **kw)


_n = itertools.count()


def run(state: BeamSearchState, kv: KVCacheManager, next_logprobs, pruned=None) -> list[list[tuple[int, int]]]:
    """Drive the search like the engine: score, step, then give each running beam a slot for its new token.
    Returns each step's copy-on-write copies; pruned beams are appended to ``pruned``."""
    copies = []
    while not state.done:
        result = state.step(next_logprobs(state.running), kv)
        assert set(result.running) == set(state.running) and all(s in state.group.seqs for s in result.forked)
        assert all(not s.block_ids and s.status.is_finished for s in result.freed)
        if not result.done:  # pruned beams leave the group; the last running ones stay, finished
            assert all(s not in state.group.seqs for s in result.freed)
            if pruned is not None:
                pruned.extend(result.freed)
        for s in state.running:
            assert kv.allocate_slots(s, 1)
        copies.append(kv.take_blocks_to_copy())
        for s in state.running:
            s.num_computed_tokens += 1
            kv.cache_full_blocks(s)
        kv.check_invariants()
    return copies


def table_logprobs(seed: int, vocab: int):
    """A fixed fake model: next-token log-probs depend on the last two tokens only."""
    def f(beams):
        rows = []
        for s in beams:
            g = torch.Generator().manual_seed(seed * 100003 + s.all_token_ids[-1] * 1009 + s.all_token_ids[-2])
            rows.append(torch.log_softmax(torch.randn(vocab, generator=g) * 2.5, -1))
        return torch.stack(rows)
    return f


def test_fork_append_free_keep_invariants_and_release_everything():
    kv = KVCacheManager(64, BS)
    state = start([5, 6, 7, 8, 9, 10], 4, kv, max_new_tokens=9)
    pruned = []
    copies = run(state, kv, table_logprobs(1, 50), pruned)
    assert pruned and all(s.status is SequenceStatus.FINISHED_ABORTED for s in pruned)
    assert state.done and state.group.is_finished() and len(state.hypotheses) == 4
    assert kv.num_free_blocks == kv.num_blocks  # freed beams and the final ones released every block
    # beams are forked mid-block, so some steps copy a shared last block; never more than one per beam
    assert any(copies) and all(len(c) <= 4 for c in copies)
    assert all(len(h.output_token_ids) == 9 for h in state.hypotheses)  # no stop ids: all end at length
    assert all(h.finish_reason == "length" for h in state.hypotheses)


def test_hypotheses_ranked_by_length_normalised_score():
    kv = KVCacheManager(64, BS)
    eos = 3
    state = start([1, 2], 3, kv, max_new_tokens=6, stop_token_ids=[eos], length_penalty=0.8)
    run(state, kv, table_logprobs(7, 12))
    scores = [h.score for h in state.hypotheses]
    assert scores == sorted(scores, reverse=True)
    for h in state.hypotheses:
        assert h.score == pytest.approx(h.cumulative_logprob / len(h.output_token_ids) ** 0.8, rel=1e-6)
        assert (h.output_token_ids[-1] == eos) == (h.finish_reason == "stop")
    assert state.best(2) == state.hypotheses[:2]
    with pytest.raises(RuntimeError, match="already done"):
        state.step(torch.zeros(1, 12), kv)


def test_step_checks_its_inputs():
    kv = KVCacheManager(8, BS)
    state = start([1, 2, 3], 2, kv)
    with pytest.raises(ValueError, match=r"logprobs must be \[1, V\] for 1 running beams, got \(2, 5\)"):
        state.step(torch.zeros(2, 5), kv)
    with pytest.raises(ValueError, match="early_stopping must be True, False or 'never', got 'soon'"):
        BeamSearchState(state.group, 2, stop_token_ids=[], max_new_tokens=2, early_stopping="soon")


# ---- against transformers' beam search on tiny checkpoints --------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)
    models = {}
    for name, cfg_cls, cls in (("llama", LlamaConfig, LlamaForCausalLM), ("qwen3", Qwen3Config, Qwen3ForCausalLM)):
        torch.manual_seed(0)
        model = cls._from_config(cfg_cls(**common, head_dim=8), attn_implementation="sdpa").eval()
        model.generation_config.eos_token_id = None
        models[name] = model
    return models


@pytest.mark.parametrize("family, length_penalty, early_stopping", [
    ("llama", 1.0, False), ("llama", 0.5, True), ("qwen3", 2.0, "never"), ("qwen3", -1.0, False),
])
def test_same_hypotheses_and_scores_as_transformers(tiny_models, family, length_penalty, early_stopping):
    from transformers import GenerationConfig

    model = tiny_models[family]
    prompt, width, max_new = [5, 17, 33, 42, 8], 4, 7
    with torch.no_grad():
        eos = model(torch.tensor([prompt])).logits[0, -1].argmax().item()
    # EOS = the model's favourite first token: some hypotheses end on it, others run to the length limit
    gc = GenerationConfig(num_beams=width, num_return_sequences=width, max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0, length_penalty=length_penalty,
                          early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), generation_config=gc)

    def trimmed(ids):  # transformers pads finished hypotheses with EOS
        return ids[:ids.index(eos) + 1] if eos in ids else ids
    expected = [(trimmed(ref.sequences[i, len(prompt):].tolist()), ref.sequences_scores[i].item())
                for i in range(width)]

    kv = KVCacheManager(64, BS)
    state = start(prompt, width, kv, stop_token_ids=[eos], max_new_tokens=max_new, length_penalty=length_penalty,
                  early_stopping=early_stopping)
    sampler = Sampler()

    def next_logprobs(beams):
        with torch.no_grad():  # beams have equal lengths: one batched forward without a cache
            logits = model(torch.tensor([s.all_token_ids for s in beams])).logits[:, -1]
        return sampler.beam_logprobs(logits, [state.group.sampling_params] * len(beams))
    run(state, kv, next_logprobs)
    got = [(h.output_token_ids, h.score) for h in state.best(width)]
    assert [g[0] for g in got] == [e[0] for e in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
    assert any(eos in g[0] for g in got)  # the case exercises EOS hypotheses
    assert kv.num_free_blocks == kv.num_blocks
    assert all(s.status is SequenceStatus.FINISHED_STOPPED for s in state.group.seqs)
