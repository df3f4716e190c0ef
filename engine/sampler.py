"""Token selection from the last-position logits of each sampled sequence.

    logits [N, V] float32 -> + logit_bias, rows that set it
                          -> grammar mask (structured outputs: a packed int32 bitmask [N, ceil(V / 32)], disallowed
                             tokens -inf; free rows' mask allows everything, so their logits are untouched)
                          -> penalties (repetition, presence, frequency) and the min_tokens mask, rows that use them
                          -> greedy rows: argmax
                          -> others: / temperature -> top-k -> top-p -> min-p -> draw
                          -> logprobs of the chosen tokens under the raw logits, rows that ask for them

The draw uses the exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with probability p_i,
and needs only one noise vector per row. A seeded row's noise comes from its own generator, one row at a
time, so its token depends only on its own logits and generator state — never on the batch around it. Rows of
one request (n > 1) that share a generator draw from it in row order, so the request stays reproducible.

Penalties need each row's tokens: pass ``seqs`` (anything with ``prompt_token_ids`` and ``output_token_ids``,
e.g. ``Sequence``), one per row.

``choose`` returns the tokens as a device tensor without reading them back (overlapped steps,
engine/step_pipeline.py); per-row parameters go up through pinned memory with non-blocking copies, because on CUDA a
copy from pageable memory waits for every kernel already queued (the previous step's too).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from loraplex.engine.logprobs import TokenLogprob, compute_logprobs
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.structured.bitmask import apply_token_bitmask

_MIN_TEMPERATURE = torch.finfo(torch.float32).tiny  # a positive temperature below it is taken as this


class TokenHistory(Protocol):
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplerOutput:
    """Per row: the chosen token, and its logprob entry when the row's params ask for ``logprobs``."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream: create once at request start and pass the same object every step."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


