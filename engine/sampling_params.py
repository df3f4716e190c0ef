"""Per-request decoding options, validated on construction (torch-free).

    SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1)
    SamplingParams.from_dict({"max_tokens": 64, "stop_token_ids": [2]})   # unknown keys -> ValueError
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    ``temperature == 0`` is greedy (argmax); ``top_k`` of 0 or -1 and ``top_p`` of 1 switch those filters off.
    ``seed`` gives the request its own random stream: the same tokens whatever else shares the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be in [0, inf), got {self.temperature}")
        self.temperature = float(self.temperature)
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        for tok in self.stop_token_ids:
            _check_int("stop_token_ids", tok)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_int("n", self.n)
        if self.n != 1:
            raise ValueError(f"n must be 1 (several sequences per request are not supported yet), got {self.n}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def verify(self, vocab_size: int) -> None:
        """Check the token ids against the model's vocabulary ``[0, vocab_size)``."""
        for tok in self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                raise ValueError(f"stop_token_ids contains {tok}, outside the vocabulary [0, {vocab_size})")
        if self.top_k > vocab_size:
            raise ValueError(f"top_k={self.top_k} exceeds the vocabulary size {vocab_size}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a plain dict; a key that is not a field (e.g. ``stop_strings``) is a ValueError."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(k for k in d if k not in valid)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                             f"valid: {', '.join(valid)}")
        return cls(**d)


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
