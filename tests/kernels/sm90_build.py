"""Kernels built for sm_90 on the CPU: the kernel tests run under the Triton interpreter, which forgives what the GPU
compiler does not, so a build check runs its script in a child Python without ``TRITON_INTERPRET``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.utils.scripts import ROOT


def build_in_child(script: str, timeout: int = 300):
    """Run ``script`` (Python that prints one line ``RESULT <json>``) from the repository root without the
    interpreter; the JSON it printed. A failed build fails the calling test with the child's output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"sm_90 build failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[0][len("RESULT "):])
