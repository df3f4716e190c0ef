import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels.copy_blocks import copy_blocks
from loraplex.kernels.reshape_and_cache import reshape_and_cache


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_reshape_and_cache_matches_reference(num_tokens):
    nb, bs, kv, d = 12, 4, 2, 24
    key, value = torch.randn(num_tokens, kv, d), torch.randn(num_tokens, kv, d)
    slots = torch.randperm(nb * bs)[:num_tokens].to(torch.int32)
    slots[::3] = -1  # padding tokens are skipped
    caches = [torch.randn(nb, bs, kv, d) for _ in range(2)]
    want = [c.clone() for c in caches]
    reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference.reshape_and_cache(key, value, want[0], want[1], slots)
    torch.testing.assert_close(caches[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_all_layers_one_launch(dtype):
    layers, nb = 3, 10
    ks = [torch.randn(nb, 4, 2, 8).to(dtype) for _ in range(layers)]
    vs = [torch.randn(nb, 4, 2, 8).to(dtype) for _ in range(layers)]
    mapping = torch.tensor([[1, 7], [3, 0], [9, 4]], dtype=torch.int64)
    want_k, want_v = [k.clone() for k in ks], [v.clone() for v in vs]
    copy_blocks(ks, vs, mapping)
    reference.copy_blocks(want_k, want_v, mapping)
    for got, want in zip(ks + vs, want_k + want_v):
        assert torch.equal(got, want)


def test_copy_blocks_rejects_mixed_shapes():
    with pytest.raises(ValueError, match="one shape and dtype"):
        copy_blocks([torch.randn(4, 2, 1, 4)], [torch.randn(5, 2, 1, 4)], torch.tensor([[0, 1]]))
