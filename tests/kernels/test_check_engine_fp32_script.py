"""benchmarks/kernels/check_engine_fp32.py on the CPU through the Triton interpreter: the engine's CUDA path (every
Triton launcher the model calls, the fused rope + KV-cache write and the expert kernels included) gives
transformers' greedy tokens for a tiny GPT-OSS checkpoint, chunked prefill mixed with decodes."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.utils.scripts import ROOT


def test_engine_through_the_triton_interpreter_matches_transformers():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "kernels", "check_engine_fp32.py"), "--device", "cpu",
         "--force-triton", "--families", "gpt_oss", "--prompts", "3", "--new-tokens", "6"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| gpt_oss | 18/18 | 3/3 |" in proc.stdout and "PASS" in proc.stdout
