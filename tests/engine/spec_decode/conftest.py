"""Fixtures and drivers of the speculative-decoding tests: draft checkpoints (a perturbed copy of the target: drafts
often right; an unrelated random model: drafts almost always wrong) and a step loop that checks the KV cache after
every step. The PEFT adapters (``peft_folders``) come from tests/engine/conftest.py."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from loraplex.engine import LLMEngine
from loraplex.engine.lora.ref import AdapterRef

BASE = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=64, progress=False)


@pytest.fixture(scope="session")
def perturbed_checkpoint(tmp_path_factory):
    """``perturbed_checkpoint(base, scale) -> folder``: the base's weights plus Gaussian noise of ``scale`` times each
    tensor's std (same family, config and tokenizer): a draft that is often, not always, right."""
    cache: dict = {}

    def make(base: str, scale: float = 0.3) -> str:
        key = (base, scale)
        if key not in cache:
            import shutil

            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            g = torch.Generator().manual_seed(123)
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() > 1:
                        p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
            out = str(tmp_path_factory.mktemp("spec-draft"))
            model.save_pretrained(out)
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
                try:
                    shutil.copy(f"{base}/{f}", f"{out}/{f}")
                except FileNotFoundError:
                    pass
            cache[key] = out
        return cache[key]

    return make


def adapter_refs(folders: dict[str, str]) -> dict[str, AdapterRef]:
    return {name: AdapterRef(f"t/{name}/1", f"file://{folder}") for name, folder in folders.items()}


def make_engine(path: str, spec: dict | None = None, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(path, speculative=spec, **{**BASE, **kw})


def prompt_list(lens, seed: int, vocab: int = 320) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def drive(engine: LLMEngine, requests: list[tuple], arrivals: dict[int, list[int]] | None = None,
          before_step=None, max_steps: int = 2000) -> dict:
    """Run ``requests`` [(id, prompt, params, adapter)] (``arrivals[k]``: indices added before step k; default all
    at step 0) to completion, checking the KV cache's invariants after every step and that outputs only grow.
    Returns {request id: final output}."""
    arrivals = arrivals or {0: list(range(len(requests)))}
    finals, tokens = {}, defaultdict(list)
    k = 0
    while k <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(k, []):
            engine.add_request(*requests[i])
        if before_step is not None:
            before_step(k, engine)
        for o in engine.step():
            assert o.request_id not in finals, f"{o.request_id}: output after its final output"
            assert o.output_token_ids == tokens[o.request_id] + o.new_token_ids
            tokens[o.request_id] = list(o.output_token_ids)
            if o.finished:
                finals[o.request_id] = o
        engine.kv_cache.check_invariants()
        draft = getattr(getattr(engine.spec, "proposer", None), "runner", None)
        if draft is not None:
            draft.kv.check_invariants()
        k += 1
        assert k < max_steps, "requests did not finish"
    return finals


def assert_all_free(engine: LLMEngine) -> None:
    """Nothing left: every target KV block (GPU and CPU pools) and every draft KV block free, no proposer state."""
    kv = engine.kv_cache
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.swap_space.num_free_blocks == (kv.swap_space.num_blocks if kv.swap_space.pool is not None else 0)
    assert not engine.scheduler.has_unfinished()
    if engine.spec is not None:
        assert not engine.spec._tracked and not engine.spec._hidden
        draft = getattr(engine.spec.proposer, "runner", None)
        if draft is not None:
            draft.kv.check_invariants()
            assert draft.kv.num_free_blocks == draft.kv.num_blocks and not engine.spec.proposer.num_sequences


@pytest.fixture
def serve_speculative(monkeypatch):
    """``run(*flags)`` -> the ``SpeculativeConfig`` (None: off) ``loraplex engine serve --model /m *flags`` would give
    the engine, without loading anything; ``run.exit_codes`` the CLI's return values."""
    from loraplex.cli import main
    from loraplex.commands import engine as engine_cmd
    from loraplex.engine.engine_config import EngineConfig
    from loraplex.engine.server import serve as serve_mod

    seen: list[dict] = []
    monkeypatch.setattr(engine_cmd, "_check_settings", lambda model, kwargs: None)  # "/m" has no config.json
    monkeypatch.setattr(serve_mod, "real_service", lambda model, **kw: seen.append(kw))
    monkeypatch.setattr(serve_mod, "serve", lambda make, **kw: make())

    def run(*flags: str):
        before = len(seen)
        run.exit_codes.append(main(["engine", "serve", "--model", "/m", *flags]))
        if len(seen) == before:
            return None
        return EngineConfig(model="/m", **{k: v for k, v in seen[-1].items() if k != "model_name"}).speculative

    run.exit_codes = []
    return run


def record_proposals(engine: LLMEngine, record: list, *, with_params: bool = False) -> None:
    """From now on, append (token ids, adapter[, params], drafts) to ``record`` for every proposal the engine's
    proposer makes."""
    propose = engine.spec.proposer.propose

    def recording(batch):
        out = propose(batch)
        for s, p in zip(batch, out):
            if p is not None:
                tokens = s.seq.token_ids_slice(0, s.seq.num_tokens)
                record.append((tokens, s.adapter, s.params, list(p.token_ids)) if with_params
                              else (tokens, s.adapter, list(p.token_ids)))
        return out

    engine.spec.proposer.propose = recording
