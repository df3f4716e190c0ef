"""``apply_tp`` + sharded LoRA slots, ranks as threads of one process (``ThreadGroup``): a prefill and greedy
decode steps through the paged KV cache with three sequences of one prompt under adapter A, the base model and
adapter B give the logits of the unsharded model, for dense and MoE families, split and replicated kv heads."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.attention_metadata import AttentionMetadata
from loraplex.engine.distributed.lora import TPLoRASlots, shard_adapter_weights
from loraplex.engine.distributed.parallel_state import TensorParallel
from loraplex.engine.distributed.sharding import shard_plan
from loraplex.engine.distributed.tensor_parallel import apply_tp
from loraplex.engine.loader import load_model
from loraplex.engine.lora.slots import LoRASlots
from loraplex.engine.lora.weights import load_adapter_weights

BS, BLOCKS_PER_SEQ, MAX_RANK = 4, 8, 8
PROMPT = [5, 77, 13, 250, 9, 31, 140, 2, 66]
SLOT_OF_SEQ = [0, -1, 1]           # adapter A, base model, adapter B: one prompt for all three
DECODE_STEPS = 4


def _metadata(lens: list[int], new: list[int]) -> AttentionMetadata:
    """Sequence b owns blocks [b·BLOCKS_PER_SEQ, (b+1)·BLOCKS_PER_SEQ) for its whole life."""
    tables = torch.tensor([[b * BLOCKS_PER_SEQ + i for i in range(BLOCKS_PER_SEQ)] for b in range(len(lens))],
                          dtype=torch.int32)
    slots, qsl = [], [0]
    for b, (ctx, n) in enumerate(zip(lens, new)):
        slots += [(b * BLOCKS_PER_SEQ + p // BS) * BS + p % BS for p in range(ctx - n, ctx)]
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(torch.tensor(slots), tables, torch.tensor(lens, dtype=torch.int32),
                             torch.tensor(qsl, dtype=torch.int32), max(new), max(lens))


def _generate(path: str, adapters: list[str], tp) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill + DECODE_STEPS greedy steps on rank ``tp`` (world_size 1: the unsharded model)."""
    model, cfg = load_model(path, progress=False)
    kw = dict(max_step_slots=len(adapters), max_rank=MAX_RANK, device="cpu", dtype=torch.float32)
    if tp.world_size > 1:
        plan = apply_tp(model, cfg, tp)
        slots, kv_heads = TPLoRASlots(model, cfg, plan=plan, **kw), plan.num_kv_heads
    else:
        slots, kv_heads = LoRASlots(model, cfg, **kw), cfg.num_kv_heads
    for i, folder in enumerate(adapters):
        slots.load(i, load_adapter_weights(folder, cfg, max_rank=MAX_RANK, dtype=torch.float32))
    shape = (len(SLOT_OF_SEQ) * BLOCKS_PER_SEQ, BS, kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    seqs = [list(PROMPT) for _ in SLOT_OF_SEQ]
    new = [len(PROMPT)] * len(seqs)
    all_logits = []
    with torch.inference_mode():
        for _ in range(DECODE_STEPS + 1):
            lens = [len(s) for s in seqs]
            ids = torch.tensor([t for s, n in zip(seqs, new) for t in s[-n:]])
            pos = torch.cat([torch.arange(L - n, L) for L, n in zip(lens, new)])
            slots.set_token_slots(torch.tensor(SLOT_OF_SEQ, dtype=torch.int32).repeat_interleave(torch.tensor(new)))
            hidden = model(ids, pos, _metadata(lens, new), kv)
            logits = model.compute_logits(hidden[torch.tensor(new).cumsum(0) - 1])
            all_logits.append(logits)
            for s, t in zip(seqs, logits.argmax(-1).tolist()):
                s.append(t)
            new = [1] * len(seqs)
    return all_logits, [s[len(PROMPT):] for s in seqs]


CASES = [  # (family, overrides, world size): dense with biases, MoE with sinks / expert biases / sliding window,
    ("llama", {}, 2),                                           # a dense layer among MoE ones, replicated kv heads
    ("gpt_oss", {}, 2),
    ("qwen3_moe", {}, 2),
    ("llama", {"num_attention_heads": 8}, 4),                   # 2 kv heads on 4 ranks: each kept by 2 ranks
]


@pytest.mark.parametrize("family,overrides,world", CASES, ids=[f"{c[0]}-tp{c[2]}" for c in CASES])
def test_sharded_forward_matches_unsharded(family, overrides, world, tiny_checkpoint, tp_adapter, thread_group):
    path = tiny_checkpoint(family, **overrides)
    adapters = [tp_adapter(path, seed=1), tp_adapter(path, seed=2)]
    ref_logits, ref_tokens = _generate(path, adapters, TensorParallel())
    # the adapters are live: one prompt, three different next-token distributions
    first = ref_logits[0]
    assert not torch.allclose(first[0], first[1], atol=1e-3) and not torch.allclose(first[2], first[1], atol=1e-3)

    results = thread_group(world).run(lambda tp: _generate(path, adapters, tp))
    for logits, tokens in results:  # every rank computes the same (replicated) logits
        assert tokens == ref_tokens
        for got, want in zip(logits, ref_logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_kv_cache_holds_only_the_rank_heads(tiny_checkpoint):
    path = tiny_checkpoint("llama", num_attention_heads=8)
    model, cfg = load_model(path, progress=False)
    plan = apply_tp(model, cfg, TensorParallel(rank=3, world_size=4))  # no collective before a forward
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1) and plan.kv_replicated
    assert plan.kv_heads.tolist() == [1]  # q heads 6, 7 read kv head 1 (4 q heads per kv head)
    assert attn.qkv_proj.weight.shape == ((2 + 2 * 1) * cfg.head_dim, cfg.hidden_size)
    assert attn.o_proj.weight.shape == (cfg.hidden_size, 2 * cfg.head_dim)
    assert torch.count_nonzero(attn.o_proj.bias) == 0  # the bias is rank 0's to add, once


def test_apply_tp_refuses_a_model_with_lora_attached(tiny_checkpoint):
    model, cfg = load_model(tiny_checkpoint("llama"), progress=False)
    LoRASlots(model, cfg, max_step_slots=1, max_rank=4, device="cpu", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="apply_tp must run before LoRA is attached"):
        apply_tp(model, cfg, TensorParallel(rank=0, world_size=2))


def test_shards_of_an_adapter_rebuild_it(tiny_checkpoint, tp_adapter):
    path = tiny_checkpoint("qwen3_moe")
    _, cfg = load_model(path, load_format="dummy", progress=False)
    full = load_adapter_weights(tp_adapter(path, seed=1), cfg, max_rank=MAX_RANK, dtype=torch.float32)
    parts = [shard_adapter_weights(full, shard_plan(cfg, r, 2)) for r in range(2)]
    for (layer, target), t in full.modules.items():
        a0, a1 = (p.modules[(layer, target)] for p in parts)
        if target.endswith(("o_proj", "down_proj")):      # row-parallel: A split along in, B replicated
            assert torch.equal(torch.cat((a0.lora_a, a1.lora_a), -1), t.lora_a)
            assert torch.equal(a0.lora_b, t.lora_b) and torch.equal(a1.lora_b, t.lora_b)
        elif target == "mlp.experts.gate_up_proj":        # each rank: its gate rows, then its up rows
            half = cfg.moe_intermediate_size // 2
            gate = torch.cat((a0.lora_b[:, :half], a1.lora_b[:, :half]), 1)
            up = torch.cat((a0.lora_b[:, half:], a1.lora_b[:, half:]), 1)
            assert torch.equal(torch.cat((gate, up), 1), t.lora_b)
        elif target.endswith(("k_proj", "v_proj", "q_proj", "gate_proj", "up_proj")):
            assert torch.equal(torch.cat((a0.lora_b, a1.lora_b), -2), t.lora_b)
            assert torch.equal(a0.lora_a, t.lora_a)
        else:
            pytest.fail(f"unexpected target {target}")
    assert sum(p.nbytes for p in parts) < 2 * full.nbytes
