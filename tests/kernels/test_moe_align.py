import pytest
import torch

from loraplex.kernels import reference_lora as ref
from loraplex.kernels.moe_align import moe_align, moe_align_lora, moe_align_pair
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


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns -777 everywhere: an output entry the kernel leaves unwritten shows up."""
    real_empty = torch.empty

    def empty(*shape, **kw):
        out = real_empty(*shape, **kw)
        return out.fill_(-777) if not out.dtype.is_floating_point else out.fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("num_tokens,top_k,block_size", [(1, 2, 16), (33, 2, 4), (700, 2, 16)])
def test_moe_align_lora_writes_every_entry(poisoned_empty, num_tokens, top_k, block_size):
    """One launch, no fills: padding, unused tail and empty slots are written by the kernel itself.
    700 tokens x top-2 spans two 1024-pair chunks (histogram and scatter loops, tail shared by programs)."""
    topk_ids = _routing(num_tokens, 6, top_k)
    lora = token_adapters(num_tokens, 3)
    lora[lora == 2] = 1  # slot 2 idle
    got = moe_align_lora(topk_ids, lora, 6, 3, block_size)
    want = ref.moe_align_lora(topk_ids, lora, 6, 3, block_size)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert int(got[2][2]) == 0 and (got[1][2] == -1).all()


def test_lora_segments_one_launch_matches_grouping(poisoned_empty):
    from loraplex.kernels.lora_shrink import lora_segments

    idx = token_adapters(1500, 5)
    order, start, length = lora_segments(idx, 5)
    for slot in range(5):
        toks = order[start[slot]:start[slot] + length[slot]].tolist()
        assert toks == torch.where(idx == slot)[0].tolist()
    assert int(length.sum()) == int((idx >= 0).sum())
    assert (order[int(length.sum()):] == 1500).all()  # past the segments: the "no pair" marker


@pytest.mark.parametrize("num_tokens,block_size", [(1, 16), (33, 4), (1100, 16)])
def test_moe_align_lora_idle_slots_of_a_wide_table(poisoned_empty, num_tokens, block_size):
    """A decode graph's table holds a slot per batch row, most of them idle: tokens use 3 scattered slots of 37
    (1100 tokens: the token scan that finds idle slots spans two chunks; the last used slot appears only in the
    second), and idle slots' rows are still written in full."""
    topk_ids = _routing(num_tokens, 6, 2)
    lora = torch.tensor([5, 36, -1], dtype=torch.int32).repeat(num_tokens // 3 + 1)[:num_tokens]
    if num_tokens > 1024:
        lora[:1024] = torch.where(lora[:1024] == 36, 5, lora[:1024])
        lora[-1] = 20
    got = moe_align_lora(topk_ids, lora, 6, 37, block_size)
    want = ref.moe_align_lora(topk_ids, lora, 6, 37, block_size)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    used = {int(v) for v in lora.unique() if v >= 0}
    assert {i for i in range(37) if int(got[2][i]) > 0} == used


@pytest.mark.parametrize("num_tokens,top_k,block_size,lora_block_size", [(1, 2, 16, 16), (33, 3, 4, 16), (19, 2, 64, 4),
                                                                          (700, 2, 16, 8)])
def test_moe_align_pair_is_both_alignments_in_one_launch(poisoned_empty, num_tokens, top_k, block_size,
                                                         lora_block_size):
    """The base tables at one block size and the LoRA tables at another, from one launch, equal the two
    references entry for entry (every entry written: torch.empty is poisoned), an idle slot's row included."""
    topk_ids = _routing(num_tokens, 7, top_k)
    lora = token_adapters(num_tokens, 4)
    lora[lora == 3] = 0  # slot 3 idle
    base, lora_tables = moe_align_pair(topk_ids, lora, 7, 4, block_size, lora_block_size)
    for got, want in ((base, ref.moe_align(topk_ids, 7, block_size)),
                      (lora_tables, ref.moe_align_lora(topk_ids, lora, 7, 4, lora_block_size))):
        assert len(got) == len(want) == 3
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w)
    assert int(lora_tables[2][3]) == 0 and (lora_tables[1][3] == -1).all()


def test_moe_align_pair_without_pairs():
    topk_ids = torch.zeros(0, 2, dtype=torch.int64)
    lora = torch.zeros(0, dtype=torch.int32)
    base, lora_tables = moe_align_pair(topk_ids, lora, 5, 3, 16, 4)
    want_base, want_lora = ref.moe_align(topk_ids, 5, 16), ref.moe_align_lora(topk_ids, lora, 5, 3, 4)
    for got, want in ((base, want_base), (lora_tables, want_lora)):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
