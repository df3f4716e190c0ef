"""n > 1, logprobs, echo and best_of end to end: the platform (PostgreSQL, Redis quotas, S3 adapters) in front of
two ``loraplex engine serve`` processes (the HTTP engine API), a tiny qwen3_moe with a PEFT adapter, the official
``openai`` client. Logprobs equal log_softmax of transformers + PEFT; Redis leases are all released."""
from __future__ import annotations

import pytest
import torch

TOL = 1e-4
MESSAGES = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def peft_model(tiny_moe, moe_adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32, attn_implementation="eager")
    return PeftModel.from_pretrained(model, moe_adapters["a"]).eval()


@torch.no_grad()
def greedy_with_logprobs(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    ids, rows = list(prompt), []
    for _ in range(n):
        row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        rows.append(row)
        ids.append(int(row.argmax()))
    return ids[len(prompt):], rows


def leases(fleet, tenant_id: str) -> int:
    """Quota leases the tenant holds in Redis."""
    import redis

    client = redis.Redis.from_url(fleet.server.gateway.settings.redis_url)
    try:
        return client.zcard(f"{fleet.key_prefix}:{{{tenant_id}}}:leases")
    finally:
        client.close()


@pytest.mark.slow  # this module's fleet starts two engine processes (~20 s); the requests take ~10 s on CPU
def test_choices_and_logprobs_through_http_engines(fleet, moe_adapters, peft_model):
    server = fleet.server
    tid, key = server.new_tenant({"max_concurrency": 2})
    server.upload(key, "alpha", moe_adapters["a"])
    client = server.openai(key)
    tok = server.gateway.tokenizer

    # greedy n = 2 on the adapter: two equal choices whose logprobs are PEFT's
    r = client.chat.completions.create(model="alpha", messages=MESSAGES, n=2, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    prompt = tok.encode(tok.chat_template.render(MESSAGES), add_special_tokens=False)
    ids, rows = greedy_with_logprobs(peft_model, prompt, 6)
    assert [c.message.content for c in r.choices] == [tok.decode(ids)] * 2 and r.usage.completion_tokens == 12
    for c in r.choices:
        for entry, t, row in zip(c.logprobs.content, ids, rows, strict=True):
            assert abs(entry.logprob - row[t].item()) < TOL
            assert all(abs(x.logprob - v) < TOL for x, v in zip(entry.top_logprobs, row.topk(2).values.tolist()))

    # seeded samples, streamed: both indexes interleave and equal the whole answer
    args = dict(model="alpha", prompt="The llama", n=2, seed=5, temperature=1.0, max_tokens=6,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args, logprobs=1)
    parts = list(client.completions.create(**args, logprobs=1, stream=True))
    order = [p.choices[0].index for p in parts if p.choices[0].text]
    assert sorted(set(order)) == [0, 1] and 0 in order[order.index(1):]
    for i in (0, 1):
        assert "".join(p.choices[0].text for p in parts if p.choices[0].index == i) == whole.choices[i].text
        assert [x for p in parts if p.choices[0].index == i for x in p.choices[0].logprobs.token_logprobs] == \
            whole.choices[i].logprobs.token_logprobs

    # best_of picks the candidate of highest cumulative logprob; echo puts the prompt first
    every = client.completions.create(**{**args, "n": 3}, logprobs=0)
    totals = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(**{**args, "n": 1}, best_of=3, echo=True)
    assert best.choices[0].text == "The llama" + every.choices[totals.index(max(totals))].text
    assert best.usage.completion_tokens == 18
    assert leases(fleet, tid) == 0
