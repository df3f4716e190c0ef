"""Compute ops: Triton kernels on CUDA, each beside a torch reference with the same signature (``reference``).
Callers use ``loraplex.kernels.ops``; ``dispatch`` picks the implementation."""
