"""The COMPACT variant of lora_shrink / lora_expand (a smaller 1-D grid walking the used work items) against the
torch references and the plain grid, under the interpreter: a table much wider than the slots the batch uses (a
decode graph's), empty slots, slices an adapter does not target, base rows (-1), ranks 8 / 16 / 32 mixed,
M = 1, 33, 128, and grids so small that every program walks several items."""
import pytest
import torch

from loraplex.kernels import reference_lora as ref
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_shrink import lora_segments, lora_shrink
from tests.kernels.lora_inputs import dense_table

L = 40  # table slots; the batch uses at most USED of them
USED = 7  # slots 0..6: ranks 8, 16, 32, ...; slot 3 empty; slot 1 does not target slice 1
SHRINK = {"BLOCK_M": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
EXPAND = {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


def _inputs(num_tokens: int, k: int, widths: tuple[int, ...], seed: int):
    gen = torch.Generator().manual_seed(seed)
    table = dense_table(L, k, widths, empty=(3,), untargeted=((1, min(1, len(widths) - 1)),))
    idx = torch.randint(0, USED, (num_tokens,), generator=gen, dtype=torch.int32)
    idx[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # base rows
    idx[0] = 2  # at least one row with an adapter
    x = torch.randn(num_tokens, k, generator=gen)
    scaling = torch.rand(L, generator=gen) + 0.5
    return table, idx, x, scaling


@pytest.mark.parametrize("num_tokens", [1, 33, 128])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("compact", [0, 3, 64])  # 64: fewer programs than items, each walks several
def test_compact_shrink_matches_reference(num_tokens, split_k, compact):
    table, idx, x, scaling = _inputs(num_tokens, 72, (16, 8, 8), seed=num_tokens * 7 + split_k)
    cfg = {**SHRINK, "SPLIT_K": split_k, "COMPACT": compact}
    got = lora_shrink(x, table, idx, scaling, config=cfg)
    want = ref.lora_shrink(x, table, idx, scaling)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.all(got[:, idx < 0] == 0)
    assert torch.all(got[:, idx == 3] == 0) and torch.all(got[1, idx == 1] == 0)  # empty slot, untargeted slice
    assert got[:, idx >= 0].abs().sum() > 0


@pytest.mark.parametrize("num_tokens", [1, 33, 128])
@pytest.mark.parametrize("slices", [(40,), (48, 16, 8)], ids=["one", "qkv"])
@pytest.mark.parametrize("compact", [0, 1, 64])
def test_compact_expand_matches_reference(num_tokens, slices, compact):
    table, idx, _, _ = _inputs(num_tokens, 8, slices, seed=num_tokens * 11 + len(slices))
    gen = torch.Generator().manual_seed(num_tokens)
    buf = torch.randn(len(slices), num_tokens, 32, generator=gen)
    y = torch.randn(num_tokens, sum(slices), generator=gen)
    y0, want = y.clone(), y.clone()
    lora_expand(y, buf, table, idx, slices, config={**EXPAND, "COMPACT": compact, "PDL": 1})
    ref.lora_expand(want, buf, table, idx, slices)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    lit = (idx == 0) | (idx == 2)  # slots targeting every slice
    assert torch.all((y[lit] != y0[lit]).any(dim=1))
    torch.testing.assert_close(y[idx < 0], y0[idx < 0], rtol=0, atol=0)


@pytest.mark.parametrize("num_tokens", [1, 33, 128])
def test_compact_and_plain_grids_agree_through_shared_segments(num_tokens):
    """The engine's path (segments computed once, shrink then expand) gives the same y with COMPACT 0 and 2."""
    slices = (48, 16, 16)
    table, idx, x, scaling = _inputs(num_tokens, 40, slices, seed=num_tokens)
    y0 = torch.randn(num_tokens, sum(slices))
    seg = lora_segments(idx, L)
    outs = []
    for compact in (0, 2):
        y = y0.clone()
        buf = lora_shrink(x, table, idx, scaling, segments=seg, config={**SHRINK, "SPLIT_K": 2, "COMPACT": compact})
        lora_expand(y, buf, table, idx, slices, segments=seg, config={**EXPAND, "COMPACT": compact})
        outs.append(y)
    want = y0.clone()
    ref.lora_expand(want, ref.lora_shrink(x, table, idx, scaling), table, idx, slices)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(outs[1][idx >= 0], y0[idx >= 0])  # the adapters changed their rows
    torch.testing.assert_close(outs[1][idx < 0], y0[idx < 0], rtol=0, atol=0)  # base rows untouched


def test_compact_with_no_adapter_rows_changes_nothing():
    table, _, x, scaling = _inputs(9, 40, (24, 24), seed=3)
    idx = torch.full((9,), -1, dtype=torch.int32)
    y = torch.randn(9, 48)
    want = y.clone()
    buf = lora_shrink(x, table, idx, scaling, config={**SHRINK, "SPLIT_K": 1, "COMPACT": 4})
    assert torch.all(buf == 0)
    lora_expand(y, buf, table, idx, (24, 24), config={**EXPAND, "COMPACT": 4})
    torch.testing.assert_close(y, want, rtol=0, atol=0)


@pytest.mark.parametrize("num_tokens", [1, 77])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("widths", [(16, 8, 8), (40,), (8, 16)], ids=["qkv", "one", "two"])
def test_fused_slices_shrink_matches_reference(num_tokens, split_k, widths):
    """FUSE_SLICES (every slice of a token block in one program, x read once): the reference at every slice
    count, ranks mixed across slots, an empty slot, a slice an adapter does not target, base rows, split-K."""
    table, idx, x, scaling = _inputs(num_tokens, 72, widths, seed=num_tokens * 5 + split_k + len(widths))
    cfg = {**SHRINK, "SPLIT_K": split_k, "FUSE_SLICES": 1}
    got = lora_shrink(x, table, idx, scaling, config=cfg)
    want = ref.lora_shrink(x, table, idx, scaling)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.all(got[:, idx < 0] == 0) and torch.all(got[:, idx == 3] == 0)
    if len(widths) > 1:
        assert torch.all(got[1, idx == 1] == 0)  # slot 1 does not target slice 1
    assert got[:, idx >= 0].abs().sum() > 0


def test_fused_slices_and_compact_are_refused_together():
    table, idx, x, scaling = _inputs(4, 72, (16, 8, 8), seed=1)
    with pytest.raises(ValueError, match="FUSE_SLICES and COMPACT"):
        lora_shrink(x, table, idx, scaling, config={**SHRINK, "SPLIT_K": 1, "FUSE_SLICES": 1, "COMPACT": 2})
