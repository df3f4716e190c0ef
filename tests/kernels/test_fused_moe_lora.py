import pytest
import torch

from loraplex.kernels import reference_lora as ref
from loraplex.kernels.fused_moe_lora import fused_moe_lora
from tests.kernels.lora_inputs import padded_rank_mask, token_adapters

L, E, A, R = 3, 6, 2, 32
CONFIGS = [
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 1, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2, "GROUP_M": 1, "num_warps": 4, "num_stages": 1},
]


def _expert_lora(k, n):
    mask = padded_rank_mask(L, R)  # ranks 8 / 16 / 32 padded to 32
    lora_a = torch.randn(L, E, R, k) * mask[:, None, :, None] / k ** 0.5
    lora_b = torch.randn(L, E, n, R) * mask[:, None, None, :]
    return lora_a, lora_b, torch.rand(L) + 0.5


def _routing(num_tokens):
    scores = torch.rand(num_tokens, E)
    scores[:, 0] = -1  # expert 0 receives no token
    weights, ids = torch.topk(scores.softmax(-1), A, dim=-1)
    return weights, ids


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("target", ["gate_up", "down"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "split_k"])
def test_fused_moe_lora_matches_reference(num_tokens, target, cfg):
    k, n = (40, 48) if target == "gate_up" else (24, 40)  # K not a multiple of BLOCK_K
    lora_a, lora_b, scaling = _expert_lora(k, n)
    weights, ids = _routing(num_tokens)
    idx = token_adapters(num_tokens, L)
    x = torch.randn(num_tokens if target == "gate_up" else num_tokens * A, k)
    y = torch.randn(num_tokens * A, n)
    want = y.clone()
    topk_weights = weights if target == "down" else None
    fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, topk_weights, config=cfg)
    ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling, topk_weights)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    untouched = torch.where(idx < 0)[0]
    rows = torch.cat([untouched * A + a for a in range(A)])
    assert torch.equal(y[rows], want[rows])  # tokens without an adapter keep the base output


@pytest.mark.parametrize("partials_max_rows", [0, 1 << 20], ids=["atomics", "partials"])
def test_split_k_partials_and_atomics_agree_with_reference(monkeypatch, partials_max_rows):
    """Split-K either writes one partial buffer per split (expand sums them) or, past PARTIALS_MAX_ROWS pairs x
    splits, adds into one zeroed buffer with atomics; both give the reference. SPLIT_K=3 with K=40: the last
    split's K range is partly empty."""
    from loraplex.kernels import fused_moe_lora as fl

    monkeypatch.setattr(fl, "PARTIALS_MAX_ROWS", partials_max_rows)
    lora_a, lora_b, scaling = _expert_lora(40, 48)
    weights, ids = _routing(33)
    idx = token_adapters(33, L)
    x, y = torch.randn(33 * A, 40), torch.randn(33 * A, 48)
    want = y.clone()
    cfg = {**CONFIGS[1], "SPLIT_K": 3}
    fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, weights, config=cfg)
    ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling, weights)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_fused_moe_lora_rejects_bad_output():
    lora_a, lora_b, scaling = _expert_lora(16, 16)
    weights, ids = _routing(3)
    with pytest.raises(ValueError, match="y must be \\[T\\*A=6, N\\]"):
        fused_moe_lora(torch.randn(3, 16), torch.randn(3, 16), lora_a, lora_b, ids, token_adapters(3, L), scaling)


def test_fused_moe_lora_reuses_alignment_and_rejects_mismatched_block():
    from loraplex.kernels.moe_align import moe_align_lora

    lora_a, lora_b, scaling = _expert_lora(16, 16)
    weights, ids = _routing(5)
    idx = token_adapters(5, L)
    x, y = torch.randn(5, 16), torch.randn(10, 16)
    want = y.clone()
    cfg = CONFIGS[0]
    fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, config=cfg, align=moe_align_lora(ids, idx, E, L, 16))
    ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="made with block size 32 but the config's BLOCK_M is 16"):
        fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, config=cfg, align=moe_align_lora(ids, idx, E, L, 32))
