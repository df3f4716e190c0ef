"""The launchers' integer helpers give Triton's results (they replace triton.cdiv / next_power_of_2 on the host)."""
from __future__ import annotations

import random

import triton

from loraplex.kernels.intmath import cdiv, next_power_of_2


def test_next_power_of_2_matches_triton():
    values = list(range(-3, 4100)) + [2**k + d for k in range(12, 40) for d in (-1, 0, 1)]
    for n in values:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_matches_triton():
    rng = random.Random(0)
    pairs = [(x, y) for x in range(0, 300) for y in range(1, 40)]
    pairs += [(rng.randrange(0, 2**40), rng.randrange(1, 2**20)) for _ in range(2000)]
    for x, y in pairs:
        assert cdiv(x, y) == triton.cdiv(x, y), (x, y)
