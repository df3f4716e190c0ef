"""The down LoRA delta in the pair sum (``fused_moe_mxfp4.sum_pairs_lora``, ``LORAPLEX_MOE_DOWN_DELTA=sum``): the
kernel against a torch sum at awkward sizes (split partials or bf16 pair rows, shrink partials, mixed ranks, a slot
without weights, tokens without an adapter), the expert layer on that path against the reference, and the kernel's
sm_90 build."""
from __future__ import annotations

import pytest
import torch

from loraplex.kernels import fused_moe_mxfp4 as fm
from loraplex.kernels import moe_experts_lora as mel
from loraplex.kernels.lora_table import LoRATable
from tests.kernels.lora_inputs import expert_table
from tests.kernels.sm90_build import build_in_child
from tests.kernels.test_mxfp4_kernel_layout import (E, EPILOGUE_CASES, H, INTER, _lora_layer, _moe,
                                                    check_epilogue_case)


def _factors(num_slots, num_experts, k, n, ranks, empty):
    slots, dense = [], []
    for l in range(num_slots):
        if l in empty:
            slots.append([None])
            dense.append(None)
            continue
        r = ranks[l % len(ranks)]
        a, b = torch.randn(num_experts, r, k), torch.randn(num_experts, n, r) / r ** 0.5
        slots.append([(a, b)])
        dense.append(b)
    table = LoRATable.from_factors(slots, in_features=k, out_features=(n,), max_rank=32, num_experts=num_experts)
    return table, dense


