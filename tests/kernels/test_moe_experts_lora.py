"""moe_experts_lora (fused experts + expert LoRA, optionally INT8) in Triton against its torch reference."""
import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels import reference_lora as ref
from loraplex.kernels import moe_experts_lora as mel
from loraplex.kernels.moe_experts_lora import moe_experts_lora
from tests.kernels.lora_inputs import expert_table, padded_rank_mask, token_adapters

E, A, H, INTER, L, R = 6, 2, 40, 24, 4, 16  # H, I not multiples of BLOCK_K; ranks 8 / 16 / 4, slot 3 empty
BASE_CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
LORA_CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 2, "GROUP_M": 1, "num_warps": 4,
            "num_stages": 1}


def _expert_lora(k, n):
    """A LoRATable: each slot at its own rank (8, 16, 4), slot 3 without weights."""
    return expert_table(L, E, k, n, empty=(3,), max_rank=R, ranks=(8, 16, 4))


def _stacked(k, n):
    mask = padded_rank_mask(L, R)
    lora_a = torch.randn(L, E, R, k) * mask[:, None, :, None] / k ** 0.5
    lora_b = torch.randn(L, E, n, R) * mask[:, None, None, :] / R ** 0.5
    return lora_a, lora_b


def _inputs(num_tokens, with_bias, int8=False):
    x = torch.randn(num_tokens, H)
    w13 = torch.randn(E, 2 * INTER, H) / H ** 0.5
    w2 = torch.randn(E, H, INTER) / INTER ** 0.5
    scores = torch.rand(num_tokens, E)
    scores[:, 1] = -1  # expert 1 receives no token
    weights, ids = torch.topk(scores.softmax(-1), A, dim=-1)
    kw = dict(b13=torch.randn(E, 2 * INTER) if with_bias else None, b2=torch.randn(E, H) if with_bias else None)
    if int8:
        w13, kw["w13_scale"] = ref.quantize_int8_per_channel(w13)
        w2, kw["w2_scale"] = ref.quantize_int8_per_channel(w2)
    return x, w13, w2, weights, ids, kw


def _both(x, w13, w2, weights, ids, idx, scaling, **kw):
    got = moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, config=BASE_CFG, lora_config_override=LORA_CFG,
                           **kw)
    want = ref.moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, **kw)
    return got, want


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("activation,with_bias,int8", [("silu", False, False), ("swiglu_clamp", True, False),
                                                       ("swiglu_clamp", True, True)], ids=["silu", "swiglu", "int8"])
