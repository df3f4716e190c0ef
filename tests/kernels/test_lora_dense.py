import pytest
import torch

from loraplex.kernels import reference_lora as ref
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_shrink import lora_segments, lora_shrink
from tests.kernels.lora_inputs import dense_lora, token_adapters

SHRINK_CONFIGS = [
    {"BLOCK_M": 16, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1},
    {"BLOCK_M": 16, "BLOCK_K": 16, "SPLIT_K": 3, "num_warps": 4, "num_stages": 1},  # split-K, atomics
]


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("k", [64, 72])  # 72: K not a multiple of BLOCK_K
@pytest.mark.parametrize("cfg", SHRINK_CONFIGS, ids=["plain", "split_k"])
def test_lora_shrink_matches_reference(num_tokens, k, cfg):
    lora_a, _, scaling = dense_lora(3, 4, 32, k, 8)
    x = torch.randn(num_tokens, k)
    idx = token_adapters(num_tokens, 4)
    got = lora_shrink(x, lora_a, idx, scaling, config=cfg)
    want = ref.lora_shrink(x, lora_a, idx, scaling)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.all(got[:, idx < 0] == 0)


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("slices", [(40,), (48, 16, 16), (24, 24)], ids=["one", "qkv", "gate_up"])
@pytest.mark.parametrize("pdl", [0, 1])  # PDL asked for: a plain launch under the interpreter, same result
def test_lora_expand_adds_into_base_output(num_tokens, slices, pdl):
    n = sum(slices)
    _, lora_b, _ = dense_lora(len(slices), 4, 32, 8, n)
    buf = torch.randn(len(slices), num_tokens, 32)
    idx = token_adapters(num_tokens, 4)
    y = torch.randn(num_tokens, n)
    want = y.clone()
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1, "PDL": pdl}
    lora_expand(y, buf, lora_b, idx, slices, config=cfg)
    ref.lora_expand(want, buf, lora_b, idx, slices)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_shrink_then_expand_default_config():
    # fp32 only: the interpreter's bf16 tl.dot is wrong (triton 3.9); bf16 is checked on the GPU.
    lora_a, lora_b, scaling = dense_lora(2, 3, 32, 40, 48)
    x = torch.randn(9, 40)
    idx = token_adapters(9, 3)
    y = torch.randn(9, 48)
    want = y.clone()
    lora_expand(y, lora_shrink(x, lora_a, idx, scaling), lora_b, idx, (24, 24))
    ref.lora_expand(want, ref.lora_shrink(x, lora_a, idx, scaling), lora_b, idx, (24, 24))
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-4, atol=1e-4)


def test_lora_segments_group_tokens_by_slot():
    idx = torch.tensor([2, -1, 0, 2, -1, 1, 2], dtype=torch.int32)
    order, start, length = lora_segments(idx, 4)
    assert length.tolist() == [1, 1, 3, 0]
    assert start.tolist() == [0, 1, 2, 5]
    assert order[:5].tolist() == [2, 5, 0, 3, 6]


def test_segments_computed_once_serve_shrink_and_expand():
    lora_a, lora_b, scaling = dense_lora(3, 4, 16, 24, 40)
    x, y = torch.randn(33, 24), torch.randn(33, 40)
    idx = token_adapters(33, 4)
    segments = lora_segments(idx, 4)
    want = y.clone()
    lora_expand(y, lora_shrink(x, lora_a, idx, scaling, segments=segments), lora_b, idx, (16, 16, 8),
                segments=segments)
    ref.lora_expand(want, ref.lora_shrink(x, lora_a, idx, scaling), lora_b, idx, (16, 16, 8))
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_lora_expand_rejects_mismatched_slices():
    with pytest.raises(ValueError, match="output_slices sum to 10"):
        lora_expand(torch.randn(2, 12), torch.randn(1, 2, 16), torch.randn(2, 12, 16), torch.zeros(2), (10,))


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("slices", [(40,), (48, 16, 16)], ids=["one", "qkv"])
def test_fused_shrink_expand_matches_reference(num_tokens, slices):
    from loraplex.kernels.lora_shrink_expand import lora_shrink_expand

    lora_a, lora_b, scaling = dense_lora(len(slices), 4, 32, 72, sum(slices))  # K=72: ragged last K block
    x, y = torch.randn(num_tokens, 72), torch.randn(num_tokens, sum(slices))
    idx = token_adapters(num_tokens, 4)
    want = y.clone()
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    lora_shrink_expand(y, x, lora_a, lora_b, idx, scaling, slices, config=cfg)
    ref.lora_shrink_expand(want, x, lora_a, lora_b, idx, scaling, slices)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_flat_token_blocks_cross_slot_boundaries():
    """Token blocks of all slots in one grid dim: skewed slots (one idle, one spanning many blocks) with small
    blocks, so programs land in every slot and just past the used blocks."""
    from loraplex.kernels.lora_shrink_expand import lora_shrink_expand

    idx = torch.tensor([1] * 50 + [3] * 15 + [2] * 5 + [-1] * 6, dtype=torch.int32)[torch.randperm(76)]
    lora_a, lora_b, scaling = dense_lora(2, 4, 16, 40, 48)
    x, y = torch.randn(76, 40), torch.randn(76, 48)
    shrink_cfg = {"BLOCK_M": 4, "BLOCK_K": 16, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1}
    expand_cfg = {"BLOCK_M": 4, "BLOCK_N": 16, "GROUP_M": 3, "num_warps": 4, "num_stages": 1}
    want = y.clone()
    ref.lora_expand(want, ref.lora_shrink(x, lora_a, idx, scaling), lora_b, idx, (24, 24))
    got = y.clone()
    lora_expand(got, lora_shrink(x, lora_a, idx, scaling, config=shrink_cfg), lora_b, idx, (24, 24),
                config=expand_cfg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    fused = y.clone()
    lora_shrink_expand(fused, x, lora_a, lora_b, idx, scaling, (24, 24),
                       config={"BLOCK_M": 4, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1})
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-4)
