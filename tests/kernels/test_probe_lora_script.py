"""benchmarks/kernels/probe_lora.py off the GPU. Its timings need CUDA (graph replay and the CUDA profiler); what it
picks does not: every op it probes is a case ``tunable_cases`` builds at its adapter count and rank (a renamed label
would leave its table silently empty), and those cases run. Without a GPU the script says so and exits."""
from __future__ import annotations

import pytest
import torch

from loraplex.kernels.tuning_cases import ModelShapes, tunable_cases
from tests.utils.scripts import load_script

probe = load_script("kernels", "probe_lora")
TINY = ModelShapes("tiny", hidden=32, num_experts=4, top_k=2, moe_intermediate=16, num_heads=4, num_kv_heads=2,
                   head_dim=16, activation="swiglu_clamp", expert_bias=True)


def test_every_probed_op_is_a_tunable_case():
    cases = {c.label: c for c in tunable_cases(TINY, 3, 8, 32, torch.float32, "cpu")}
    assert set(probe.OPS) <= set(cases), sorted(cases)
    for label in probe.OPS:  # probe_lora times case.run(None): the tuned (here: default) config
        assert cases[label].check(None) <= 1e-4, label


def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="probe_lora.py needs a CUDA GPU"):
        probe.main(["--m", "1"])
