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
    ({"n": 2}, "n must be 1"),
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


def test_from_dict():
    p = SamplingParams.from_dict({"max_tokens": 3, "temperature": 0.5, "stop_token_ids": [7]})
    assert (p.max_tokens, p.temperature, p.stop_token_ids) == (3, 0.5, [7])
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({"max_tokens": 3, "stop_strings": ["\n"], "beam_width": 2})
    msg = str(e.value)
    assert "unknown sampling parameter(s) 'beam_width', 'stop_strings'" in msg
    assert "valid: max_tokens, temperature, top_k, top_p, seed, stop_token_ids, ignore_eos, n" in msg
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams.from_dict({"max_tokens": 0})
