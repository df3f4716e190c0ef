"""Tenant module patterns (``engine/lora/patterns.py``): the same answers as PEFT's own rule
(``re.match(rf"(.*\\.)?({P})$", key)``) on benign patterns, literal ones without RE2 (the GPU image has none), and
clear refusals for what RE2 cannot run."""
from __future__ import annotations

import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.lora.format import AdapterFormatError, parse_adapter_config
from loraplex.engine.lora.patterns import PatternError, compile_suffix_pattern, is_literal

KEYS = [f"model.layers.{i}.{t}" for i in (0, 1, 7, 12) for t in
        ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj", "mlp.experts.gate_up_proj")]


def peft_rule(pattern: str, key: str) -> bool:
    return re.match(rf"(.*\.)?({pattern})$", key) is not None


LITERAL_CHARS = st.sampled_from(list("qkvo_projmlayers0123456789.-") + ["\\."])


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(body=st.lists(LITERAL_CHARS, min_size=1, max_size=30), anchor=st.booleans(), dollar=st.booleans(),
       key=st.sampled_from(KEYS) | st.text(alphabet="qkvo_projmlayers0123456789.", max_size=40))
def test_literal_patterns_follow_peft_exactly(body, anchor, dollar, key):
    pattern = ("^" if anchor else "") + "".join(body) + ("$" if dollar else "")
    assert is_literal(pattern)
    assert compile_suffix_pattern(pattern, where="rank_pattern")(key) == peft_rule(pattern, key), (pattern, key)


@pytest.mark.parametrize("pattern", [r"layers\.[0-3]\.self_attn\.q_proj", r".*\.down_proj", r"(q|k)_proj",
                                     r"model\.layers\.1[0-9]?\..*", r"^model\.layers\.\d+\.mlp\.experts\..*",
                                     r"[kv]_proj$", r"(?:self_attn|mlp)\.(q_proj|down_proj)", "gate_up_proj"])
def test_regex_patterns_match_like_peft(pattern):
    matches = compile_suffix_pattern(pattern, where="rank_pattern")
    for key in KEYS:
        assert matches(key) == peft_rule(pattern, key), (pattern, key)


@pytest.mark.parametrize("pattern,reason", [("(?=q)q_proj", "not supported"), (r"(q)\1", "not supported"),
                                            ("q_proj(", "not supported"), ("x" * 300, "256-character limit"),
                                            ("", "non-empty"), ("q\ud800", "lone surrogate")])
def test_refused_patterns_name_the_field_and_pattern(pattern, reason):
    with pytest.raises(PatternError) as e:
        compile_suffix_pattern(pattern, where="rank_pattern")
    assert "rank_pattern" in str(e.value) and reason in str(e.value)


def test_without_re2_literal_patterns_work_and_regexes_are_refused_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "re2", None)          # import re2 -> ImportError, as on the GPU image
    config = parse_adapter_config({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"],
                                   "rank_pattern": {"^model.layers.0.self_attn.q_proj": 2, "v_proj": 8}})
    assert config.rank_for("model.layers.0.self_attn.q_proj") == 2
    assert config.rank_for("model.layers.1.self_attn.q_proj") == 4
    assert config.rank_for("model.layers.3.self_attn.v_proj") == 8
    with pytest.raises(AdapterFormatError) as e:
        parse_adapter_config({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"],
                              "rank_pattern": {r"layers\.[0-3]\.q_proj": 2}})
    assert e.value.code == "bad_pattern" and "google-re2" in str(e.value) and "layers" in str(e.value)


def test_first_pattern_in_file_order_wins():
    config = parse_adapter_config({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"],
                                   "rank_pattern": {"q_proj": 2, r"layers\.0\..*": 8}})
    assert config.rank_for("model.layers.0.self_attn.q_proj") == 2
    assert config.rank_for("model.layers.0.self_attn.k_proj") == 8
