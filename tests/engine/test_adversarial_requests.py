"""Unusual and adversarial requests: refused at once with an error naming what to fix, or served correctly; the
engine loop never stalls on one, and nothing (KV blocks, requests) is left behind."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.sampler import Sampler
from loraplex.engine.structured.spec import StructuredOutput

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def make_engine(path: str, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
                                     max_model_len=64, progress=False, **kw)


def run(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.kv_cache.check_invariants()
    return finals


def assert_all_free(engine: LLMEngine) -> None:
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.scheduler.has_unfinished() and engine.num_unfinished_requests == 0


@pytest.mark.parametrize("temperature", [1e-50, 1e-300, 5e-324])
def test_tiny_positive_temperature_samples_the_argmax(temperature):
    """A positive temperature that is 0 in float32 (or makes logits / T overflow) is the greedy limit, not NaN
    probabilities (which drew token 0 every step)."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5], [-4.0, -1.0, -3.0, -1.5]])
    params = [SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_k=2, top_p=0.5,
                                                                      min_p=0.5)]
    probs = Sampler.probs(logits, params)
    assert torch.isfinite(probs).all()
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    assert Sampler(seed=0).sample(logits, params, [None, None]) == [1, 1]


def test_tiny_positive_temperature_matches_greedy_in_the_engine(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("qwen3"))
    want = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    for i, kw in enumerate([dict(temperature=1e-50), dict(temperature=1e-300, seed=3),
                            dict(temperature=5e-324, top_k=5, top_p=0.5, min_p=0.5)]):
        got = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, **kw))[0]
        assert got.output_token_ids == want.output_token_ids, (i, kw)
    assert len(set(want.output_token_ids)) > 1  # not the constant token NaN probabilities gave
    assert_all_free(engine)


@pytest.mark.parametrize("kw", [dict(n=10**30, temperature=1.0, seed=1),
                                dict(n=2, best_of=10**30, temperature=1.0, seed=1)])
def test_huge_n_is_refused_before_any_per_sequence_work(tiny_checkpoint, monkeypatch, kw):
    """add_request runs on the engine thread: a request for 10**30 sequences used to make one generator (or list
    entry) per sequence before the max_num_seqs check, stalling the loop for every tenant. It is refused at once."""
    engine = make_engine(tiny_checkpoint("qwen3"))

    def no_generator(seed):
        raise AssertionError("a generator was made for a request that is refused")

    monkeypatch.setattr(engine.runner, "make_generator", no_generator)
    with pytest.raises(ValueError, match=r"sequences \(n / best_of / beam_width\) but this engine runs at most "
                                         r"max_num_seqs=8"):
        engine.add_request("huge", PROMPT, SamplingParams(max_tokens=4, **kw))
    monkeypatch.undo()
    assert engine.num_unfinished_requests == 0
    engine.add_request("after", PROMPT, SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=1))
    out = run(engine)["after"]
    assert [len(c.output_token_ids) for c in out.outputs] == [3, 3]
    assert_all_free(engine)


def test_a_huge_token_id_prompt_is_refused_by_its_length_before_its_ids_are_checked(tiny_checkpoint):
    """The engine thread checks a prompt's ids one by one; a list of a million (one of them bad) is refused by its
    length first, so that check never runs over more than max_model_len ids."""
    engine = make_engine(tiny_checkpoint("qwen3"))
    huge = [5] * 1_000_000 + [-1]
    with pytest.raises(ValueError, match=r"^prompt has 1000001 tokens, which leaves no room to generate within "
                                         r"max_model_len=64"):
        engine.add_request("huge", huge, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, \d+\); got \[-1\]"):
        engine.add_request("bad", [5, -1], SamplingParams(max_tokens=2))
    assert engine.num_unfinished_requests == 0
    assert_all_free(engine)


def test_deeply_nested_json_schema_is_a_value_error_naming_it():
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="structured.json_schema is nested too deeply"):
        SamplingParams(max_tokens=4, structured=StructuredOutput(json_schema=schema))
    with pytest.raises(ValueError, match="structured.json_schema is nested too deeply"):
        SamplingParams.from_dict({"max_tokens": 4, "structured": {"json_schema": schema}})