@pytest.mark.parametrize("num_tokens,top_k,hidden,splits,parts", [
    (5, 4, 300, 2, 1),     # float32 split partials, one shrink part, columns past a 256 block
    (3, 2, 77, 1, 3),      # bf16 pair rows (no split-K), three shrink partials, a hidden size below one block
    (9, 4, 520, 3, 2),
])
def test_sum_pairs_lora_matches_a_torch_sum(num_tokens, top_k, hidden, splits, parts):
    torch.manual_seed(num_tokens * 100 + hidden)
    num_experts, num_slots, ranks, empty = 6, 4, (8, 32, 4), (2,)
    table, dense = _factors(num_slots, num_experts, 16, hidden, ranks, empty)
    pairs = num_tokens * top_k
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k)
    slots = torch.randint(0, num_slots, (num_tokens,), dtype=torch.int32)
    slots[::3] = -1
    slots[1] = 2  # the slot without weights
    if splits > 1:
        out = torch.randn(splits, pairs, hidden)
        base = out.sum(0)
    else:
        out = torch.randn(pairs, hidden).to(torch.bfloat16)
        base = out.float()
    buf = torch.randn(parts, pairs, 32)
    buf[:, (slots < 0).repeat_interleave(top_k)] = float("nan")  # rows of tokens without an adapter: never written
    got = fm.sum_pairs_lora(out, fm.LoRAEpilogue(buf, table, slots), ids, weights, torch.float32)
    want = base.view(num_tokens, top_k, hidden).sum(1)
    h = buf.sum(0)
    for t in range(num_tokens):
        l = int(slots[t])
        if l < 0 or dense[l] is None:
            continue
        for a in range(top_k):
            b = dense[l][int(ids[t, a])]  # [N, r]
            want[t] += weights[t, a] * (b @ h[t * top_k + a, :b.shape[1]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got).all()


def test_sum_pairs_lora_refuses_bad_shapes():
    table, _ = _factors(2, 4, 8, 64, (8,), ())
    ids = torch.zeros(3, 2, dtype=torch.int32)
    lora = fm.LoRAEpilogue(torch.zeros(1, 6, 32), table, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="6 pair rows"):
        fm.sum_pairs_lora(torch.zeros(5, 64), lora, ids, torch.ones(3, 2), torch.float32)
    bad = fm.LoRAEpilogue(torch.zeros(1, 6, 32), table, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="token_slots"):
        fm.sum_pairs_lora(torch.zeros(6, 64), bad, ids, torch.ones(3, 2), torch.float32)


@pytest.mark.parametrize("case", list(EPILOGUE_CASES))
def test_expert_layer_with_the_down_delta_in_the_sum_matches_reference(case, monkeypatch):
    """The decode path with ``DOWN_DELTA_IN_SUM``: the gate_up delta in its GEMM's epilogue, the down GEMM without
    LoRA, the down delta in sum_pairs_lora (launched once)."""
    calls, real = [], fm.sum_pairs_lora
    monkeypatch.setattr(mel, "DOWN_DELTA_IN_SUM", True)
    monkeypatch.setattr(fm, "sum_pairs_lora", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    check_epilogue_case(case)
    assert calls == [1]


def test_the_switch_reads_two_values(monkeypatch):
    monkeypatch.setenv("LORAPLEX_MOE_DOWN_DELTA", "sum")
    assert mel._down_delta_in_sum() is True
    monkeypatch.setenv("LORAPLEX_MOE_DOWN_DELTA", "epilogue")
    assert mel._down_delta_in_sum() is False
    monkeypatch.setenv("LORAPLEX_MOE_DOWN_DELTA", "gemm")
    with pytest.raises(ValueError, match="'epilogue' or 'sum'"):
        mel._down_delta_in_sum()


BUILD = r'''
import json, sys
sys.path.insert(0, "benchmarks/kernels")
from sm90_loops import build_sm90
import triton.language as tl
from loraplex.kernels import fused_moe_mxfp4 as fm

TYPES = {"part_ptr": "*fp32", "out_ptr": "*bf16", "buf_ptr": "*fp32", "entries_ptr": "*i64", "slot_ptr": "*i32",
         "ids_ptr": "*i32", "weights_ptr": "*fp32"}
out = []
for split, pdl in ((2, True), (1, False)):
    types = dict(TYPES, part_ptr="*fp32" if split > 1 else "*bf16")
    k = build_sm90(fm._sum_pairs_lora_kernel, dict(TOP_K=4, SPLIT_K=split, PARTS=2, BLOCK=256, BLOCK_R=32,
                                                   W_DTYPE=tl.bfloat16, USE_PDL=pdl), types, 4, 1)
    out.append({"pdl": "griddepcontrol.wait" in k.asm["ptx"], "local": "st.local" in k.asm["ptx"]})
print("RESULT " + json.dumps(out))
'''


def test_sum_pairs_lora_builds_for_sm90():
    got = build_in_child(BUILD, timeout=600)
    assert [b["pdl"] for b in got] == [True, False]
    assert not any(b["local"] for b in got), got  # no local-memory arrays


class _InlineSide:
    """Stands for the CUDA side stream on a CPU: ``fork`` runs the shrink in line and both record the order."""

    def __init__(self, monkeypatch):
        self.events = []
        monkeypatch.setattr(mel, "fork", lambda side, fn: (self.events.append("fork"), fn())[1])
        monkeypatch.setattr(mel, "join", lambda side: self.events.append("join"))


@pytest.mark.parametrize("case", ["both GEMMs split", "down on its own tile"])
def test_down_shrink_forked_beside_the_down_gemm(case, monkeypatch):
    """With a shrink stream the down shrink is forked before the down GEMM and joined before the sum."""
    num_tokens, top_k, config = EPILOGUE_CASES[case]
    x, plain, kernel, weights, ids, b13, b2 = _moe(num_tokens, top_k, True)
    idx = torch.arange(num_tokens, dtype=torch.int32) % 4 - 1
    lora = [(torch.randn(3, E, 32, k) / k ** 0.5, torch.randn(3, E, n, 32) / 32 ** 0.5)
            for k, n in ((H, 2 * INTER), (INTER, H))]
    side = _InlineSide(monkeypatch)
    monkeypatch.setattr(mel, "DOWN_DELTA_IN_SUM", True)
    got, want = _lora_layer(x, plain, kernel, weights, ids, idx, torch.ones(3), config, w13_lora=lora[0],
                            w2_lora=lora[1], activation="silu", shrink_stream=object())
    assert side.events == ["fork", "join"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config,num_tokens", [("16x64x64", 7), ("32x32x64 split3 bits", 12)])
def test_expands_apart_with_the_shrinks_forked(config, num_tokens, monkeypatch):
    """Row blocks above 8 pairs with ``SHRINK_STREAM_APART``: each target's shrink forked before its base GEMM,
    joined before its expand (``moe_lora_expand``), and the layer equal to the reference; a FUSED LoRA config
    keeps its one-kernel call (no fork)."""
    from loraplex.kernels import fused_moe_lora as fml

    x, plain, kernel, weights, ids, b13, b2 = _moe(num_tokens, 4, True)
    idx = torch.arange(num_tokens, dtype=torch.int32) % 4 - 1
    scaling = torch.rand(3) + 0.5
    lora = [(torch.randn(3, E, 32, k) / k ** 0.5, torch.randn(3, E, n, 32) / 32 ** 0.5)
            for k, n in ((H, 2 * INTER), (INTER, H))]
    kw = dict(w13_lora=lora[0], w2_lora=lora[1], activation="swiglu_clamp", b13=b13, b2=b2)
    monkeypatch.setattr(mel, "SHRINK_STREAM_APART", True)
    side = _InlineSide(monkeypatch)
    expands, real = [], fml.moe_lora_expand
    monkeypatch.setattr(fml, "moe_lora_expand", lambda *a, **k: (expands.append(k["config"]["PDL"]), real(*a, **k)))
    got, want = _lora_layer(x, plain, kernel, weights, ids, idx, scaling, config, shrink_stream=object(), **kw)
    assert side.events == ["fork", "join", "fork", "join"] and expands == [0, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # without the switch, or with a one-kernel LoRA config, nothing is forked
    side.events.clear()
    monkeypatch.setattr(mel, "SHRINK_STREAM_APART", False)
    _lora_layer(x, plain, kernel, weights, ids, idx, scaling, config, shrink_stream=object(), **kw)
    monkeypatch.setattr(mel, "SHRINK_STREAM_APART", True)
    monkeypatch.setattr("tests.kernels.test_mxfp4_kernel_layout.LORA_CFG",
                        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "GROUP_M": 1, "num_warps": 4,
                         "num_stages": 1, "FUSED": 1})
    fused, _ = _lora_layer(x, plain, kernel, weights, ids, idx, scaling, config, shrink_stream=object(), **kw)
    assert side.events == []
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-4)


def test_moe_lora_expand_after_shrink_equals_fused_moe_lora():
    """shrink then expand, called apart with the same config and alignment, add what fused_moe_lora adds (gate_up
    rows from tokens, down rows from pairs with routing weights); a wrong buffer or a FUSED config is refused."""
    from loraplex.kernels import fused_moe_lora as fml

    torch.manual_seed(5)
    num_tokens, top_k, num_experts, k, n = 11, 2, 5, 48, 72
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k)
    idx = torch.arange(num_tokens, dtype=torch.int32) % 4 - 1
    scaling = torch.rand(3) + 0.5
    table = expert_table(3, num_experts, k, n, empty=(1,), max_rank=16, ranks=(8, 16))
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2, "GROUP_M": 1, "num_warps": 4, "num_stages": 1}
    for x, w in ((torch.randn(num_tokens, k), None), (torch.randn(num_tokens * top_k, k), weights)):
        y0 = torch.randn(num_tokens * top_k, n)
        want = y0.clone()
        fml.fused_moe_lora(want, x, table, None, ids, idx, scaling, w, config=cfg)
        buf = fml.moe_lora_shrink(x, table, ids, idx, scaling, out_features=n, config=cfg)
        got = y0.clone()
        fml.moe_lora_expand(got, x, buf, table, ids, idx, scaling, w, config=cfg)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - y0).abs().max() > 0.01
    with pytest.raises(ValueError, match="float32"):
        fml.moe_lora_expand(got, x, buf[:, :3], table, ids, idx, scaling, w, config=cfg)
    with pytest.raises(ValueError, match="FUSED"):
        fml.moe_lora_expand(got, x, buf, table, ids, idx, scaling, w, config={**cfg, "FUSED": 1})
