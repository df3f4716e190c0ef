"""Beam search as fork / append / free on a sequence group, scored as transformers' ``_beam_search`` scores.

One step, for a group whose W running beams each produced next-token log-probs [W, V]:

    candidates   score = beam's cumulative logprob + logprob(token); the K = max(2, 1 + #stop ids) * W best
                 over all W * V (parent, token) pairs, best first
    finishing    a candidate ending in a stop token id, or reaching max_tokens: if it is among the first W,
                 it becomes a hypothesis scored  score / generated_len ** length_penalty  (generated_len counts
                 the new token); the W best hypotheses are kept
    running      the W best candidates that do not finish; a parent with c > 0 of them appends one token and
                 is forked c - 1 times (before appending), a parent with none is freed

    beams:   s1 ──┬─ s1 + "a"        (append)                    blocks: s1 and s1' share every block;
                  └─ s1' + "b"       (fork s1, then append)      the shared last block is copied on the next
             s2 ──── (freed)                                     write (copy-on-write), full ones never

Stopping (transformers' ``early_stopping``): True — as soon as W hypotheses exist; False — once the best running
score, length-normalised at the current length, cannot beat the worst kept hypothesis; "never" — the same, but
with a positive length penalty the best running score is normalised at the maximum length. The search also ends
when every candidate finishes (max_tokens reached).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sequence import Sequence, SequenceGroup, SequenceStatus

_NEG = -1.0e9  # transformers' "impossible" score


@dataclass
class BeamHypothesis:
    """A finished beam: its output tokens (the stop token included), summed logprob and normalised score."""

    output_token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (a stop token id) or "length"


@dataclass
class BeamStepResult:
    """What one step did: the running beams after it (best first), the new forks among them (to add to the
    scheduler's running set), the beams it freed (to drop from it), and whether the search is over."""

    running: list[Sequence]
    forked: list[Sequence] = field(default_factory=list)
    freed: list[Sequence] = field(default_factory=list)
    done: bool = False


class BeamSearchState:
    """One request's beam search: its running beams (in the order their log-prob rows are expected), the best
    ``beam_width`` hypotheses so far, and the early-stop flag.

    ``stop_token_ids`` end a beam (EOS unless ``ignore_eos``, plus the request's ``stop_token_ids``);
    ``max_new_tokens`` is ``min(max_tokens, max_model_len - prompt_len)``.
    """

    def __init__(self, group: SequenceGroup, beam_width: int, *, stop_token_ids: list[int], max_new_tokens: int,
                 length_penalty: float = 1.0, early_stopping: bool | str = False) -> None:
        if beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {beam_width}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not (isinstance(early_stopping, bool) or early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        live = group.unfinished_seqs()
        if len(live) != 1:
            raise ValueError(f"beam search starts from one sequence, request {group.request_id!r} has {len(live)}")
        self.group = group
        self.beam_width = beam_width
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.max_new_tokens = max_new_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.running: list[Sequence] = live
        self.hypotheses: list[BeamHypothesis] = []  # best first, at most beam_width
        self.improvement_possible = True
        self.done = False
        group.beam_search = self

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.stop_token_ids)) * self.beam_width

    def best(self, n: int) -> list[BeamHypothesis]:
        """The ``n`` best hypotheses, best first (what the request returns)."""
        return self.hypotheses[:n]

    def step_rows(self, rows: list[torch.Tensor], kv: KVCacheManager,
                  new_seq_id: Callable[[], int] | None = None) -> BeamStepResult:
        """``step`` with one next-token log-prob row [V] per running beam, in ``self.running`` order (the rows
        may come from different engine steps when a recomputed beam finished later than its siblings)."""
        return self.step(torch.stack([r.float().cpu() for r in rows]), kv, new_seq_id)

    def step(self, logprobs: torch.Tensor, kv: KVCacheManager,
             new_seq_id: Callable[[], int] | None = None) -> BeamStepResult:
        """Advance every running beam by one token. ``logprobs`` [W, V]: the next-token log-probs of
        ``self.running`` in that order (``Sampler.beam_logprobs``). Forks get ids from ``new_seq_id`` (default:
        ``Sequence.fork``'s counter); ``kv`` shares and frees their blocks."""
        if self.done:
            raise RuntimeError(f"beam search of request {self.group.request_id!r} is already done")
        w = len(self.running)
        if logprobs.dim() != 2 or logprobs.shape[0] != w:
            raise ValueError(f"logprobs must be [{w}, V] for {w} running beams, got {tuple(logprobs.shape)}")
        generated = self.running[0].num_output_tokens
        if any(s.num_output_tokens != generated for s in self.running):
            raise RuntimeError("running beams must have equal output lengths")

        # candidates: float32 sums, as transformers accumulates them
        cum = torch.tensor([s.cumulative_logprob for s in self.running], dtype=torch.float32)
        scores = (logprobs.float().cpu() + cum.unsqueeze(1)).reshape(-1)  # [W * V]
        vocab = logprobs.shape[1]
        k = min(self.num_candidates, scores.numel())
        top_scores, top_idx = scores.topk(k)
        cands = [(i // vocab, i % vocab, sc) for i, sc in zip(top_idx.tolist(), top_scores.tolist())]
        at_length = generated + 1 >= self.max_new_tokens
        stops = [at_length or tok in self.stop_token_ids for _, tok, _ in cands]

        # hypotheses: finishing candidates among the first beam_width
        full_and_early = len(self.hypotheses) == self.beam_width and self.early_stopping is True
        if self.improvement_possible and not full_and_early:
            norm = float(generated + 1) ** self.length_penalty
            new = [BeamHypothesis(self.running[p].output_token_ids + [tok], sc, _f32_div(sc, norm),
                                  "length" if at_length and tok not in self.stop_token_ids else "stop")
                   for j, ((p, tok, sc), stop) in enumerate(zip(cands, stops)) if stop and j < self.beam_width]
            merged = self.hypotheses + new  # stable: earlier hypotheses win ties
            self.hypotheses = sorted(merged, key=lambda h: -h.score)[:self.beam_width]

        # next running beams: the best beam_width candidates that go on
        going = [c for c, stop in zip(cands, stops) if not stop][:self.beam_width]
        done = not going
        if going:
            if len(self.hypotheses) == self.beam_width:
                best_len = (self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0
                            else generated + 1)
                best_possible = _f32_div(going[0][2], float(best_len) ** self.length_penalty)
                self.improvement_possible = best_possible > self.hypotheses[-1].score
            done = (not self.improvement_possible
                    or (len(self.hypotheses) == self.beam_width and self.early_stopping is True))
        if done:
            return self._finish(kv)
        return self._advance(going, kv, new_seq_id)

    def _advance(self, going: list[tuple[int, int, float]], kv: KVCacheManager,
                 new_seq_id: Callable[[], int] | None) -> BeamStepResult:
        children: dict[int, list[tuple[int, float, int]]] = {}
        for rank, (p, tok, sc) in enumerate(going):
            children.setdefault(p, []).append((tok, sc, rank))
        result = BeamStepResult(running=[])
        ranked: list[tuple[int, Sequence]] = []
        for p, parent in enumerate(self.running):
            kids = children.get(p)
            if not kids:
                kv.free(parent)
                parent.status = SequenceStatus.FINISHED_ABORTED  # pruned: the scheduler drops it
                self.group.remove_seq(parent)
                result.freed.append(parent)
                continue
            for tok, sc, rank in kids[1:]:  # fork before the parent appends its own token
                child = parent.fork(new_seq_id() if new_seq_id is not None else None)
                kv.fork(parent, child)
                self.group.add_seq(child)
                _set_token(child, tok, sc)
                result.forked.append(child)
                ranked.append((rank, child))
            tok, sc, rank = kids[0]
            _set_token(parent, tok, sc)
            ranked.append((rank, parent))
        self.running = [s for _, s in sorted(ranked, key=lambda x: x[0])]
        result.running = list(self.running)
        return result

    def _finish(self, kv: KVCacheManager) -> BeamStepResult:
        """The search is over: free every running beam; the result is ``best(n)``."""
        freed = list(self.running)
        for s in freed:
            kv.free(s)
            s.status = SequenceStatus.FINISHED_STOPPED
        self.running = []
        self.done = True
        return BeamStepResult(running=[], freed=freed, done=True)


def _set_token(seq: Sequence, token: int, score: float) -> None:
    """Append ``token``; the cumulative logprob becomes the candidate's float32 score exactly."""
    seq.append_token(token)
    seq.cumulative_logprob = score


def _f32_div(x: float, y: float) -> float:
    """``x / y`` rounded as a float32 tensor divided by a Python float (transformers' arithmetic)."""
    return (torch.tensor(x, dtype=torch.float32) / y).item()