@pytest.mark.parametrize("key", ["²", "1²", "-3", "x"])
def test_logit_bias_key_that_is_not_a_token_id_is_named(key):
    with pytest.raises(ValueError, match=r"logit_bias keys must be token ids \(integers >= 0\), got '"):
        SamplingParams(logit_bias={key: 1.0})
    assert SamplingParams(logit_bias={" 7 ": 1.0}).logit_bias == {7: 1.0}


@pytest.fixture
def null_client():
    from starlette.testclient import TestClient

    from loraplex.engine.server.app import ServiceHolder, create_app
    from loraplex.engine.server.null import NullEngineService

    with TestClient(create_app(ServiceHolder(service=NullEngineService())), raise_server_exceptions=False) as client:
        yield client


def test_http_deeply_nested_body_is_a_400(null_client):
    body = '{"request_id": "deep", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for route in ("/v1/generate", "/v1/adapters/load", "/v1/abort"):
        r = null_client.post(route, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (route, r.text)
        assert r.json()["error"] == {"message": "the request body is nested too deeply; flatten its JSON",
                                     "type": "invalid_request"}
    r = null_client.post("/v1/generate", json={"request_id": "ok", "prompt": [1, 2], "sampling": {"max_tokens": 2}})
    assert r.status_code == 200 and r.text.count("\n") == 2


@pytest.mark.parametrize("extra,needle", [
    ({"timeout_s": "abc"}, "'timeout_s' must be null or a number of seconds"),
    ({"timeout_s": -5}, "'timeout_s' must be null or a number of seconds"),
    ({"timeout_s": 1e300}, "'timeout_s' must be null or a number of seconds"),
    ({"timeout_s": True}, "'timeout_s' must be null or a number of seconds"),
    ({"wait": "no"}, "'wait' must be true or false, got 'no'"),
])
def test_http_adapter_load_options_are_checked(null_client, extra, needle):
    adapter = {"adapter_id": "t/a/1", "uri": "file:///adapters/a"}
    r = null_client.post("/v1/adapters/load", json={"adapter": adapter, "wait": True, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request" and needle in r.json()["error"]["message"]
    r = null_client.post("/v1/adapters/load", json={"adapter": adapter, "wait": True, "timeout_s": 2})
    assert r.status_code == 200 and r.json()["state"] == "ready"


def test_more_stop_strings_than_the_cap_are_refused():
    from loraplex.engine.sampling_params import MAX_STOP_STRINGS

    SamplingParams(max_tokens=4, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    with pytest.raises(ValueError, match=f"stop has {MAX_STOP_STRINGS + 1} strings; at most {MAX_STOP_STRINGS}"):
        SamplingParams(max_tokens=4, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])


@pytest.mark.parametrize("structured, needle", [
    (StructuredOutput(json_schema={"type": "object",
                                   "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}),
     "Too many items"),
    (StructuredOutput(grammar="start: " + " | ".join(f'"w{i}"' for i in range(20000))), "items; max is"),
])
def test_grammar_past_the_parsers_limits_is_an_invalid_request(tiny_checkpoint, structured, needle):
    """A grammar that compiles but outgrows llguidance's parser limits on its first token fails its request as an
    invalid request naming the field (the platform's 400), not an engine error; a plain request beside it runs."""
    engine = make_engine(tiny_checkpoint("llama"))
    engine.add_request("big", PROMPT, SamplingParams(max_tokens=8, temperature=0.0, structured=structured))
    engine.add_request("ok", PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    finals = run(engine)
    out = finals["big"]
    assert out.finish_reason == "error" and out.error_type == "invalid_request", (out.error_type, out.error)
    assert out.error.startswith(f"structured.{structured.kind}: the grammar is too large to run: ")
    assert needle in out.error and "\n" not in out.error and out.error.endswith("simplify it (fewer alternatives "
                                                                                "or properties)")
    assert len(finals["ok"].output_token_ids) == 4
    assert_all_free(engine)
    engine.close()
