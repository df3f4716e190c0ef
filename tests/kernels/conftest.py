"""Kernel tests run the Triton launchers on CPU through the interpreter; set it before triton is imported."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randn(*shape, dtype=torch.float32, scale=1.0):
    """Fresh random values (never zeros)."""
    return (torch.randn(*shape) * scale).to(dtype)
