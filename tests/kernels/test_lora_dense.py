"""Dense multi-LoRA (shrink, expand, the fused shrink+expand) in Triton under the interpreter against the torch
references: adapters of ranks 8 / 16 / 32 in one batch, each read at its own rank through a LoRATable; empty
slots, slices an adapter does not target, tokens without an adapter; the stacked padded layout as input."""
import pytest
import torch

from loraplex.kernels import reference_lora as ref
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_shrink import lora_segments, lora_shrink
from loraplex.kernels.lora_shrink_expand import lora_shrink_expand
from loraplex.kernels.lora_table import LoRATable
from tests.kernels.lora_inputs import dense_lora, dense_table, token_adapters
from tests.utils.tuning_files import committed_configs, config_id

SHRINK_CONFIGS = [
    {"BLOCK_M": 16, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1},
    {"BLOCK_M": 16, "BLOCK_K": 16, "SPLIT_K": 3, "num_warps": 4, "num_stages": 1},  # split-K, atomics
]
L = 5  # slots: ranks 8, 16, 32, 8, 16; slot 3 empty; slot 1 does not target slice 1


def _table(k, widths):
    return dense_table(L, k, widths, empty=(3,), untargeted=((1, min(1, len(widths) - 1)),))


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("k", [64, 72])  # 72: K not a multiple of BLOCK_K
@pytest.mark.parametrize("cfg", SHRINK_CONFIGS, ids=["plain", "split_k"])
def test_lora_shrink_matches_reference(num_tokens, k, cfg):
    table = _table(k, (8, 8, 8))
    x = torch.randn(num_tokens, k)
    idx = token_adapters(num_tokens, L)
    scaling = torch.rand(L) + 0.5
    got = lora_shrink(x, table, idx, scaling, config=cfg)
    want = ref.lora_shrink(x, table, idx, scaling)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.all(got[:, idx < 0] == 0)
    assert torch.all(got[:, idx == 0, 8:] == 0)  # rank 8: the columns past its rank stay zero
    assert torch.all(got[:, idx == 3] == 0) and torch.all(got[1, idx == 1] == 0)  # empty slot, untargeted slice


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("slices", [(40,), (48, 16, 16), (24, 24)], ids=["one", "qkv", "gate_up"])
@pytest.mark.parametrize("pdl", [0, 1])  # PDL asked for: a plain launch under the interpreter, same result
def test_lora_expand_adds_into_base_output(num_tokens, slices, pdl):
    n = sum(slices)
    table = _table(8, slices)
    buf = torch.randn(len(slices), num_tokens, 32)
    idx = token_adapters(num_tokens, L)
    y = torch.randn(num_tokens, n)
    want = y.clone()
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1, "PDL": pdl}
    lora_expand(y, buf, table, idx, slices, config=cfg)
    ref.lora_expand(want, buf, table, idx, slices)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_shrink_then_expand_default_config():
    # fp32 only: the interpreter's bf16 tl.dot is wrong (triton 3.9); bf16 is checked on the GPU.
    table = _table(40, (24, 24))
    x = torch.randn(9, 40)
    idx = token_adapters(9, L)
    scaling = torch.rand(L) + 0.5
    y = torch.randn(9, 48)
    want = y.clone()
    lora_expand(y, lora_shrink(x, table, idx, scaling), table, idx, (24, 24))
    ref.lora_expand(want, ref.lora_shrink(x, table, idx, scaling), table, idx, (24, 24))
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-4, atol=1e-4)


def test_table_equals_the_low_rank_formula_per_adapter():
    """Each token gets exactly x @ A_l.T @ B_l.T of its own adapter at its own rank (the reference is checked
    too, not only the kernel against it)."""
    table = _table(24, (16, 8))
    x = torch.randn(12, 24)
    idx = torch.tensor([0, 1, 2, 4, -1, 3, 0, 2, 1, 4, 2, 0], dtype=torch.int32)
    y = torch.zeros(12, 24)
    lora_expand(y, lora_shrink(x, table, idx, torch.ones(L)), table, idx, (16, 8))
    for t, l in enumerate(idx.tolist()):
        want = torch.zeros(24)
        for s, (off, w) in enumerate(((0, 16), (16, 8))):
            f = table.lookup(l, s) if l >= 0 else None
            if f is not None:
                want[off:off + w] = f[1] @ (f[0] @ x[t])
        torch.testing.assert_close(y[t], want, rtol=1e-4, atol=1e-4)


def test_lora_segments_group_tokens_by_slot():
    idx = torch.tensor([2, -1, 0, 2, -1, 1, 2], dtype=torch.int32)
    order, start, length = lora_segments(idx, 4)
    assert length.tolist() == [1, 1, 3, 0]
    assert start.tolist() == [0, 1, 2, 5]
    assert order[:5].tolist() == [2, 5, 0, 3, 6]