def test_matches_reference(num_tokens, activation, with_bias, int8):
    x, w13, w2, weights, ids, kw = _inputs(num_tokens, with_bias, int8)
    idx = token_adapters(num_tokens, L)
    scaling = torch.rand(L) + 0.5
    got, want = _both(x, w13, w2, weights, ids, idx, scaling, w13_lora=_expert_lora(H, 2 * INTER),
                      w2_lora=_expert_lora(INTER, H), activation=activation, alpha=1.702, limit=7.0, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # tokens without an adapter get the base result (an adapter's delta is not small here)
    base = ref.moe_experts_lora(x, w13, w2, weights, ids, None, scaling, activation=activation, **kw)
    no_lora = (idx < 0) | (idx == 3)  # no adapter, or the empty slot
    torch.testing.assert_close(got[no_lora], base[no_lora], rtol=1e-4, atol=1e-4)
    if (~no_lora).any():
        assert (got[~no_lora] - base[~no_lora]).abs().max() > 0.05


@pytest.mark.parametrize("target", ["gate_up", "down"])
def test_one_target_only(target):
    x, w13, w2, weights, ids, kw = _inputs(9, True)
    idx = token_adapters(9, L)
    scaling = torch.rand(L) + 0.5
    lora = {"w13_lora": _expert_lora(H, 2 * INTER)} if target == "gate_up" else {"w2_lora": _expert_lora(INTER, H)}
    got, want = _both(x, w13, w2, weights, ids, idx, scaling, activation="swiglu_clamp", **lora, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_stacked_pairs_are_accepted():
    """(lora_a [L, E, R, K], lora_b [L, E, N, R]) pairs, as the earlier API took them."""
    x, w13, w2, weights, ids, kw = _inputs(9, True)
    idx = token_adapters(9, L)
    scaling = torch.rand(L) + 0.5
    got, want = _both(x, w13, w2, weights, ids, idx, scaling, activation="swiglu_clamp",
                      w13_lora=_stacked(H, 2 * INTER), w2_lora=_stacked(INTER, H), **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tables_with_the_looked_up_lora_config():
    """No config override: the LoRA config comes from the tuning lookup for the table's shape (default here)."""
    x, w13, w2, weights, ids, kw = _inputs(7, True)
    idx = token_adapters(7, L)
    scaling = torch.rand(L) + 0.5
    lora = dict(w13_lora=_expert_lora(H, 2 * INTER), w2_lora=_expert_lora(INTER, H))
    got = moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, config=BASE_CFG, activation="swiglu_clamp",
                           **lora, **kw)
    want = ref.moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, activation="swiglu_clamp", **lora, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_without_adapter_map_is_fused_moe():
    x, w13, w2, weights, ids, kw = _inputs(7, True)
    got = moe_experts_lora(x, w13, w2, weights, ids, None, torch.ones(L), w13_lora=_expert_lora(H, 2 * INTER),
                           activation="swiglu_clamp", config=BASE_CFG, **kw)
    want = reference.fused_moe(x, w13, w2, weights, ids, activation="swiglu_clamp", **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_every_token_in_one_slot_and_all_base_tokens():
    x, w13, w2, weights, ids, kw = _inputs(5, False)
    scaling = torch.rand(L) + 0.5
    lora = dict(w13_lora=_expert_lora(H, 2 * INTER), w2_lora=_expert_lora(INTER, H))
    for idx in (torch.full((5,), 2, dtype=torch.int32), torch.full((5,), -1, dtype=torch.int32)):
        got, want = _both(x, w13, w2, weights, ids, idx, scaling, **lora, **kw)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_one_lora_alignment_shared_when_tuned_block_sizes_differ(monkeypatch):
    """The LoRA tables are made once, with the gate_up config's BLOCK_M, in the base alignment's launch; the down
    call is run at that BLOCK_M even when its own tuned config says otherwise."""
    calls = []
    align, pair = mel.moe_align_lora, mel.moe_align_pair
    monkeypatch.setattr(mel, "moe_align_lora", lambda *a: calls.append(("lora", a[-1])) or align(*a))
    monkeypatch.setattr(mel, "moe_align_pair", lambda *a: calls.append(("pair", a[-2], a[-1])) or pair(*a))
    monkeypatch.setattr(mel, "lora_config", lambda y, x, lora_a, ids: {**LORA_CFG, "BLOCK_M": 16 if y.shape[1] ==
                                                                      2 * INTER else 32})
    x, w13, w2, weights, ids, kw = _inputs(11, False)
    idx = token_adapters(11, L)
    scaling = torch.rand(L) + 0.5
    lora = dict(w13_lora=_expert_lora(H, 2 * INTER), w2_lora=_expert_lora(INTER, H))
    got = moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, config=BASE_CFG, **lora, **kw)
    want = ref.moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, **lora, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert calls == [("pair", BASE_CFG["BLOCK_M"], 16)]


def test_bad_input_is_refused():
    x, w13, w2, weights, ids, kw = _inputs(3, False)
    idx, scaling = token_adapters(3, L), torch.ones(L)
    for fn in (moe_experts_lora, ref.moe_experts_lora):
        with pytest.raises(ValueError, match="unknown activation"):
            fn(x, w13, w2, weights, ids, idx, scaling, activation="gelu")
        with pytest.raises(ValueError, match="pass both w13_scale and w2_scale"):
            fn(x, w13, w2, weights, ids, idx, scaling, w13_scale=torch.ones(E, 2 * INTER))
        with pytest.raises(ValueError, match="need int8 weights"):
            fn(x, w13, w2, weights, ids, idx, scaling, w13_scale=torch.ones(E, 2 * INTER), w2_scale=torch.ones(E, H))
    with pytest.raises(ValueError, match="expected w13 \\[E, 2I, H\\]"):
        moe_experts_lora(x, w13, w2[:, :, :-1].contiguous(), weights, ids, idx, scaling)
