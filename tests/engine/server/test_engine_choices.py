"""n > 1, logprobs and prompt logprobs over the engine's HTTP API (tiny llama, CPU float32): the chunks carry
every completion with its index and its tokens' logprobs (equal to log_softmax of the HF logits), the last chunk
the prompt's logprobs; plain requests keep the old chunk shape; the null engine answers the same shapes."""
from __future__ import annotations

import asyncio
import json

import httpx
import torch

from loraplex.engine.server.chunks import TokenTexts
from loraplex.platform.engines.http_client import HttpEngineClient
from loraplex.platform.engines.inprocess import InProcessEngineClient, NullEngineClient
from loraplex.platform.engines.messages import EngineChunk, EngineRequest

PROMPT = [5, 17, 42, 99, 7, 13]
TOL = 1e-4


async def _collect(client, request):
    return [c async for c in client.generate(request)]


def _by_index(chunks) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for c in chunks:
        for o in c.outputs:
            d = out.setdefault(o.index, {"ids": [], "lps": [], "reasons": [], "cum": 0.0})
            d["ids"] += o.token_ids
            d["lps"] += o.logprobs or []
            d["cum"] = o.cumulative_logprob
            if o.finish_reason:
                d["reasons"].append(o.finish_reason)
    return out


def test_n2_logprobs_and_prompt_logprobs_over_http_equal_hf(engine_server, llama_path):
    from transformers import AutoModelForCausalLM

    service, server = engine_server
    sampling = {"max_tokens": 5, "n": 2, "seed": 3, "temperature": 1.0, "ignore_eos": True, "logprobs": 2,
                "prompt_logprobs": 1}

    async def main():
        http = HttpEngineClient(server.url)
        try:
            return (await _collect(http, EngineRequest("r-n2", None, PROMPT, sampling)),
                    await _collect(InProcessEngineClient(service), EngineRequest("r-n2-in", None, PROMPT, sampling)))
        finally:
            await http.close()

    over_http, in_proc = asyncio.run(main())
    got = _by_index(over_http)
    assert sorted(got) == [0, 1] and got == _by_index(in_proc)
    assert got[0]["ids"] != got[1]["ids"]
    assert over_http[-1].completion_tokens == 10 and over_http[-1].prompt_tokens == len(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    for d in got.values():
        assert d["reasons"] == ["length"] and len(d["lps"]) == 5
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([PROMPT + d["ids"]])).logits[0].float(), dim=-1)
        for j, (t, e) in enumerate(zip(d["ids"], d["lps"])):
            row = logp[len(PROMPT) - 1 + j]
            assert e.id == t and abs(e.logprob - row[t].item()) < TOL
            assert e.rank == int((row > row[t]).sum()) + 1
            assert [x[0] for x in e.top] == row.topk(2).indices.tolist()
        assert abs(d["cum"] - sum(e.logprob for e in d["lps"])) < TOL
    prompt_lp = over_http[-1].prompt_logprobs
    assert all(c.prompt_logprobs is None for c in over_http[:-1])
    assert len(prompt_lp) == len(PROMPT) and prompt_lp[0] is None
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    for p in range(1, len(PROMPT)):
        assert prompt_lp[p].id == PROMPT[p] and abs(prompt_lp[p].logprob - logp[p - 1, PROMPT[p]].item()) < TOL
        assert len(prompt_lp[p].top) == 1


def test_plain_requests_keep_the_old_chunk_shape(engine_server):
    _, server = engine_server
    body = {"request_id": "r-plain", "prompt": PROMPT, "sampling": {"max_tokens": 3, "temperature": 0.0}}
    with httpx.stream("POST", f"{server.url}/v1/generate", json=body, timeout=30) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines and all("outputs" not in d and "prompt_logprobs" not in d for d in lines)
    assert set(lines[0]) == {"request_id", "token_ids", "text", "finished", "finish_reason", "prompt_tokens",
                             "completion_tokens", "cached_tokens"}
    # an old engine's chunk reads as one completion, index 0
    chunks = [EngineChunk.from_wire(d) for d in lines]
    assert [o.index for c in chunks for o in c.outputs] == [0] * len(chunks)
    assert [t for c in chunks for o in c.outputs for t in o.token_ids] == [t for d in lines for t in d["token_ids"]]
    assert chunks[-1].outputs[0].finish_reason == "length"


def test_split_character_tokens_carry_their_bytes(llama_path):
    from loraplex.engine.llm_engine import load_tokenizer

    tok = load_tokenizer(llama_path)
    texts = TokenTexts(tok)
    ids = tok.encode("é✓", add_special_tokens=False)
    raws = [texts.raw_bytes(i) for i in ids]
    assert any(r is not None for r in raws)   # a byte-level tokenizer splits these characters
    joined = b"".join(bytes(r) if r is not None else texts.text(i).encode() for i, r in zip(ids, raws))
    assert joined == "é✓".encode()
    assert texts.raw_bytes(tok.encode("the", add_special_tokens=False)[0]) is None


def test_null_engine_answers_n_and_logprobs():
    client = NullEngineClient(num_tokens=3)
    chunks = asyncio.run(_collect(client, EngineRequest("r-null", None, [4, 5, 6],
                                                        {"max_tokens": 3, "n": 2, "logprobs": 1,
                                                         "prompt_logprobs": 0})))
    got = _by_index(chunks)
    assert sorted(got) == [0, 1] and all(len(d["ids"]) == 3 and len(d["lps"]) == 3 for d in got.values())
    assert chunks[-1].completion_tokens == 6 and [e is None for e in chunks[-1].prompt_logprobs] == [True, False, False]
