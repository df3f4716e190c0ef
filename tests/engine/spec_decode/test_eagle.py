"""EAGLE-style draft head (eagle_head.py, eagle.py): every proposal is what the head gives on transformers' (+ PEFT's)
final hidden states of the sequence, for base and adapter requests in one step (one adapter with a head of its
own); greedy output with the head is the
non-speculative output token for token (mixed adapters, an abort), nothing leaks; bad heads are refused."""
from __future__ import annotations

import json
import os

import pytest
import torch

from loraplex.engine import SamplingParams
from loraplex.engine.spec_decode import SpeculativeConfig
from loraplex.engine.spec_decode.eagle_head import EagleHead, EagleHeadConfig, save_eagle_head
from tests.engine.spec_decode.conftest import (adapter_refs, assert_all_free, drive, make_engine, prompt_list,
                                               record_proposals)
from tests.utils.scripts import load_script

K = 3


def _bench():
    return load_script("engine", "spec_acceptance")


@pytest.fixture(scope="module")
def trained_head(tiny_checkpoint, tmp_path_factory):
    """A head trained briefly on the tiny llama's hidden states of random tokens (drafts right often enough that
    verify steps accept some and reject some)."""
    path = tiny_checkpoint("llama")

    def sample(batch, length, gen):
        return torch.randint(3, 320, (batch, length), generator=gen)

    head, _ = _bench().train_eagle_head(path, sample, steps=150, batch=16, seq_len=24, intermediate_size=96)
    return path, save_eagle_head(head, tmp_path_factory.mktemp("eagle-head"))


def _workload(refs: dict) -> list[tuple]:
    prompts = prompt_list((6, 9, 4, 11, 7, 5), seed=9)
    adapters = [None, "a", "b", "a", None, "b"]
    lengths = [16, 14, 17, 9, 12, 15]
    return [(f"r{i}", prompts[i], SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True),
             refs[adapters[i]] if adapters[i] else None) for i in range(len(prompts))]


def _run(path, refs, spec, cache, before_step=None, record=None):
    engine = make_engine(path, spec, adapter_cache_dir=cache, enable_lora=True, max_loras=2, max_lora_rank=8)
    for ref in refs.values():
        assert engine.load_adapter(ref, wait=True) == "ready"
    if record is not None:
        record_proposals(engine, record)
    finals = drive(engine, _workload(refs), arrivals={0: [0, 1, 2, 3], 3: [4, 5]}, before_step=before_step)
    assert_all_free(engine)
    assert engine.spec is None or engine.spec.proposer.num_sequences == 0
    return {rid: o.output_token_ids for rid, o in finals.items()}, engine


def test_eagle_head_lossless_and_proposals_follow_transformers(trained_head, peft_folders, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraplex.engine.spec_decode.eagle_head import load_eagle_head

    path, head_dir = trained_head
    folders = peft_folders(path)
    refs = adapter_refs(folders)
    want, _ = _run(path, refs, None, str(tmp_path / "ref"))
    record: list = []
    torch.manual_seed(5)  # adapter a's own head (the others use the shared, trained one)
    head_a = save_eagle_head(EagleHead(EagleHeadConfig(72, 64)), tmp_path / "head-a")
    spec = dict(method="eagle", draft_head=head_dir, draft_heads={"t/a/1": head_a}, num_speculative_tokens=K)
    got, engine = _run(path, refs, spec, str(tmp_path / "eagle"), record=record)
    assert got == want
    stats = engine.spec.snapshot()
    assert 0 < stats["accepted"] < stats["proposed"], stats
    assert {r["adapter"] for r in stats["adapters"]} == {None, "t/a/1", "t/b/1"}
    engine.close()

    heads = {key: load_eagle_head(d, hidden_size=72, device=torch.device("cpu"), dtype=torch.float32)
             for key, d in ((None, head_dir), ("t/a/1", head_a))}
    models = {None: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()}
    for name, folder in folders.items():
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        models[f"t/{name}/1"] = PeftModel.from_pretrained(base, folder).eval().base_model.model
    checked = 0
    with torch.no_grad():
        for tokens, adapter, drafts in record:
            adapter_id = getattr(adapter, "adapter_id", None)
            lm, head = models[adapter_id], heads[adapter_id if adapter_id in heads else None]
            f = lm.model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state[:, -1]
            x, ref = tokens[-1], []
            for _ in drafts:
                f = head(f, lm.model.embed_tokens(torch.tensor([x])))
                x = int(lm.lm_head(f).argmax(-1))
                ref.append(x)
            assert drafts == ref, (tokens, adapter)
            checked += 1
    assert checked >= 20 and {getattr(a, "adapter_id", None) for _, a, _ in record} == set(models)


def test_eagle_head_abort_and_sampling(trained_head, peft_folders, tmp_path):
    """A request aborted mid-run leaves nothing behind; the rest keep the reference tokens. Seeded sampling with the
    head's draft distribution (rejection sampling) runs and is reproducible run to run."""
    path, head_dir = trained_head
    refs = adapter_refs(peft_folders(path))
    want, _ = _run(path, refs, None, str(tmp_path / "ref"))
    spec = dict(method="eagle", draft_head=head_dir, num_speculative_tokens=4)

    def abort_r1(k, engine):
        if k == 5:
            engine.abort("r1")

    got, engine = _run(path, refs, spec, str(tmp_path / "abort"), before_step=abort_r1)
    assert "r1" not in got and got == {rid: t for rid, t in want.items() if rid != "r1"}
    engine.close()
    outs = []
    for run in range(2):
        engine = make_engine(path, spec)
        for i, prompt in enumerate(prompt_list((5, 8, 6), seed=4)):
            engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=i,
                                                               ignore_eos=True))
        outs.append({rid: o.output_token_ids for rid, o in _drain(engine).items()})
        assert engine.spec.snapshot()["proposed"] > 0
        assert_all_free(engine)
        engine.close()
    assert outs[0] == outs[1] and all(len(t) == 12 for t in outs[0].values())


def _drain(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
        engine.kv_cache.check_invariants()
    return finals


def test_bad_heads_are_refused(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="needs draft_head"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="method='eagle'"):
        SpeculativeConfig(method="draft", draft_model="/d", draft_head="/h")
    with pytest.raises(ValueError, match="adapter ids to head folders"):
        SpeculativeConfig(method="eagle", draft_head="/h", draft_heads={"t/a/1": 3})
    with pytest.raises(ValueError, match="has no config.json"):
        make_engine(path, dict(method="eagle", draft_head=str(tmp_path)))
    wrong = save_eagle_head(EagleHead(EagleHeadConfig(64, 32)), tmp_path / "wrong-width")
    with pytest.raises(ValueError, match="hidden_size 64, the target 72"):
        make_engine(path, dict(method="eagle", draft_head=wrong))
    odd = save_eagle_head(EagleHead(EagleHeadConfig(72, 32)), tmp_path / "odd")
    with open(os.path.join(odd, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"draft_head": "eagle_mlp", "hidden_size": 72, "intermediate_size": 48}, f)
    with pytest.raises(ValueError, match="size mismatch"):
        make_engine(path, dict(method="eagle", draft_head=odd))
