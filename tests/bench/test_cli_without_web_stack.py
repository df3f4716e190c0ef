"""The engine and bench commands run where the platform's packages are missing (the GPU image has torch,
transformers and safetensors, no pydantic / fastapi)."""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import sys
for name in ("pydantic", "pydantic_settings", "fastapi", "sqlalchemy"):
    sys.modules[name] = None            # import of any of them raises ImportError
import loraplex.commands as commands
import loraplex.cli as cli

def register_all(sub):
    p = sub.add_parser("probe")
    p.set_defaults(func=lambda args: 7)

commands.register_all = register_all
assert cli.main(["probe"]) == 7
print("ok")
"""


def test_cli_main_needs_no_platform_packages():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
