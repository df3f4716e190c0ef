import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels.activation import silu_and_mul, swiglu_clamp_and_mul
from loraplex.kernels.rms_norm import rms_norm


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("hidden", [64, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(m, hidden, with_residual):
    x = torch.randn(m, hidden)
    w = torch.randn(hidden)
    res = torch.randn(m, hidden) if with_residual else None
    got = rms_norm(x, w, 1e-6, res)
    want = reference.rms_norm(x, w, 1e-6, res)
    if with_residual:
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1])
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rms_norm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight \\[H\\]"):
        rms_norm(torch.randn(2, 8), torch.randn(4), 1e-6)


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("inter", [16, 90])
def test_gated_activations_match_reference(m, inter):
    x = torch.randn(m, 2 * inter) * 4  # reaches past the clamp limit
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(swiglu_clamp_and_mul(x, 1.702, 7.0), reference.swiglu_clamp_and_mul(x, 1.702, 7.0),
                               rtol=1e-5, atol=1e-5)


def test_activation_rejects_odd_width():
    with pytest.raises(ValueError, match="x \\[T, 2I\\]"):
        silu_and_mul(torch.randn(3, 5))
