from __future__ import annotations

import pytest
import torch

from loraplex.engine.logprobs import TokenLogprob, compute_logprobs, prompt_logprobs, to_openai
from loraplex.engine.testing.tiny_tokenizer import build_tiny_tokenizer


def test_compute_logprobs_against_a_written_reference():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    out = compute_logprobs(logits, [1, 3], [2, 0])
    z0 = torch.logsumexp(logits[0], 0).item()
    assert out[0].token_id == 1 and out[0].logprob == pytest.approx(1.0 - z0, abs=1e-6) and out[0].rank == 2
    assert [t for t, _ in out[0].top] == [0, 1]
    assert out[0].top[0][1] == pytest.approx(2.0 - z0, abs=1e-6)
    assert out[1].rank == 2 and out[1].top == []  # ties share the better rank: 0, 1, 3 all rank 2
    assert compute_logprobs(torch.zeros(0, 4), [], []) == []
    with pytest.raises(ValueError, match="2 logit rows but 1 token ids and 2 num_top entries"):
        compute_logprobs(logits, [1], [1, 1])


def test_prompt_logprobs_shift_by_one_and_chunk():
    torch.manual_seed(0)
    prompt = [3, 7, 1, 4, 2]
    logits = torch.randn(len(prompt), 9)  # position p predicts prompt[p + 1]; the last row predicts an output
    whole = prompt_logprobs(logits, prompt, 2)
    assert whole[0] is None and len(whole) == len(prompt)
    ref = torch.log_softmax(logits, -1)
    for p in range(1, len(prompt)):
        assert whole[p].token_id == prompt[p]
        assert whole[p].logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-6)
        assert len(whole[p].top) == 2
    chunks = prompt_logprobs(logits[:2], prompt, 2, start=0) + prompt_logprobs(logits[2:], prompt, 2, start=2)
    assert chunks == whole


def test_openai_shape():
    tok = build_tiny_tokenizer(300)
    ids = tok.encode("Hello world")
    entries = [TokenLogprob(ids[0], -0.5, 1, [(ids[0], -0.5), (ids[1], -1.5)])]
    out = to_openai(entries, tok)
    assert set(out[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert out[0]["token"] == tok.decode([ids[0]]) and out[0]["logprob"] == -0.5
    assert out[0]["bytes"] == list(out[0]["token"].encode())
    assert [t["logprob"] for t in out[0]["top_logprobs"]] == [-0.5, -1.5]
