"""Token selection from the last-position logits of each sampled sequence.

    logits [N, V] float32 -> greedy rows: argmax
                          -> others: / temperature -> top-k -> top-p -> draw

The draw uses the exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with probability p_i,
and needs only one noise vector per row. A seeded row's noise comes from its own generator, one row at a
time, so its token depends only on its own logits and generator state — never on the batch around it.
"""
from __future__ import annotations

import torch

from loraplex.engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream: create once at request start and pass the same object every step."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


class Sampler:
    """Stateless apart from the shared generator of unseeded rows (``seed`` makes a whole run reproducible)."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._shared: dict[str, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None  # torch's default generator of that device
        key = str(device)
        if key not in self._shared:
            self._shared[key] = make_generator(self.seed, device)
        return self._shared[key]

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> list[int]:
        """One token per row. ``logits`` [N, V]; ``params`` and ``generators`` have N entries (None: unseeded)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(f"{n} logit rows but {len(params)} params and {len(generators)} generators")
        if n == 0:
            return []
        logits = logits.float()
        tokens = logits.argmax(dim=-1)  # [N]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            probs = self.probs(logits[idx], [params[i] for i in rows])  # [R, V]
            tokens[idx] = self._draw(probs, [generators[i] for i in rows])
        return tokens.tolist()

    @staticmethod
    def probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Filtered, renormalised probabilities [R, V] of non-greedy rows: temperature, top-k, then top-p."""
        device = logits.device
        temp = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
        logits = logits / temp.unsqueeze(1)
        v = logits.shape[1]
        top_k = [p.top_k if p.top_k > 0 else v for p in params]
        top_p = [p.top_p for p in params]
        if any(k < v for k in top_k) or any(tp < 1.0 for tp in top_p):
            logits = _apply_top_k_top_p(logits, torch.tensor(top_k, device=device),
                                        torch.tensor(top_p, device=device, dtype=torch.float32))
        return torch.softmax(logits, dim=-1)

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self._shared_generator(probs.device))
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)  # this row's stream only
        return (probs / q.clamp_min_(1e-20)).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf everything outside each row's top_k tokens and then outside the smallest set whose
    probability (after top-k) reaches top_p. logits [R, V]; top_k [R] (V = off); top_p [R] (1 = off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)  # [1, V]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    p = torch.softmax(sorted_logits, dim=-1)
    mass_before = p.cumsum(dim=-1) - p  # probability of strictly better tokens
    drop = (mass_before >= top_p.unsqueeze(1)) & (rank > 0)  # the best token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
