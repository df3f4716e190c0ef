"""Per-request decoding options, validated on construction (torch-free).

    SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1)
    SamplingParams(max_tokens=32, n=4, seed=7)                           # parallel sampling (forked sequences)
    SamplingParams(max_tokens=32, use_beam_search=True, beam_width=4)    # beam search, deterministic
    SamplingParams.from_dict({"max_tokens": 64, "stop_token_ids": [2]})  # unknown keys -> ValueError

Order of the logit controls (transformers' order): repetition / presence / frequency penalties and the
``min_tokens`` mask -> temperature -> top-k -> top-p -> min-p -> draw.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    ``temperature == 0`` is greedy (argmax); ``top_k`` of 0 or -1, ``top_p`` of 1 and ``min_p`` of 0 switch those
    filters off. ``seed`` gives the request its own random stream: the same tokens whatever else shares the batch.

    Penalties: ``repetition_penalty`` (transformers: a seen token's positive logit is divided by it, a negative one
    multiplied; "seen" = prompt + output; 1 = off); ``presence_penalty`` / ``frequency_penalty`` (OpenAI: subtract
    ``presence * [count > 0] + frequency * count`` over output tokens; 0 = off).
    ``min_tokens``: EOS and ``stop_token_ids`` are masked until that many tokens were generated.
    ``stop``: strings that end the output (matched on detokenized text, also across tokens); the matched string is
    cut from the text unless ``include_stop_str_in_output``.
    ``logprobs`` / ``prompt_logprobs``: None = off, else how many top alternatives (0..20) to report besides the
    chosen / prompt token.
    ``n`` sequences are returned; ``best_of`` (>= n) are generated and the n with the highest cumulative logprob
    kept. ``use_beam_search`` with ``beam_width`` (default ``max(n, best_of)``) keeps that many beams; scores are
    ``sum logprob / generated_len ** length_penalty``; ``early_stopping`` is True, False or "never" as in
    transformers. Beam search is deterministic: top-k / top-p / min-p / seed must be off and temperature is unused.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

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
        _check_bool("ignore_eos", self.ignore_eos)
        self._check_controls()
        self._check_outputs()
        self._check_n_and_beams()

    def _check_controls(self) -> None:
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0, "[0, 1] (0 = off)")
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty, 0.0, float("inf"),
                                               "(0, inf) (1 = off)", low_open=True)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0,
                                             "[-2, 2] (0 = off)")
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0,
                                              "[-2, 2] (0 = off)")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

    def _check_outputs(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop contains an empty string; every stop string needs at least one character")
        self.stop = list(self.stop)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be None (off) or in [0, {MAX_LOGPROBS}], got {value}")

    def _check_n_and_beams(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of is not None:
            _check_int("best_of", self.best_of)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        _check_bool("use_beam_search", self.use_beam_search)
        self.length_penalty = _check_float("length_penalty", self.length_penalty, float("-inf"), float("inf"),
                                           "(-inf, inf) (finite)")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.beam_width is not None:
            _check_int("beam_width", self.beam_width)
            if self.beam_width < 1:
                raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.use_beam_search:
            width = self.beam_width if self.beam_width is not None else max(self.n, self.best_of or 1)
            if width < max(self.n, self.best_of or 1):
                raise ValueError(f"beam_width ({width}) must be >= n ({self.n}) and best_of ({self.best_of})")
            self.beam_width = width
            for name, off in (("top_k", self.top_k <= 0), ("top_p", self.top_p == 1.0), ("min_p", self.min_p == 0.0),
                              ("seed", self.seed is None), ("stop", not self.stop)):
                if not off:
                    raise ValueError(f"{name} cannot be combined with use_beam_search (beam search is deterministic "
                                     f"and matches stops by token id); remove {name}")
        elif self.beam_width is not None:
            raise ValueError("beam_width is set but use_beam_search is False; set use_beam_search=True or drop it")
        elif self.greedy and self.num_sequences > 1:
            raise ValueError(f"greedy decoding (temperature 0) would make all {self.num_sequences} sequences equal; "
                             f"set temperature > 0, use_beam_search=True, or n=1 and best_of=None")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def num_sequences(self) -> int:
        """Sequences generated in parallel: the beam width, else ``best_of`` (default ``n``)."""
        if self.use_beam_search:
            return self.beam_width  # type: ignore[return-value]
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the row's prompt/output tokens (penalties, ``min_tokens``)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0)

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


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_float(name: str, value: Any, low: float, high: float, text: str, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in {text}, got {value!r}")
    ok = (low < value if low_open else low <= value) and value <= high and value == value and abs(value) != float("inf")
    if not ok:
        raise ValueError(f"{name} must be in {text}, got {value}")
    return float(value)
