"""Multi-LoRA against PEFT: one engine batch mixes four adapters (ranks 4, 8 with rsLoRA, 16, and an
attention-only one; each stored and read at its own rank) with base-model requests, chunked prefill
on, block_size 4. Every request must give PEFT's greedy tokens for its adapter alone (a separate PeftModel) over
32 new tokens, with logits within 1e-4 (max|d| / max|ref|) at every step. PEFT's side is one teacher-forced
forward per request (see ``peft_logits``): its argmax at every position must be the engine's token.

The adapters target attention and the fused experts (``target_parameters``) on MoE families, attention and
gate/up/down on dense ones; PEFT writes them with ``init_lora_weights=False`` (non-zero B).
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.lora.weights import load_adapter_weights

FAMILIES = ["gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3"]
# name: (rank, alpha, rsLoRA, attention only)
ADAPTERS = {"r4": (4, 8, False, False), "r8-rslora": (8, 12, True, False), "r16": (16, 8, False, False),
            "attn-r8": (8, 16, False, True)}
PROMPTS_PER_ADAPTER = 2
NUM_BASE_PROMPTS = 2
NEW_TOKENS = 32
REL_TOL = 1e-4
MAX_RANK = 16


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def attach_slots_directly(engine: LLMEngine, folders: dict[str, str]) -> dict[int, int]:
    """No AdapterManager: load the adapters into slots 0.. in ADAPTERS order and route sequences to them by hand
    (every step passes the returned {seq_id: slot} map, which the caller fills, to the runner)."""
    slots = engine.runner.init_lora(max_rank=MAX_RANK)
    for slot, name in enumerate(ADAPTERS):
        slots.load(slot, load_adapter_weights(folders[name], engine.model_config, max_rank=MAX_RANK,
                                              dtype=torch.float32))
    seq_slot: dict[int, int] = {}
    execute = engine.runner.execute
    engine.runner.execute = lambda out, sampling, lora_slots=None: execute(out, sampling, lora_slots=seq_slot)
    return seq_slot


def make_requests(family: str, vocab: int, shared_prompt: bool) -> list[tuple[str, str | None, list[int]]]:
    """(request id, adapter name or None, prompt ids), shuffled so that steps mix adapters and base requests.
    With ``shared_prompt`` every adapter and the base also get one request with the same prompt (the prefix
    cache must keep them apart)."""
    gen = torch.Generator().manual_seed(FAMILIES.index(family))
    names = [n for n in ADAPTERS for _ in range(PROMPTS_PER_ADAPTER)] + [None] * NUM_BASE_PROMPTS
    prompts = [torch.randint(0, vocab, (int(torch.randint(6, 19, (1,), generator=gen)),), generator=gen).tolist()
               for _ in names]
    if shared_prompt:
        shared = torch.randint(0, vocab, (13,), generator=gen).tolist()
        names += [*ADAPTERS, None]
        prompts += [shared] * (len(ADAPTERS) + 1)
    order = torch.randperm(len(names), generator=gen).tolist()
    return [(f"req{i}", names[k], prompts[k]) for i, k in enumerate(order)]


@pytest.mark.parametrize("mode", ["slots", "engine"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_adapter_batch_matches_peft(family, mode, tiny_checkpoint, peft_adapter, peft_logits, tmp_path):
    """mode "slots": LoRASlots driven by hand (no AdapterManager, prefix caching off, distinct prompts);
    mode "engine": ``enable_lora=True`` and ``adapter=AdapterRef(file://...)``, prefix caching on, one prompt
    shared by every adapter and the base."""
    path = tiny_checkpoint(family)
    folders = {name: peft_adapter(path, r=r, alpha=a, use_rslora=rs, attention_only=attn, seed=i)
               for i, (name, (r, a, rs, attn)) in enumerate(ADAPTERS.items())}
    kw = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=16,
              enable_chunked_prefill=True, progress=False)
    if mode == "engine":
        engine = LLMEngine.from_pretrained(path, enable_lora=True, max_loras=len(ADAPTERS), max_lora_rank=MAX_RANK,
                                           adapter_cache_dir=str(tmp_path / "adapters"), **kw)
        refs = {name: AdapterRef(f"tenant/{name}/1", f"file://{folder}") for name, folder in folders.items()}
    else:
        engine = LLMEngine.from_pretrained(path, enable_prefix_caching=False, **kw)
        seq_slot = attach_slots_directly(engine, folders)
    requests = make_requests(family, engine.model_config.vocab_size, shared_prompt=mode == "engine")

    logits = defaultdict(list)
    engine.runner.logits_hook = lambda seqs, lg: [logits[s.request_id].append(lg[j].clone())
                                                  for j, s in enumerate(seqs)]
    adapter_of = {rid: name for rid, name, _ in requests}
    step_adapters = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        step_adapters.append({adapter_of[s.seq.request_id] for s in out.scheduled})
        return out

    engine.scheduler.schedule = spy
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for rid, name, prompt in requests:
        if mode == "engine":
            engine.add_request(rid, prompt, params, adapter=refs[name] if name else None)
        else:
            engine.add_request(rid, prompt, params)
            if name is not None:
                seq_slot[engine._requests[rid].group.seqs[0].seq_id] = list(ADAPTERS).index(name)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out

    # steps ran every adapter and base requests together
    assert {None, *ADAPTERS} in step_adapters, step_adapters
    for rid, name, prompt in requests:
        tokens = final[rid].output_token_ids
        assert final[rid].finish_reason == "length" and len(tokens) == NEW_TOKENS, final[rid]
        ref = peft_logits(path, folders[name] if name else None, prompt, tokens)  # [NEW_TOKENS, V]
        assert ref.argmax(-1).tolist() == tokens, f"{family} {rid} adapter={name}: not PEFT's greedy tokens"
        assert len(logits[rid]) == NEW_TOKENS
        errs = [rel_err(g, r) for g, r in zip(logits[rid], ref)]
        assert max(errs) <= REL_TOL, f"{family} {rid} adapter={name}: step errors {errs}"
        if name is not None:  # the adapter really changes the model: PEFT's logits differ from the base's
            base = peft_logits(path, None, prompt, tokens[:1])
            assert rel_err(base[0], ref[0]) > 1e-2, f"{family} adapter {name} is a no-op"
