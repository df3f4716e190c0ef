"""benchmarks/kernels/check_gpu.py off the GPU. Every op it checks, and each check it adds, builds CUDA tensors or
captures CUDA graphs (the same cases run on the CPU in test_tuning_cases.py); here: its accounting, where a FAIL line
or a crashing check fails the run and the others go on, the kernel-cache count answering None for the interpreter's
kernels (the run prints "not inspectable" instead of a count), and that without a GPU it says so and exits."""
from __future__ import annotations

import pytest
import torch

from tests.utils.scripts import load_script

check = load_script("kernels", "check_gpu")


def test_fail_lines_and_crashes_fail_the_run_and_the_others_go_on(capsys):
    def crash():
        raise ValueError("no such kernel")

    failed: list[str] = []
    check._run_check("split-KV", lambda: ["ok   paged_attention rel_err=1.00e-03",
                                          "FAIL paged_attention padded rows zero=False"], failed)
    check._run_check("rope/route graph", crash, failed)
    check._run_check("copy_blocks/dispatch", lambda: ["ok   copy_blocks exact=True"], failed)
    assert failed == ["FAIL paged_attention padded rows zero=False", "rope/route graph"]
    assert capsys.readouterr().out.splitlines() == [
        "ok   paged_attention rel_err=1.00e-03", "FAIL paged_attention padded rows zero=False",
        "FAIL rope/route graph check crashed: ValueError: no such kernel", "ok   copy_blocks exact=True"]


def test_interpreted_kernels_have_no_inspectable_cache():
    from loraplex.kernels import fused_moe_lora, lora_shrink

    assert check.compiled_variants(lora_shrink._lora_shrink_kernel) is None
    assert check.compiled_variants(fused_moe_lora._moe_lora_fused_kernel) is None


def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="check_gpu.py needs a CUDA GPU"):
        check.main(["--m", "1"])
