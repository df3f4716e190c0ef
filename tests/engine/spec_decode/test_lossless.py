"""Lossless greedy speculative decoding: for every family, base requests and two PEFT adapters (attention, and the
fused experts on MoE families) mixed in every batch, the tokens are those of non-speculative greedy decoding, token
for token, with each proposer:

    ngram          prompt lookup on prompts that repeat themselves (drafts right and wrong)
    replay         the reference run's tokens with a wrong one planted (the target decides: replay_forced=False),
                   so every verify step accepts some drafts and rejects one
    draft (bad)    an unrelated random model of the family as the draft: nearly every draft rejected
    draft (good)   the target with noise on its weights: drafts often right (one family; and the flattened
                   verify rows of the padded decode path, verify_cuda_graphs, on another)

The KV cache's invariants hold after every step, every block (the target's and the draft's) is free at the end.
"""
from __future__ import annotations

import pytest

from loraplex.engine import SamplingParams
from loraplex.engine.testing.tiny import FAMILIES
from tests.engine.spec_decode.conftest import adapter_refs, assert_all_free, drive, make_engine, prompt_list

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


def workload(refs: dict) -> list[tuple]:
    prompts = prompt_list((6, 9, 4, 11, 7, 5), seed=3)
    prompts[0] = prompts[0] * 3          # repeats: prompt lookup finds drafts
    prompts[3] = prompts[3][:5] * 2 + prompts[3][5:]
    adapters = [None, "a", "b", "a", None, "b"]
    lengths = [20, 14, 17, 9, 12, 16]
    return [(f"r{i}", prompts[i], SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True),
             refs[adapters[i]] if adapters[i] else None) for i in range(6)]


def run(path: str, refs: dict, spec: dict | None, tmp_path, tag: str, record=None, **kw) -> tuple:
    engine = make_engine(path, spec, adapter_cache_dir=str(tmp_path / f"cache-{tag}"), **LORA, **kw)
    for ref in refs.values():
        assert engine.load_adapter(ref, wait=True) == "ready"
    reqs = workload(refs)
    if record is not None:
        for rid, prompt, _, _ in reqs:
            engine.spec.proposer.record(prompt, record[rid])
    finals = drive(engine, reqs, arrivals={0: [0, 1, 2, 3], 2: [4], 5: [5]})
    assert_all_free(engine)
    return {rid: o.output_token_ids for rid, o in finals.items()}, engine


@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_greedy_every_proposer(family, tiny_checkpoint, peft_folders, tmp_path):
    path = tiny_checkpoint(family)
    refs = adapter_refs(peft_folders(path))
    want, _ = run(path, refs, None, tmp_path, "ref")
    bad_draft = tiny_checkpoint(family, seed=7)
    specs = {
        "ngram": (dict(method="ngram", num_speculative_tokens=3), None),
        "replay": (dict(method="replay", num_speculative_tokens=4, replay_acceptance_rate=0.6, replay_forced=False),
                   want),
        "draft-bad": (dict(method="draft", draft_model=bad_draft, num_speculative_tokens=2), None),
    }
    for name, (spec, record) in specs.items():
        got, engine = run(path, refs, spec, tmp_path, name, record)
        assert got == want, f"{family} {name}"
        stats = engine.spec.snapshot()
        assert stats["proposed"] > 0 and stats["verified"] > 0, (name, stats)
        assert stats["accepted"] < stats["proposed"], (name, stats)  # rejections happened
        if name == "replay":
            assert stats["accepted"] > 0
            assert stats["acceptance_length"] > 1.5, stats
        by_adapter = {r["adapter"] for r in stats["adapters"]}
        assert by_adapter <= {None, "t/a/1", "t/b/1"} and len(by_adapter) >= 2, (name, by_adapter)
        engine.close()


@pytest.mark.parametrize("family,graphs", [("qwen3_moe", False), ("llama", True)])
def test_lossless_greedy_good_draft(family, graphs, tiny_checkpoint, peft_folders, perturbed_checkpoint, tmp_path):
    """A draft that is often right: long accepted runs, bonus tokens, draft K/V kept across steps; with
    ``verify_cuda_graphs`` the verify rows run through the padded decode path (the CUDA graphs' inputs)."""
    path = tiny_checkpoint(family)
    refs = adapter_refs(peft_folders(path))
    want, _ = run(path, refs, None, tmp_path, "ref")
    spec = dict(method="draft", draft_model=perturbed_checkpoint(path, 0.05), num_speculative_tokens=3,
                verify_cuda_graphs=graphs)
    got, engine = run(path, refs, spec, tmp_path, "good")
    assert got == want
    stats = engine.spec.snapshot()
    base = next(r for r in stats["adapters"] if r["adapter"] is None)  # the draft has no LoRA: base requests agree
    assert base["acceptance_length"] > 1.5, stats["adapters"]
    assert stats["accepted"] < stats["proposed"]
    if graphs:
        assert stats["graph_steps"] > 0 and engine.spec.executor.num_graph_steps == stats["graph_steps"]
    else:
        assert stats["graph_steps"] == 0
