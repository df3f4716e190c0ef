"""Fixtures shared by every test area: tiny random checkpoints (built once per session) and the transformers
oracle used to check the engine."""
from __future__ import annotations

import os

import loraplex  # noqa: F401  (first: installed distributions keep their names; loraplex/__init__.py)

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family, **overrides) -> path``; identical arguments share one checkpoint per session."""
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    cache: dict = {}

    def make(family: str, **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[key] = make_tiny_checkpoint(family, str(out), **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_greedy():
    """``hf_greedy(path, prompt_ids, max_new_tokens) -> (token_ids, [logits per step])`` by transformers'
    ``generate`` in float32 with eager attention and EOS disabled (the engine side uses ignore_eos)."""
    import torch
    from transformers import AutoModelForCausalLM

    models: dict = {}

    def run(path: str, prompt_ids: list[int], max_new_tokens: int):
        if path not in models:
            m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
            m.generation_config.eos_token_id = None
            models[path] = m.eval()
        model = models[path]
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        return out.sequences[0, len(prompt_ids):].tolist(), [l[0].float() for l in out.logits]

    return run
