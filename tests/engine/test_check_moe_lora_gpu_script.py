"""benchmarks/engine/check_moe_lora_gpu.py off the GPU. Its timing and CUDA-graph half needs a GPU; its inputs and the
three paths it measures run on the CPU at tiny shapes (module constants shrunk; the ops dispatch to the torch
references there): the op under test, the per-expert loop it replaced and the base fused_moe each match the float32
reference within the script's tolerance, for bf16 and INT8 weights; the padded adapter ranks are zero past their
rank; the adapters move the output. Without a GPU the script says so and exits."""
from __future__ import annotations

import pytest
import torch

from tests.utils.scripts import load_script

check = load_script("engine", "check_moe_lora_gpu")
TOL = 1e-2  # the script's --tol default


@pytest.fixture()
def tiny(monkeypatch):
    for name, value in dict(E=4, A=2, H=64, I=32, L=3).items():
        monkeypatch.setattr(check, name, value)
    return check


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_measured_paths_match_the_reference_at_tiny_shapes(tiny, int8):
    dev = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    w = tiny.make_weights(dev, int8, gen)
    assert w["w13"].dtype == (torch.int8 if int8 else torch.bfloat16) and ("w13_scale" in w["kw"]) == int8
    for lora in (w["w13_lora"], w["w2_lora"]):  # slot l holds rank RANKS[l % 3], zero-padded to R
        a, b = lora
        assert a.shape[:3] == (tiny.L, tiny.E, tiny.R) and b.shape[-1] == tiny.R
        for slot in range(tiny.L):
            r = tiny.RANKS[slot % 3]
            assert a[slot, :, r:].abs().sum() == 0 and b[slot, ..., r:].abs().sum() == 0
            assert a[slot, :, :r].abs().amin(-1).gt(0).all()
    for m in (1, 5, 17):
        s = tiny.make_step(m, dev, gen)
        assert (s["idx"][::4] == -1).all() and s["x"].shape == (m, tiny.H)
        ref = tiny.reference(w, s)
        assert ref.shape == (m, tiny.H) and torch.isfinite(ref).all()
        assert tiny.rel_err(tiny.run_op(w, s), ref) <= TOL, m
        assert tiny.rel_err(tiny.run_loop(w, s), ref) <= TOL, m
        base = dict(s, idx=torch.full_like(s["idx"], -1))  # no adapter anywhere: the base layer
        assert tiny.rel_err(tiny.run_base(w, s), tiny.reference(w, base)) <= TOL, m
        if m > 1:  # token 0 has no adapter; the others do
            assert tiny.rel_err(tiny.run_base(w, s), ref) > 0.1, m


def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="check_moe_lora_gpu.py needs a CUDA GPU"):
        check.main([])
