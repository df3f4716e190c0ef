from __future__ import annotations

import pytest

from loraplex.engine.sampling_params import SamplingParams


def test_defaults_and_greedy():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.n, p.seed) == (16, 1.0, 0, 1.0, 1, None)
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0).temperature == 0.0


@pytest.mark.parametrize("kwargs, text", [
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"temperature": -0.1}, "temperature must be in [0, inf), got -0.1"),
    ({"temperature": float("nan")}, "temperature must be in [0, inf)"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_k": -2}, "top_k must be -1 or 0 (off) or >= 1, got -2"),
    ({"seed": -1}, "seed must be in [0, 2**63), got -1"),
    ({"stop_token_ids": [1, "x"]}, "stop_token_ids must be an integer, got 'x'"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"n": 3, "best_of": 2}, "best_of must be >= n (3), got 2"),
    ({"n": 2, "temperature": 0}, "greedy decoding (temperature 0) would make all 2 sequences equal"),
    ({"min_p": 1.5}, "min_p must be in [0, 1] (0 = off), got 1.5"),
    ({"min_p": "x"}, "min_p must be a number"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, inf) (1 = off), got 0.0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2] (0 = off), got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2] (0 = off), got -3"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in [0, max_tokens=10], got 20"),
    ({"min_tokens": -1}, "min_tokens must be in [0, max_tokens=16], got -1"),
    ({"stop": ["ok", ""]}, "stop contains an empty string"),
    ({"stop": [3]}, "stop must be a string or a list of strings, got [3]"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be a bool"),
    ({"logprobs": 21}, "logprobs must be None (off) or in [0, 20], got 21"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be None (off) or in [0, 20], got -1"),
    ({"beam_width": 2}, "beam_width is set but use_beam_search is False"),
    ({"use_beam_search": True, "beam_width": 2, "n": 3}, "beam_width (2) must be >= n (3)"),
    ({"use_beam_search": True, "top_p": 0.9}, "top_p cannot be combined with use_beam_search"),
    ({"use_beam_search": True, "stop": ["x"]}, "stop cannot be combined with use_beam_search"),
    ({"use_beam_search": 1}, "use_beam_search must be a bool"),
    ({"early_stopping": "sometimes"}, "early_stopping must be True, False or 'never', got 'sometimes'"),
    ({"early_stopping": 1}, "early_stopping must be True, False or 'never', got 1"),
    ({"length_penalty": float("inf")}, "length_penalty must be in (-inf, inf) (finite), got inf"),
])
def test_invalid_values_name_the_field_and_range(kwargs, text):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert text in str(e.value)


def test_top_k_minus_one_and_zero_are_off():
    assert not SamplingParams(top_k=-1).top_k_enabled
    assert not SamplingParams(top_k=0).top_k_enabled
    assert SamplingParams(top_k=5).top_k_enabled


def test_verify_against_vocab():
    SamplingParams(stop_token_ids=[0, 99]).verify(100)
    with pytest.raises(ValueError, match=r"stop_token_ids contains 100, outside the vocabulary \[0, 100\)"):
        SamplingParams(stop_token_ids=[3, 100]).verify(100)
    with pytest.raises(ValueError, match="top_k=101 exceeds the vocabulary size 100"):
        SamplingParams(top_k=101).verify(100)


def test_decoding_features_defaults_and_derived_values():
    p = SamplingParams()
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_tokens) == (0, 1, 0, 0, 0)
    assert (p.stop, p.logprobs, p.prompt_logprobs, p.best_of, p.use_beam_search) == ([], None, None, None, False)
    assert p.num_sequences == 1 and not p.needs_token_history
    assert SamplingParams(n=2, best_of=5).num_sequences == 5
    assert SamplingParams(n=4, seed=3).num_sequences == 4
    beams = SamplingParams(use_beam_search=True, n=2, best_of=3)
    assert beams.beam_width == 3 and beams.num_sequences == 3
    assert SamplingParams(use_beam_search=True, beam_width=4, temperature=0).num_sequences == 4
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]  # one string is a list of one, as in OpenAI's API
    assert SamplingParams(repetition_penalty=1.2).needs_token_history
    assert SamplingParams(min_tokens=2).needs_token_history
    assert SamplingParams(early_stopping="never").early_stopping == "never"


def test_from_dict():
    p = SamplingParams.from_dict({"max_tokens": 3, "temperature": 0.5, "stop_token_ids": [7]})
    assert (p.max_tokens, p.temperature, p.stop_token_ids) == (3, 0.5, [7])
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({"max_tokens": 3, "stop_strings": ["\n"], "beam_size": 2})
    msg = str(e.value)
    assert "unknown sampling parameter(s) 'beam_size', 'stop_strings'" in msg
    assert "valid: max_tokens, temperature, top_k, top_p, seed, stop_token_ids, ignore_eos, n, min_p" in msg
    new = {"min_p": 0.1, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
           "min_tokens": 2, "stop": ["END"], "include_stop_str_in_output": True, "logprobs": 5, "prompt_logprobs": 0,
           "n": 2, "best_of": 3, "length_penalty": 0.7, "early_stopping": True}
    q = SamplingParams.from_dict(new)
    assert all(getattr(q, k) == v for k, v in new.items())
    r = SamplingParams.from_dict({"use_beam_search": True, "beam_width": 4, "temperature": 0})
    assert (r.use_beam_search, r.beam_width) == (True, 4)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams.from_dict({"max_tokens": 0})
