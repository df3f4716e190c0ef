"""Chat-template rendering from a tokenizer's own config, with a documented fallback.

Where the template comes from, first found wins (``ChatTemplate.from_pretrained(folder)``):
  1. ``chat_template.jinja`` in the folder (what transformers >= 4.43 saves)
  2. ``chat_template.json`` ``{"chat_template": ...}``
  3. ``tokenizer_config.json`` ``"chat_template"`` (a string, or a list of ``{name, template}``: "default" wins)
  4. ``FALLBACK_CHAT_TEMPLATE``: one paragraph per message, ``"<Role>: <content>"``, then ``"Assistant:"``::

        <bos>System: You are terse.

        User: Hi

        Assistant:

Templates run in a sandboxed Jinja environment like transformers' (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``strftime_now``), with ``bos_token``/``eos_token`` from the tokenizer config. Templates add
the special tokens themselves: tokenize the rendered prompt with ``add_special_tokens=False``.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable

FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render; the message says why."""


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        return str(value.get("content") or "")
    return str(value) if value else ""


@lru_cache(maxsize=32)
def _compile(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ChatTemplateError(f"the model's chat template refused the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template: ``render(messages) -> prompt text``. ``is_fallback`` when the tokenizer had none."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.is_fallback = not source
        self.source = source or FALLBACK_CHAT_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _compile(self.source)

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads ``tools`` (then it renders the tools and tool turns itself)."""
        return not self.is_fallback and "tools" in self.source

    @property
    def takes_argument_text(self) -> bool:
        """Whether the template writes a tool call's ``arguments`` string as it is (Qwen's and Hermes' branch on
        ``arguments is string``); others serialise them with ``tojson`` and need the object."""
        return "arguments is string" in self.source

    @classmethod
    def from_pretrained(cls, folder: str) -> "ChatTemplate":
        """From a model/tokenizer folder (see the module docstring for the lookup order)."""
        config: dict = {}
        path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        source = None
        jinja = os.path.join(folder, "chat_template.jinja")
        js = os.path.join(folder, "chat_template.json")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                source = f.read()
        elif os.path.isfile(js):
            with open(js, encoding="utf-8") as f:
                source = json.load(f).get("chat_template")
        else:
            source = config.get("chat_template")
        if isinstance(source, list):  # named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        return cls(source, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "ChatTemplate":
        """From a loaded transformers tokenizer (its ``chat_template``, ``bos_token``, ``eos_token``)."""
        source = getattr(tokenizer, "chat_template", None)
        if isinstance(source, dict):
            source = source.get("default") or next(iter(source.values()), None)
        return cls(source, bos_token=getattr(tokenizer, "bos_token", None) or "",
                   eos_token=getattr(tokenizer, "eos_token", None) or "")

    def render(self, messages: Iterable[Any], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages`` (``ChatMessage`` models or ``{"role", "content"}`` dicts)."""
        plain = []
        for m in messages:
            if hasattr(m, "text") and callable(m.text):
                d = {"role": m.role, "content": m.text()}
                if getattr(m, "name", None):
                    d["name"] = m.name
            else:
                d = dict(m)
            plain.append(d)
        try:
            return self._template.render(messages=plain, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - a template bug must be a clear 400/500, not a traceback
            raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None
