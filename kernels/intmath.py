"""Integer helpers for the host side of the launchers: grid sizes and power-of-two tiles.

Plain functions with the results of ``triton.cdiv`` / ``triton.next_power_of_2``. Recent Triton releases make
those constexpr functions, whose host-side call unwraps every argument (several microseconds each); an eager
step calls them about a thousand times, so the launchers use these instead. Inside ``@triton.jit`` code keep
Triton's own."""
from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for integers (y > 0)."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as Triton's)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
