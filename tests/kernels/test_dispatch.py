import inspect

import pytest
import torch

from loraplex.kernels import dispatch, ops, reference, reference_lora


def _reference_of(name):
    return getattr(reference, name, None) or getattr(reference_lora, name)


@pytest.mark.parametrize("name", sorted(dispatch.TRITON_LAUNCHERS))
def test_every_launcher_imports_and_matches_its_reference_signature(name):
    launcher = dispatch._load_launcher(name)
    assert launcher is not None, f"{dispatch.TRITON_LAUNCHERS[name]} failed to import"
    ref_params = list(inspect.signature(_reference_of(name)).parameters.values())
    params = list(inspect.signature(launcher).parameters.values())
    assert [p.name for p in params[:len(ref_params)]] == [p.name for p in ref_params]
    assert all(p.kind == p.KEYWORD_ONLY and p.default is not p.empty for p in params[len(ref_params):]), \
        "extra launcher parameters must be optional keywords"


def test_cpu_ops_use_references():
    x = torch.randn(3, 8)
    idx = torch.tensor([0, -1, 1], dtype=torch.int32)
    lora_a = torch.randn(1, 2, 4, 8)
    assert torch.equal(ops.lora_shrink(x, lora_a, idx, torch.ones(2)),
                       reference_lora.lora_shrink(x, lora_a, idx, torch.ones(2)))
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]])
    assert all(torch.equal(a, b) for a, b in zip(ops.moe_align(ids, 3, 4), reference_lora.moe_align(ids, 3, 4)))


def test_step_segments_pass_through_ops(monkeypatch):
    """``ops.lora_segments`` once per step, handed to shrink and expand: None (ignored) on the references; the
    Triton launchers take it (forced here for CPU tensors through the interpreter)."""
    x, y = torch.randn(7, 16), torch.randn(7, 24)
    idx = torch.tensor([1, -1, 0, 1, 2, -1, 0], dtype=torch.int32)
    lora_a, lora_b, scaling = torch.randn(2, 3, 16, 16), torch.randn(3, 24, 16), torch.rand(3) + 0.5
    want = y.clone()
    reference_lora.lora_expand(want, reference_lora.lora_shrink(x, lora_a, idx, scaling), lora_b, idx, (12, 12))
    assert ops.lora_segments(idx, 3) is None
    got = y.clone()
    ops.lora_expand(got, ops.lora_shrink(x, lora_a, idx, scaling, segments=None), lora_b, idx, (12, 12))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(ops, "resolve", lambda name, t: dispatch._load_launcher(name))
    segments = ops.lora_segments(idx, 3)
    assert segments is not None and segments[2].tolist() == [2, 2, 1]
    got = y.clone()
    ops.lora_expand(got, ops.lora_shrink(x, lora_a, idx, scaling, segments=segments), lora_b, idx, (12, 12),
                    segments=segments)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