class Sampler:
    """Stateless apart from the shared generator of unseeded rows (``seed`` makes a whole run reproducible).

    ``eos_token_ids`` are masked (with ``stop_token_ids``) while a row has fewer than ``min_tokens`` outputs.
    """

    def __init__(self, seed: int | None = None, eos_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.seed = seed
        self.eos_token_ids = list(eos_token_ids)
        self._shared: dict[str, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None  # torch's default generator of that device
        key = str(device)
        if key not in self._shared:
            self._shared[key] = make_generator(self.seed, device)
        return self._shared[key]

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
               seqs: list[TokenHistory] | None = None, token_bitmask: torch.Tensor | None = None) -> list[int]:
        """One token per row. ``logits`` [N, V]; ``params``, ``generators`` (None: unseeded) and ``seqs`` (needed
        only by rows with penalties or ``min_tokens``) have N entries; ``token_bitmask`` (int32 [N, ceil(V / 32)] on
        the logits' device, or None) is the grammar mask of each row."""
        return self.forward(logits, params, generators, seqs, token_bitmask).token_ids

    @torch.no_grad()
    def forward(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                seqs: list[TokenHistory] | None = None, token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """``sample`` plus the logprob entries of rows whose params set ``logprobs`` or ``best_of > n`` (add
        ``entry.logprob`` to the sequence with ``append_token(token, logprob)``)."""
        n = self._check(logits, params, generators)
        if n == 0:
            return SamplerOutput([], [])
        raw = logits.float()
        token_ids = self._choose(raw, params, generators, seqs, token_bitmask).tolist()
        logprobs: list[TokenLogprob | None] = [None] * n
        # rows that report logprobs, and best_of rows (their cumulative logprob ranks the sequences)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None or p.num_sequences > p.n]
        if lp_rows:
            entries = compute_logprobs(raw[lp_rows], [token_ids[i] for i in lp_rows],
                                       [params[i].logprobs or 0 for i in lp_rows])
            for i, e in zip(lp_rows, entries):
                logprobs[i] = e
        return SamplerOutput(token_ids, logprobs)

    @torch.no_grad()
    def choose(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
               seqs: list[TokenHistory] | None = None, token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """``sample`` without reading the tokens back: int64 [N] on the logits' device. Rows without penalties or
        ``min_tokens`` make no host sync on the way (logit_bias and the grammar mask make none)."""
        self._check(logits, params, generators)
        return self._choose(logits.float(), params, generators, seqs, token_bitmask)

    @staticmethod
    def _check(logits: torch.Tensor, params: list, generators: list) -> int:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(f"{n} logit rows but {len(params)} params and {len(generators)} generators")
        return n

    def _choose(self, raw: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                seqs: list[TokenHistory] | None, token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [N] (int64, on the device) from float32 logits [N, V]."""
        n = raw.shape[0]
        logits = self.apply_logit_bias(raw, params)
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, token_bitmask)
        logits = self.apply_penalties(logits, params, seqs)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(rows) == n:  # all rows draw: no argmax, index tensor, gather or scatter
            return self._draw(self.probs(logits, params), generators)
        tokens = logits.argmax(dim=-1)  # [N]
        if rows:
            idx = row_tensor(rows, torch.int64, logits.device)
            probs = self.probs(logits[idx], [params[i] for i in rows])  # [R, V]
            tokens[idx] = self._draw(probs, [generators[i] for i in rows])
        return tokens

    @torch.no_grad()
    def beam_logprobs(self, logits: torch.Tensor, params: list[SamplingParams],
                      seqs: list[TokenHistory] | None = None) -> torch.Tensor:
        """Beam search scores of the next token [N, V]: log_softmax of the logits, then the penalties and the
        ``min_tokens`` mask applied to those log-probs without renormalising (transformers' ``_beam_search``);
        ``logit_bias`` is added to the logits first."""
        return self.apply_penalties(torch.log_softmax(self.apply_logit_bias(logits.float(), params), dim=-1), params,
                                    seqs)

    @staticmethod
    def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """``logits`` plus each row's ``logit_bias`` (sparse: one scatter-add for the whole batch, its indices sent
        up through pinned memory: no host sync). Returns ``logits`` itself when no row sets a bias."""
        rows, ids, values = [], [], []
        for i, p in enumerate(params):
            for token, bias in p.logit_bias.items():
                rows.append(i)
                ids.append(token)
                values.append(bias)
        if not rows:
            return logits
        device = logits.device
        out = logits.clone()
        out.index_put_((row_tensor(rows, torch.int64, device), row_tensor(ids, torch.int64, device)),
                       row_tensor(values, torch.float32, device), accumulate=True)
        return out

    def apply_penalties(self, logits: torch.Tensor, params: list[SamplingParams],
                        seqs: list[TokenHistory] | None) -> torch.Tensor:
        """Repetition / presence / frequency penalties and the ``min_tokens`` mask on the rows that set them.
        Returns ``logits`` itself when no row does, else a new tensor [N, V]."""
        rows = [i for i, p in enumerate(params) if p.needs_token_history]
        if not rows:
            return logits
        if seqs is None or len(seqs) != len(params):
            raise ValueError("penalties and min_tokens need each row's tokens: pass seqs, one per logits row")
        logits = logits.clone()
        device, v = logits.device, logits.shape[1]

        rep = [i for i in rows if params[i].repetition_penalty != 1.0]
        if rep:  # transformers: seen tokens (prompt + output) — positive logits / p, negative logits * p
            seen = _token_counts([seqs[i].prompt_token_ids + seqs[i].output_token_ids for i in rep], v, device) > 0
            pen = torch.tensor([params[i].repetition_penalty for i in rep], device=device).unsqueeze(1)  # [R, 1]
            x = logits[rep]
            logits[rep] = torch.where(seen, torch.where(x < 0, x * pen, x / pen), x)

        pf = [i for i in rows if params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0]
        if pf:  # OpenAI: over output tokens only
            counts = _token_counts([seqs[i].output_token_ids for i in pf], v, device)  # [R, V]
            pres = torch.tensor([params[i].presence_penalty for i in pf], device=device).unsqueeze(1)
            freq = torch.tensor([params[i].frequency_penalty for i in pf], device=device).unsqueeze(1)
            logits[pf] = logits[pf] - freq * counts - pres * (counts > 0).float()

        for i in rows:  # min_tokens: few rows, few ids
            p = params[i]
            if len(seqs[i].output_token_ids) < p.min_tokens:
                stops = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
                stops = [t for t in stops if 0 <= t < v]
                if stops:
                    logits[i, stops] = float("-inf")
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Filtered, renormalised probabilities [R, V] of non-greedy rows: temperature, top-k, top-p, then min-p."""
        device = logits.device
        # the row's best logit becomes 0 before the division, and the temperature is at least float32's smallest
        # normal number: a tiny temperature (1e-50 is 0 in float32) then gives -inf to the others, never inf or NaN
        temp = row_tensor([max(p.temperature, _MIN_TEMPERATURE) for p in params], torch.float32, device)
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temp.unsqueeze(1)
        v = logits.shape[1]
        top_k = [p.top_k if p.top_k > 0 else v for p in params]
        top_p = [p.top_p for p in params]
        if any(k < v for k in top_k) or any(tp < 1.0 for tp in top_p):
            logits = _apply_top_k_top_p(logits, row_tensor(top_k, torch.int64, device),
                                        row_tensor(top_p, torch.float32, device))
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = row_tensor([p.min_p for p in params], torch.float32, device).unsqueeze(1)
            keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)  # the best token always passes
            probs = probs * keep
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):  # the same draw as below, without the index-put
            q = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self._shared_generator(probs.device))
            return (probs / q.clamp_min_(1e-20)).argmax(dim=-1)
        q = torch.empty_like(probs)
        if unseeded:
            q[row_tensor(unseeded, torch.int64, probs.device)] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self._shared_generator(probs.device))
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)  # this row's stream only
        return (probs / q.clamp_min_(1e-20)).argmax(dim=-1)


def row_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-row tensor on ``device``; on CUDA through pinned memory and a non-blocking copy (the caching
    host allocator keeps the pinned block until the copy has run), so no host sync."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32: how often each token id occurs in each row's list (ids outside the vocabulary ignored)."""
    rows = [r for r, toks in enumerate(token_lists) for _ in toks]
    ids = [t for toks in token_lists for t in toks]
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    if ids:
        row_t = torch.tensor(rows, device=device)
        id_t = torch.tensor(ids, device=device)
        ok = (id_t >= 0) & (id_t < vocab_size)
        counts.index_put_((row_t[ok], id_t[ok]), torch.ones(int(ok.sum()), device=device), accumulate=True)
    return counts


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
