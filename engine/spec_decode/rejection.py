"""Acceptance of draft tokens against the target's distributions at every verified position.

Sequence s verified drafts d_1..d_k in one forward and has target rows r_0..r_k (row j: the distribution of the
token after d_1..d_j, every sampling control applied; row k: the bonus position).

    greedy:    a = longest prefix with d_{j+1} == argmax(r_j);  token = argmax(r_a)
    sampling:  speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023):
               for j = 0, 1, ...: accept d_{j+1} with probability min(1, p_j(d_{j+1}) / q_j(d_{j+1}))
               first rejection at j = a:   token ~ norm(max(0, p_a - q_a))      (the residual)
               all k accepted (a = k):     token ~ p_k                          (the bonus token)
               q_j is the distribution the draft was drawn from; deterministic drafts (n-gram, replay) have
               q_j = one-hot(d_{j+1}): accepted with probability p_j(d_{j+1}), residual = p_j without d_{j+1}.

Every output token is then distributed exactly as non-speculative sampling from p would draw it. Randomness: per
sequence k uniforms and one exponential vector (the same exponential race the sampler draws with) from the
request's own generator (seeded requests stay reproducible), or from the shared one for unseeded rows. Everything
stays on the device; the caller reads the accepted counts and tokens back once.
"""
from __future__ import annotations

import itertools

import torch

from loraplex.engine.sampler import row_tensor


def accept_mask(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draft accepted iff u < p / q (u ~ U[0, 1)): written u * q < p, which is also right for q = 1 (one-hot) and
    never accepts a token the target gives probability 0."""
    return u * q_draft < p_draft


def _segments(num_drafts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row offsets of each sequence's k_s + 1 target rows; (seq index, position) of each draft row."""
    offs, seq_of, pos = [], [], []
    row = 0
    for s, k in enumerate(num_drafts):
        offs.append(row)
        seq_of += [s] * k
        pos += list(range(k))
        row += k + 1
    return (row_tensor(offs, torch.int64, device), row_tensor(seq_of, torch.int64, device),
            row_tensor(pos, torch.int64, device))


def _leading(ok: torch.Tensor, seq_of: torch.Tensor, pos: torch.Tensor, num_seqs: int, width: int) -> torch.Tensor:
    """Per sequence, how many of its draft rows are accepted before the first rejection."""
    grid = torch.zeros(num_seqs, max(width, 1), dtype=torch.int64, device=ok.device)
    if ok.numel():
        grid[seq_of, pos] = ok.to(torch.int64)
    return grid.cumprod(dim=1).sum(dim=1)


def verify_greedy(argmax: torch.Tensor, drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``argmax`` [R] (the target's choice at every row, sequences' k_s + 1 rows in order) -> (accepted [S],
    token [S]) on the device."""
    device = argmax.device
    num_drafts = [len(d) for d in drafts]
    k = num_drafts[0] if drafts else 0
    if k and num_drafts.count(k) == len(drafts):  # every sequence k drafts: a [S, k + 1] grid, four kernels
        grid = argmax.view(len(drafts), k + 1)
        hits = grid[:, :k] == row_tensor(drafts, torch.int64, device)
        accepted = hits.to(torch.int64).cumprod(dim=1).sum(dim=1)
        return accepted, grid.gather(1, accepted.unsqueeze(1)).squeeze(1)
    offs, seq_of, pos = _segments(num_drafts, device)
    flat = row_tensor([t for d in drafts for t in d], torch.int64, device)
    draft_rows = offs[seq_of] + pos
    accepted = _leading(argmax[draft_rows] == flat, seq_of, pos, len(drafts), max(num_drafts, default=0))
    return accepted, argmax[offs + accepted]


def verify_sampled(probs: torch.Tensor, drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
                   generators: list[torch.Generator | None],
                   shared: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs`` [R, V] (target distributions, each sequence's k_s + 1 rows in order); ``draft_probs[s]`` [k_s, V]
    or None (one-hot drafts) -> (accepted [S], token [S]) on the device (module docstring)."""
    device, vocab = probs.device, probs.shape[1]
    num_seqs = len(drafts)
    num_drafts = [len(d) for d in drafts]
    offs, seq_of, pos = _segments(num_drafts, device)
    flat = row_tensor([t for d in drafts for t in d], torch.int64, device)
    draft_rows = offs[seq_of] + pos
    p_draft = probs[draft_rows, flat] if flat.numel() else probs.new_zeros(0)
    dense = any(q is not None for q in draft_probs)
    q_rows = None
    if dense:  # every draft row's q, one-hot where a proposal gave none
        parts = []
        for d, q in zip(drafts, draft_probs):
            if not d:
                continue
            if q is None:
                q = torch.zeros(len(d), vocab, device=device)
                q[torch.arange(len(d), device=device), row_tensor(d, torch.int64, device)] = 1.0
            parts.append(q[:len(d)].to(device=device, dtype=torch.float32))
        q_rows = torch.cat(parts) if parts else probs.new_zeros(0, vocab)
        q_draft = q_rows[torch.arange(q_rows.shape[0], device=device), flat] if flat.numel() else p_draft
    else:
        q_draft = torch.ones_like(p_draft)
    u = _uniforms(num_drafts, generators, shared, device)
    accepted = _leading(accept_mask(p_draft, q_draft, u), seq_of, pos, num_seqs, max(num_drafts, default=0))
    # the distribution of each sequence's last token: the residual at its first rejection, else the bonus row
    k_t = row_tensor(num_drafts, torch.int64, device)
    rejected = accepted < k_t
    final = probs[offs + accepted]                                              # [S, V]
    if flat.numel():
        draft_offs = row_tensor([0, *itertools.accumulate(num_drafts)][:-1], torch.int64, device)
        at = (draft_offs + accepted.clamp(max=k_t - 1).clamp(min=0)).clamp(max=max(flat.numel() - 1, 0))
        if q_rows is not None:
            q_at = q_rows[at]
        else:
            q_at = torch.zeros_like(final).scatter_(1, flat[at].unsqueeze(1), 1.0)
        residual = (final - q_at).clamp_(min=0.0)
        mass = residual.sum(dim=1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), final)  # p == q: nothing to correct
        final = torch.where(rejected.unsqueeze(1), residual, final)
    return accepted, _race(final, generators, shared)


def _uniforms(num_drafts: list[int], generators: list, shared, device) -> torch.Tensor:
    """One U[0, 1) per draft row: seeded sequences from their own generator, the rest in one draw."""
    total = sum(num_drafts)
    u = torch.empty(total, device=device)
    row, idx = 0, []
    for k, g in zip(num_drafts, generators):
        if g is not None and k:
            u[row:row + k] = torch.rand(k, generator=g, device=device)
        elif k:
            idx += list(range(row, row + k))
        row += k
    if idx:
        u[row_tensor(idx, torch.int64, device)] = torch.rand(len(idx), generator=shared, device=device)
    return u


def _race(probs: torch.Tensor, generators: list, shared) -> torch.Tensor:
    """argmax(p / e), e ~ Exp(1) i.i.d.: draws token i with probability p_i (as Sampler._draw)."""
    e = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        e[row_tensor(unseeded, torch.int64, probs.device)] = torch.empty(
            len(unseeded), probs.shape[1], device=probs.device).exponential_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            e[i].exponential_(generator=g)
    return (probs / e.clamp_min_(1e-20)).argmax(dim=-1)
