"""Log-probabilities of chosen tokens and their top alternatives, for sampled and for prompt tokens.

    logits [N, V] --log_softmax--> logp [N, V] --gather(token)--> chosen logprob, rank (1 = most likely)
                                              --topk(max n)----> the n best (token, logprob), best first

Values are the model's distribution before sampling controls (penalties, temperature, filters), as vLLM's
default "raw logprobs" and OpenAI's API report them. Prompt position ``i`` of the logits predicts prompt token
``i + 1``, so the first prompt token has no logprob (None), as in vLLM and OpenAI's legacy ``echo``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenLogprob:
    """One position: the chosen token, its logprob and rank, and the ``top`` alternatives (best first)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@torch.no_grad()
def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor | list[int],
                     num_top: list[int]) -> list[TokenLogprob]:
    """Logprob and rank of ``token_ids[i]`` under row i of ``logits`` [N, V], with ``num_top[i]`` alternatives.

    One device-to-host copy for the whole batch.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, v = logits.shape
    tokens = torch.as_tensor(token_ids, dtype=torch.int64, device=logits.device).reshape(-1)  # [N]
    if tokens.numel() != n or len(num_top) != n:
        raise ValueError(f"{n} logit rows but {tokens.numel()} token ids and {len(num_top)} num_top entries")
    if n == 0:
        return []
    if any(k < 0 for k in num_top):
        raise ValueError(f"num_top entries must be >= 0, got {num_top}")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = logp.gather(1, tokens.unsqueeze(1))  # [N, 1]
    rank = (logp > chosen).sum(dim=1) + 1  # [N]; ties share the better rank
    k = min(max(num_top), v)
    top_lp, top_ids = logp.topk(k, dim=-1)  # [N, k]
    chosen_l, rank_l, top_lp_l, top_ids_l = chosen.squeeze(1).tolist(), rank.tolist(), top_lp.tolist(), top_ids.tolist()
    return [TokenLogprob(int(tokens_i), chosen_l[i], rank_l[i],
                         list(zip(top_ids_l[i][:num_top[i]], top_lp_l[i][:num_top[i]])))
            for i, tokens_i in enumerate(tokens.tolist())]


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int], num_top: int,
                    start: int = 0) -> list[TokenLogprob | None]:
    """Logprobs of prompt tokens from the logits of prompt positions ``start .. start + T - 1`` [T, V].

    Position ``p`` predicts token ``p + 1``; with ``start == 0`` the result begins with None for the first token.
    Chunked prefill calls this once per chunk with the chunk's ``start`` and concatenates; the logits of the
    prompt's last position predict the first output token and are not used here.
    """
    t = logits.shape[0]
    end = min(start + t, len(prompt_token_ids) - 1)  # positions with a next prompt token
    rows = max(end - start, 0)
    entries: list[TokenLogprob | None] = [None] if start == 0 else []
    if rows:
        entries.extend(compute_logprobs(logits[:rows], prompt_token_ids[start + 1:end + 1], [num_top] * rows))
    return entries


def to_openai(entries: list[TokenLogprob], tokenizer) -> list[dict]:
    """OpenAI chat ``choices[i].logprobs.content``: ``[{token, logprob, bytes, top_logprobs: [...]}]``.

    ``tokenizer`` turns ids into text (``convert_ids_to_tokens`` is avoided: byte-level pieces are not text).
    """
    def item(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
