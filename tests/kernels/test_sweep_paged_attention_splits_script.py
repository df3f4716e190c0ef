"""benchmarks/kernels/sweep_paged_attention_splits.py is GPU-only through and through (CUDA tensors at fixed GPT-OSS
sizes, CUDA-graph timing; the kernel's split paths are checked on the CPU in test_paged_attention.py): without a
GPU it says so and exits instead of failing in the first allocation."""
from __future__ import annotations

import pytest
import torch

from tests.utils.scripts import load_script


def test_without_a_gpu_it_says_so(monkeypatch):
    sweep = load_script("kernels", "sweep_paged_attention_splits")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="sweep_paged_attention_splits.py needs a CUDA GPU"):
        sweep.main()
