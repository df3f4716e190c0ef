import pytest
import torch

from loraplex.kernels import reference_lora as ref
from loraplex.kernels.moe_align import moe_align, moe_align_lora
from tests.kernels.lora_inputs import token_adapters


def _routing(num_tokens, num_experts, top_k):
    """Distinct experts per token drawn from the first half only: the other experts receive no token."""
    scores = torch.rand(num_tokens, num_experts)
    scores[:, num_experts // 2:] = -1
    return torch.topk(scores, top_k, dim=-1).indices


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("block_size", [4, 16])
def test_moe_align_matches_reference(num_tokens, block_size):
    topk_ids = _routing(num_tokens, 8, 2)
    got = moe_align(topk_ids, 8, block_size)
    want = ref.moe_align(topk_ids, 8, block_size)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    n = int(got[2])
    assert n % block_size == 0 and n >= topk_ids.numel()
    assert sorted(got[0][got[0] < topk_ids.numel()].tolist()) == list(range(topk_ids.numel()))


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_moe_align_lora_matches_reference(num_tokens):
    topk_ids = _routing(num_tokens, 6, 2)
    lora = token_adapters(num_tokens, 3)
    got = moe_align_lora(topk_ids, lora, 6, 3, 4)
    want = ref.moe_align_lora(topk_ids, lora, 6, 3, 4)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # pairs of tokens without an adapter are in no slot's table
    no_adapter_pairs = {t * 2 + a for t in torch.where(lora < 0)[0].tolist() for a in range(2)}
    assert not no_adapter_pairs & set(got[0].flatten().tolist())


def test_moe_align_rejects_flat_ids():
    with pytest.raises(ValueError, match="topk_ids must be \\[T, A\\]"):
        moe_align(torch.zeros(4, dtype=torch.int64), 4, 4)
