"""``model`` parsing: adapter, adapter:version, adapter:alias, the base model."""
from __future__ import annotations

import pytest

from loraplex.platform.inference import ModelNameError, ModelTarget, parse_model

BASES = ["Qwen3-8B", "Qwen/Qwen3-8B"]


@pytest.mark.parametrize("model, target", [
    ("support-bot", ModelTarget(adapter="support-bot", alias="latest")),
    ("support-bot:3", ModelTarget(adapter="support-bot", version=3)),
    ("support-bot:prod", ModelTarget(adapter="support-bot", alias="prod")),
    ("v1.2_bot:canary-2", ModelTarget(adapter="v1.2_bot", alias="canary-2")),
    ("qwen3-8b", ModelTarget(base=True)),
    ("Qwen/Qwen3-8B", ModelTarget(base=True)),
    (" support-bot ", ModelTarget(adapter="support-bot", alias="latest")),
])
def test_forms(model, target):
    assert parse_model(model, base_names=BASES) == target


@pytest.mark.parametrize("model, message", [
    ("", "'model' must be an adapter name"),
    ("Support-Bot", "adapter names are lowercase letters"),
    ("bot:0", "versions start at 1"),
    ("bot:Prod", "after ':' put a version number or an alias"),
    ("bot:a:b", "after ':' put a version number or an alias"),
    ("bot:", "after ':' put a version number or an alias"),
])
def test_bad_names_say_what_is_expected(model, message):
    with pytest.raises(ModelNameError, match=message):
        parse_model(model, base_names=BASES)


def test_str():
    assert str(parse_model("a:2", base_names=[])) == "a:2" and str(parse_model("a", base_names=[])) == "a:latest"
