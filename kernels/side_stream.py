"""Work forked onto a side CUDA stream beside the step stream's, and joined back before its result is read (a LoRA
shrink beside the base GEMM of the same input). Under CUDA-graph capture the fork and join become two graph
branches and their join.

    buf = fork(side, lambda: shrink(x))     # side waits for everything the current stream has enqueued, then runs
    y = base(x)                             # on the current stream, at the same time
    join(side)                              # the current stream waits for the side stream; buf may be read now

Every side-stream op follows such a wait, so blocks the side stream frees are reused only after the current
stream's uses of them were enqueued: no ``record_stream`` is needed.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def fork(side: torch.cuda.Stream, fn: Callable[[], T]) -> T:
    """``fn()`` enqueued on ``side`` after everything the current stream has enqueued."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        return fn()


def join(side: torch.cuda.Stream) -> None:
    """The current stream waits for everything enqueued on ``side``."""
    torch.cuda.current_stream().wait_stream(side)
