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
