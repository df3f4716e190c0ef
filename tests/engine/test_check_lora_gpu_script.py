"""benchmarks/engine/check_lora_gpu.py with ``--device cpu``: four PEFT adapters and base requests mixed in one engine
give PEFT's greedy tokens, with logits within the tolerance, on a dense and a MoE family (PASS, exit 0); the same
run against a tolerance below float32 rounding fails and exits 1."""
from __future__ import annotations

import re

import pytest
import torch

from tests.utils.scripts import load_script

check = load_script("engine", "check_lora_gpu")
LINE = re.compile(r"^(\w+) +tokens (\d+)/(\d+) requests are PEFT's greedy  worst rel logits err (\S+)  (PASS|FAIL)")


def _run(capsys, *argv: str) -> tuple[int, list[tuple]]:
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        with pytest.raises(SystemExit) as exit_:
            check.main(["--device", "cpu", "--prompts", "1", "--new-tokens", "4", *argv])
    finally:  # the script turns tf32 off for the process
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out = capsys.readouterr().out
    assert out.startswith("kernels=") and "device=cpu" in out.splitlines()[0]
    return exit_.value.code, [m.groups() for m in map(LINE.match, out.splitlines()) if m]


def test_adapters_match_peft_on_a_dense_and_a_moe_family(capsys):
    code, rows = _run(capsys, "--families", "llama,qwen3_moe")
    assert code == 0 and [r[0] for r in rows] == ["llama", "qwen3_moe"]
    for family, agree, total, worst, verdict in rows:
        assert int(agree) == int(total) == len(check.ADAPTERS) + 1 and verdict == "PASS", family
        assert 0 < float(worst) <= 1e-4


def test_a_miss_fails_the_run(capsys):
    code, rows = _run(capsys, "--families", "llama", "--tol", "1e-12")
    assert code == 1 and len(rows) == 1 and rows[0][4] == "FAIL" and float(rows[0][3]) > 1e-12
