"""Chat templates: the tokenizer's own (file or config), identical to transformers' rendering; the fallback."""
from __future__ import annotations

import json

import pytest

from loraplex.platform.inference import FALLBACK_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from loraplex.platform.inference.protocol import ChatMessage

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 6x7?"}]


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_tokenizer_template_matches_transformers(llama_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_path)
    expected = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    from_folder = ChatTemplate.from_pretrained(llama_path)
    assert not from_folder.is_fallback
    assert from_folder.render(MESSAGES) == expected
    assert ChatTemplate.from_tokenizer(tok).render(MESSAGES) == expected
    assert from_folder.render(MESSAGES, add_generation_prompt=False) == tok.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=False)
    # pydantic messages (text parts joined) render the same
    parts = [ChatMessage(role=m["role"], content=[{"type": "text", "text": m["content"]}]) for m in MESSAGES]
    assert from_folder.render(parts) == expected


def test_template_in_tokenizer_config_and_named_list(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                          {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]"
                                                          "{{ m.content }}{{ eos_token }}{% endfor %}"}]}))
    t = ChatTemplate.from_pretrained(str(tmp_path))
    assert t.render(MESSAGES[:2]) == "<s>[system]Be terse.</s>[user]Hi there</s>"


def test_fallback_when_the_tokenizer_has_none(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    t = ChatTemplate.from_pretrained(str(tmp_path))
    assert t.is_fallback and t.source == FALLBACK_CHAT_TEMPLATE
    assert t.render(MESSAGES[:2]) == "<s>System: Be terse.\n\nUser: Hi there\n\nAssistant:"
    assert ChatTemplate.from_pretrained(str(tmp_path / "missing")).render(MESSAGES[1:2]) == \
        "User: Hi there\n\nAssistant:"


def test_template_errors_are_clear():
    refusing = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from "
                            "the user') }}{% endif %}ok")
    with pytest.raises(ChatTemplateError, match="refused the conversation: first message must be from the user"):
        refusing.render(MESSAGES)
    broken = ChatTemplate("{{ messages[0].content.nope() }}")
    with pytest.raises(ChatTemplateError, match="failed to render"):
        broken.render(MESSAGES)
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.render(MESSAGES)