def test_segments_computed_once_serve_shrink_and_expand():
    table = _table(24, (16, 16, 8))
    x, y = torch.randn(33, 24), torch.randn(33, 40)
    idx = token_adapters(33, L)
    scaling = torch.rand(L) + 0.5
    segments = lora_segments(idx, L)
    want = y.clone()
    lora_expand(y, lora_shrink(x, table, idx, scaling, segments=segments), table, idx, (16, 16, 8),
                segments=segments)
    ref.lora_expand(want, ref.lora_shrink(x, table, idx, scaling), table, idx, (16, 16, 8))
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_lora_expand_rejects_mismatched_slices():
    with pytest.raises(ValueError, match="output_slices sum to 10"):
        lora_expand(torch.randn(2, 12), torch.randn(1, 2, 16), torch.randn(2, 12, 16), torch.zeros(2), (10,))
    table = _table(8, (8, 4))
    with pytest.raises(ValueError, match=r"widths \(8, 4\)"):
        lora_expand(torch.randn(2, 12), torch.randn(2, 2, 32), table, torch.zeros(2), (6, 6))


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("slices", [(40,), (48, 16, 16)], ids=["one", "qkv"])
def test_fused_shrink_expand_matches_reference(num_tokens, slices):
    table = _table(72, slices)  # K=72: ragged last K block
    x, y = torch.randn(num_tokens, 72), torch.randn(num_tokens, sum(slices))
    idx = token_adapters(num_tokens, L)
    scaling = torch.rand(L) + 0.5
    want = y.clone()
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    lora_shrink_expand(y, x, table, None, idx, scaling, slices, config=cfg)
    ref.lora_shrink_expand(want, x, table, None, idx, scaling, slices)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_flat_token_blocks_cross_slot_boundaries():
    """Token blocks of all slots in one grid dim: skewed slots (one idle, one spanning many blocks) with small
    blocks, so programs land in every slot and just past the used blocks."""
    idx = torch.tensor([1] * 50 + [4] * 15 + [2] * 5 + [-1] * 6, dtype=torch.int32)[torch.randperm(76)]
    table = _table(40, (24, 24))
    scaling = torch.rand(L) + 0.5
    x, y = torch.randn(76, 40), torch.randn(76, 48)
    shrink_cfg = {"BLOCK_M": 4, "BLOCK_K": 16, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1}
    expand_cfg = {"BLOCK_M": 4, "BLOCK_N": 16, "GROUP_M": 3, "num_warps": 4, "num_stages": 1}
    want = y.clone()
    ref.lora_expand(want, ref.lora_shrink(x, table, idx, scaling), table, idx, (24, 24))
    got = y.clone()
    lora_expand(got, lora_shrink(x, table, idx, scaling, config=shrink_cfg), table, idx, (24, 24),
                config=expand_cfg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    fused = y.clone()
    lora_shrink_expand(fused, x, table, None, idx, scaling, (24, 24),
                       config={"BLOCK_M": 4, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1})
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-4)


def test_stacked_padded_layout_is_the_table_at_full_rank():
    """The stacked [S, L, R, K] / [L, N, R] tensors (zero-padded) give the result of the same adapters at their
    own ranks, through both the kernels and the references."""
    lora_a, lora_b, scaling = dense_lora(2, 3, 32, 40, 48)
    stacked = LoRATable.from_stacked(lora_a, lora_b, output_slices=(24, 24))
    assert stacked.entries[:, :, 2].unique().tolist() == [32]
    ranks = (8, 16, 32)
    own = LoRATable.from_factors(
        [[(lora_a[s, l, :ranks[l]].contiguous(), lora_b[l, s * 24:(s + 1) * 24, :ranks[l]].contiguous())
          for s in range(2)] for l in range(3)], in_features=40, out_features=(24, 24), max_rank=32)
    x, y = torch.randn(9, 40), torch.randn(9, 48)
    idx = token_adapters(9, 3)
    got_stacked, got_own, want = y.clone(), y.clone(), y.clone()
    lora_expand(got_stacked, lora_shrink(x, lora_a, idx, scaling), lora_b, idx, (24, 24))
    lora_expand(got_own, lora_shrink(x, own, idx, scaling), own, idx, (24, 24))
    ref.lora_expand(want, ref.lora_shrink(x, lora_a, idx, scaling), lora_b, idx, (24, 24))
    torch.testing.assert_close(got_stacked, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_own, want, rtol=1e-4, atol=1e-4)


def test_factors_off_a_16_byte_boundary_are_refused():
    """The kernels read factors with vector loads, so a table only takes factors starting on 16-byte boundaries."""
    storage = torch.randn(8 * 40 + 1)
    a = storage[1:].view(8, 40)  # 4 bytes past an aligned start
    with pytest.raises(ValueError, match="16-byte boundary"):
        LoRATable.from_factors([[(a, torch.randn(16, 8))]], in_features=40, out_features=(16,))
    lora_a = torch.randn(1, 2, 3, 5)  # a slot stride of 60 bytes
    with pytest.raises(ValueError, match="16-byte boundary"):
        LoRATable.from_stacked(lora_a, None, output_slices=(4,))


@pytest.mark.parametrize("op,cfg", [(op, c) for op in ("lora_shrink", "lora_expand", "lora_shrink_expand")
                                    for c in committed_configs(op)], ids=config_id)
def test_committed_tuned_configs_match_the_reference(op, cfg):
    """Each config a device's tuning file holds (split-K, column groups, compact slot blocks, PDL) gives the reference
    at K = 72 and qkv slices (48, 16, 16), neither a multiple of its tiles."""
    slices = (48, 16, 16)
    table = _table(72, slices)
    x, y = torch.randn(19, 72), torch.randn(19, sum(slices))
    idx = token_adapters(19, L)
    scaling = torch.rand(L) + 0.5
    want = y.clone()
    if op == "lora_shrink":
        torch.testing.assert_close(lora_shrink(x, table, idx, scaling, config=dict(cfg)),
                                   ref.lora_shrink(x, table, idx, scaling), rtol=1e-4, atol=1e-4)
        return
    if op == "lora_expand":
        buf = ref.lora_shrink(x, table, idx, scaling)
        lora_expand(y, buf, table, idx, slices, config=dict(cfg))
        ref.lora_expand(want, buf, table, idx, slices)
    else:
        lora_shrink_expand(y, x, table, None, idx, scaling, slices, config=dict(cfg))
        ref.lora_shrink_expand(want, x, table, None, idx, scaling, slices)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
