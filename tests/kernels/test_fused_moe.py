import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels import reference_lora as ref
from loraplex.kernels.fused_moe import fused_moe
from loraplex.kernels.fused_moe_int8 import fused_moe_int8
from tests.utils.tuning_files import committed_configs, config_id

CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
E, A, H, INTER = 6, 2, 40, 24  # H, I not multiples of BLOCK_K


def _moe(num_tokens, with_bias):
    x = torch.randn(num_tokens, H)
    w13 = torch.randn(E, 2 * INTER, H) / H ** 0.5
    w2 = torch.randn(E, H, INTER) / INTER ** 0.5
    scores = torch.rand(num_tokens, E)
    scores[:, -2:] = -1  # the last two experts receive no token
    weights, ids = torch.topk(scores.softmax(-1), A, dim=-1)
    b13 = torch.randn(E, 2 * INTER) if with_bias else None
    b2 = torch.randn(E, H) if with_bias else None
    return x, w13, w2, weights, ids, b13, b2


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("activation,with_bias", [("silu", False), ("swiglu_clamp", True)])
def test_fused_moe_matches_reference(num_tokens, activation, with_bias):
    x, w13, w2, weights, ids, b13, b2 = _moe(num_tokens, with_bias)
    kw = dict(activation=activation, b13=b13, b2=b2, alpha=1.702, limit=7.0)
    got = fused_moe(x, w13, w2, weights, ids, config=CFG, **kw)
    want = reference.fused_moe(x, w13, w2, weights, ids, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 33])
@pytest.mark.parametrize("activation,with_bias", [("silu", False), ("swiglu_clamp", True)])
def test_fused_moe_int8_matches_reference(num_tokens, activation, with_bias):
    x, w13, w2, weights, ids, b13, b2 = _moe(num_tokens, with_bias)
    w13_q, w13_s = ref.quantize_int8_per_channel(w13)
    w2_q, w2_s = ref.quantize_int8_per_channel(w2)
    kw = dict(activation=activation, b13=b13, b2=b2)
    got = fused_moe_int8(x, w13_q, w13_s, w2_q, w2_s, weights, ids, config=CFG, **kw)
    want = ref.fused_moe_int8(x, w13_q, w13_s, w2_q, w2_s, weights, ids, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # and the quantised result stays near the full-precision one
    full = reference.fused_moe(x, w13, w2, weights, ids, **kw)
    assert (got - full).abs().max() < 0.05 * full.abs().max()


def test_fused_moe_default_config():
    x, w13, w2, weights, ids, _, _ = _moe(5, False)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids),
                               rtol=1e-4, atol=1e-4)


def test_fused_moe_rejects_bad_shapes():
    x, w13, w2, weights, ids, _, _ = _moe(3, False)
    with pytest.raises(ValueError, match="expected w13 \\[E, 2I, H\\]"):
        fused_moe(x, w13, w2[:, :, :-1].contiguous(), weights, ids)
    with pytest.raises(ValueError, match="unknown activation"):
        fused_moe(x, w13, w2, weights, ids, activation="gelu")


def test_fused_moe_int8_rejects_float_weights():
    x, w13, w2, weights, ids, _, _ = _moe(3, False)
    with pytest.raises(ValueError, match="needs int8 weights"):
        fused_moe_int8(x, w13, torch.ones(E, 2 * INTER), w2, torch.ones(E, H), weights, ids)


@pytest.mark.parametrize("op,cfg", [(op, c) for op in ("fused_moe", "fused_moe_int8")
                                    for c in committed_configs(op)], ids=config_id)
def test_committed_tuned_configs_match_the_reference(op, cfg):
    """Each config a device's tuning file holds (row tiles up to 128, 8 warps) gives the reference at H and I that
    are not multiples of its tiles."""
    x, w13, w2, weights, ids, b13, b2 = _moe(19, True)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    if op == "fused_moe":
        got = fused_moe(x, w13, w2, weights, ids, config=dict(cfg), **kw)
        want = reference.fused_moe(x, w13, w2, weights, ids, **kw)
    else:
        w13_q, w13_s = ref.quantize_int8_per_channel(w13)
        w2_q, w2_s = ref.quantize_int8_per_channel(w2)
        got = fused_moe_int8(x, w13_q, w13_s, w2_q, w2_s, weights, ids, config=dict(cfg), **kw)
        want = ref.fused_moe_int8(x, w13_q, w13_s, w2_q, w2_s, weights, ids, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
