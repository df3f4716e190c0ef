"""Kernel tests run the Triton launchers on CPU through the interpreter; set it before triton is imported.

The interpreter multiplies float32 dots exactly, while the GPU rounds float32 ``tl.dot`` operands to tf32
unless the dot asks for IEEE precision. ``_tf32_dots`` makes the interpreter round like the GPU, so every
float32 comparison here also proves that the kernels ask for IEEE products (see ``kernels/dot.py``).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def round_to_tf32(a: np.ndarray) -> np.ndarray:
    """float32 -> nearest value with tf32's 10 explicit mantissa bits (as float32)."""
    bits = a.view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


@pytest.fixture(autouse=True)
def _tf32_dots(monkeypatch):
    """Interpreted float32 dots without ``input_precision="ieee"`` see tf32-rounded operands, as on the GPU."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if "IEEE" not in str(input_precision).upper() and a.data.dtype == np.float32 \
                and b.data.dtype == np.float32:
            a = interpreter.TensorHandle(round_to_tf32(a.data), a.dtype)
            b = interpreter.TensorHandle(round_to_tf32(b.data), b.dtype)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randn(*shape, dtype=torch.float32, scale=1.0):
    """Fresh random values (never zeros)."""
    return (torch.randn(*shape) * scale).to(dtype)
