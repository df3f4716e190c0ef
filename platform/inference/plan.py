"""ChoicePlan: how a request's ``n`` choices (and ``best_of`` candidates, logprobs, echo) come out of the engine.

    sampled, n               engine runs n sequences                        choices = the engine's completions
    sampled, best_of > n     engine runs best_of sequences (with logprobs)  choices = the n of highest cumulative
                                                                            logprob, best first (not streamable)
    greedy (temperature 0)   engine runs 1 sequence                         choices = n copies of it (they would
                                                                            all be equal; the engine refuses greedy
                                                                            n > 1)

Billing counts every choice and every ``best_of`` candidate (OpenAI's rule): for greedy requests the one
sequence's tokens times ``max(n, best_of)``. The quota reservation is ``prompt + candidates * max_tokens``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.platform.inference.errors import InferenceError

MAX_N = 128          # OpenAI's cap on n; best_of shares it
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class ChoicePlan:
    n: int                     # choices answered
    candidates: int            # sequences billed and reserved for: max(n, best_of)
    engine_n: int              # sequences the engine runs
    fanout: int                # copies of the engine's one sequence (greedy), else 1
    pick_best: bool            # keep the n best of the engine's engine_n by cumulative logprob
    logprobs: int | None       # top alternatives per token the client wants (None: no logprobs)
    echo: bool = False         # completions: the prompt goes before each choice's text
    prompt_logprobs: bool = False  # echo with logprobs: the prompt tokens' logprobs too

    @property
    def bill_factor(self) -> int:
        """Engine completion tokens -> billed completion tokens."""
        return self.candidates // self.engine_n

    def engine_fields(self) -> dict[str, Any]:
        """The ``SamplingParams`` fields this plan sets."""
        d: dict[str, Any] = {}
        if self.engine_n > 1:
            d["n"] = self.engine_n
        if self.logprobs is not None or self.pick_best:
            d["logprobs"] = self.logprobs or 0   # pick_best ranks by cumulative logprob: the engine must compute it
        if self.prompt_logprobs:
            d["prompt_logprobs"] = self.logprobs or 0
        return d


def plan_choices(*, n: int, best_of: int | None, temperature: float | None, logprobs: int | None, echo: bool,
                 stream: bool) -> ChoicePlan:
    """The plan of a validated request; 400 naming the parameter for combinations that cannot be served."""
    best = best_of if best_of is not None else n
    if best < n:
        raise InferenceError(400, f"'best_of' ({best_of}) must be greater than or equal to 'n' ({n})",
                             param="best_of")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise InferenceError(400, f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", param="logprobs")
    greedy = temperature == 0
    if greedy:
        return ChoicePlan(n=n, candidates=best, engine_n=1, fanout=n, pick_best=False, logprobs=logprobs,
                          echo=echo, prompt_logprobs=echo and logprobs is not None)
    if best > n and stream:
        raise InferenceError(400, "'best_of' greater than 'n' cannot be streamed (the best choices are known only "
                                  "at the end); set stream to false or best_of equal to n", param="best_of")
    return ChoicePlan(n=n, candidates=best, engine_n=best, fanout=1, pick_best=best > n, logprobs=logprobs,
                      echo=echo, prompt_logprobs=echo and logprobs is not None)
