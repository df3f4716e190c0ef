"""benchmarks/engine/train_tiny.py on the CPU, at tiny step counts, for one dense and one MoE family: training on the
synthetic chain lowers the held-out loss by a clear margin, the saved checkpoint keeps make_tiny_checkpoint's
config and tokenizer and gives the engine the same greedy tokens as transformers, and a trained adapter changes
the engine's greedy output (to what PEFT itself predicts)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.utils.scripts import load_script


def _load(name: str):
    return load_script("engine", name)


train_tiny = _load("train_tiny")
ccg = _load("check_cuda_graphs")

FAMILIES = ["llama", "qwen3_moe"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(family)``: train_tiny's result at tiny step counts, built once per family. One intra-op thread:
    at these sizes, threads contending with the rest of a busy machine cost far more than they give."""
    cache: dict = {}
    threads = torch.get_num_threads()

    def make(family: str) -> dict:
        if family not in cache:
            torch.set_num_threads(1)
            try:
                cache[family] = train_tiny.train_tiny(family, str(tmp_path_factory.mktemp(f"trained-{family}")),
                                                      steps=40, batch=16, seq_len=32, device="cpu", log_every=0)
            finally:
                torch.set_num_threads(threads)
        return cache[family]

    return make


def test_chain_is_peaked_and_deterministic():
    a, b = train_tiny.make_chain(320, 0), train_tiny.make_chain(320, 0)
    assert torch.equal(a.probs, b.probs) and torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.probs.sum(-1), torch.ones(train_tiny.ALPHABET, train_tiny.ALPHABET))
    assert bool((a.probs.amax(-1) == train_tiny.P_TOP).all())
    assert int(a.tokens.min()) >= 3 and int(a.tokens.max()) < 320   # never a special token
    other = train_tiny.make_chain(320, 1)
    assert torch.equal(other.tokens, a.tokens)                       # same alphabet,
    assert (other.probs.argmax(-1) != a.probs.argmax(-1)).float().mean() > 0.8   # different successors
    seq = a.sample(4, 50, torch.Generator().manual_seed(3))
    assert seq.shape == (4, 50) and bool(torch.isin(seq, a.tokens).all())


@pytest.mark.parametrize("family", FAMILIES)
def test_training_lowers_loss_and_keeps_config(family, trained, tmp_path):
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    res = trained(family)
    stats = res["stats"]
    assert stats["base"]["loss_after"] < stats["base"]["loss_before"] - 2.0, stats["base"]
    for name in ("a4", "a8"):
        assert stats[name]["loss_after"] < stats[name]["loss_before"] - 1.0, stats[name]
    margins = stats["base"]["router_after"]
    if family in train_tiny.MOE_FAMILIES:
        assert margins["mean_gap"] > 0 and 0 <= margins["close_calls"] <= 1
    else:
        assert margins is None
    fresh = make_tiny_checkpoint(family, tmp_path / "fresh")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        with open(os.path.join(fresh, name), "rb") as f, open(os.path.join(res["base"], name), "rb") as g:
            assert f.read() == g.read(), f"{name} differs from make_tiny_checkpoint's"


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_runs_trained_checkpoint_and_adapter(family, trained, hf_greedy, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    res = trained(family)
    base, chains = res["base"], res["chains"]
    gen = torch.Generator().manual_seed(5)
    base_prompt = chains[None].sample(1, 9, gen)[0].tolist()
    lora_prompt = chains["a4"].sample(1, 11, gen)[0].tolist()
    requests = [("base", None, base_prompt, NEW_TOKENS), ("lora", "a4", lora_prompt, NEW_TOKENS),
                ("base-on-lora-prompt", None, lora_prompt, NEW_TOKENS)]
    got, _, _ = ccg.run_tiny_engine(base, res["adapters"], requests, str(tmp_path), eager=True, device="cpu")

    assert got["base"] == hf_greedy(base, base_prompt, NEW_TOKENS)[0]
    assert got["base-on-lora-prompt"] == hf_greedy(base, lora_prompt, NEW_TOKENS)[0]
    assert got["lora"] != got["base-on-lora-prompt"], "the trained adapter did not change the greedy output"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    peft = PeftModel.from_pretrained(model, res["adapters"]["a4"]).eval()
    with torch.no_grad():
        logits = peft(input_ids=torch.tensor([lora_prompt + got["lora"][:-1]])).logits[0, len(lora_prompt) - 1:]
    assert logits.argmax(-1).tolist() == got["lora"]
