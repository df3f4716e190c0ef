"""OpenAI chat messages -> a harmony conversation, rendered by ``openai-harmony`` (the reference renderer).

    system  <- SystemContent: model identity, "Knowledge cutoff", "Current date" (today, UTC, unless given),
               "Reasoning: <effort>" (default medium), "# Valid channels: analysis, commentary, final ..."
               (+ "Calls to these tools must go to the commentary channel: 'functions'." with tools)
    developer <- every OpenAI ``system`` / ``developer`` message, in order, joined by a blank line, as
               "# Instructions", and the ``tools`` as the ``functions`` namespace (TypeScript-like types)
    user      <- ``user``
    assistant <- ``reasoning_content`` -> analysis channel; ``content`` -> final channel (commentary when the
               message also calls tools: a preamble); each ``tool_calls`` entry -> commentary channel
               ``to=functions.NAME <|constrain|>json``, its arguments as the body
    functions.NAME to=assistant (commentary) <- ``tool`` (NAME from the ``tool_call_id`` of an earlier call, or
               the message's ``name``)

then ``<|start|>assistant`` for the completion. Earlier analysis is dropped as harmony drops it
(``auto_drop_analysis``): chain of thought before a turn's final answer is not shown back to the model.
"""
from __future__ import annotations

import os
import re
import threading
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, Iterable

REASONING_EFFORTS = ("low", "medium", "high")
DEFAULT_REASONING_EFFORT = "medium"
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ENV_LOCK = threading.Lock()


class HarmonyRenderError(ValueError):
    """The conversation cannot be rendered (the message names the field to fix); ``param`` is its path."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@lru_cache(maxsize=4)
def load_encoding(vocab_dir: str):
    """openai-harmony's ``HARMONY_GPT_OSS`` encoding with the vocabulary of ``vocab_dir`` (no download)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    from loraplex.platform.inference.harmony.vocab import ENV_BASE

    with _ENV_LOCK:   # harmony reads the folder from the environment, once, while loading
        before = os.environ.get(ENV_BASE)
        os.environ[ENV_BASE] = vocab_dir
        try:
            return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        finally:
            if before is None:
                os.environ.pop(ENV_BASE, None)
            else:
                os.environ[ENV_BASE] = before


def _field(m: Any, name: str) -> Any:
    return m.get(name) if isinstance(m, dict) else getattr(m, name, None)


def _text(m: Any) -> str:
    if hasattr(m, "text") and callable(m.text):
        return m.text()
    content = _field(m, "content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if isinstance(p, dict) else getattr(p, "text", "") for p in content)


def _call_parts(call: Any) -> tuple[str | None, str, str]:
    """(id, name, arguments) of an assistant message's ``tool_calls`` entry (dict or model)."""
    fn = _field(call, "function") or {}
    return _field(call, "id"), _field(fn, "name") or "", _field(fn, "arguments") or ""


def tool_descriptions(tools: Iterable[Any] | None) -> list:
    """OpenAI ``tools`` (``{"type": "function", "function": {name, description, parameters}}``) as harmony
    ``ToolDescription``s; anything else is a ``HarmonyRenderError`` naming the entry."""
    from openai_harmony import ToolDescription

    out = []
    for i, tool in enumerate(tools or ()):
        if _field(tool, "type") != "function" or _field(tool, "function") is None:
            raise HarmonyRenderError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                     param=f"tools.{i}")
        fn = _field(tool, "function")
        name = _field(fn, "name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise HarmonyRenderError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got "
                                     f"{name!r}", param=f"tools.{i}.function.name")
        params = _field(fn, "parameters")
        if params is not None and not isinstance(params, dict):
            raise HarmonyRenderError(f"tools[{i}].function.parameters must be a JSON Schema object",
                                     param=f"tools.{i}.function.parameters")
        out.append(ToolDescription.new(name, _field(fn, "description") or "", parameters=params or None))
    return out


def harmony_messages(messages: Iterable[Any], *, tools: Iterable[Any] | None = None,
                     reasoning_effort: str | None = None, current_date: str | None = None,
                     knowledge_cutoff: str | None = None, model_identity: str | None = None) -> list:
    """The harmony ``Message`` list of an OpenAI conversation (``ChatMessage`` models or dicts), system message
    first. ``current_date``: ``YYYY-MM-DD`` (default today, UTC)."""
    from openai_harmony import Author, DeveloperContent, Message, ReasoningEffort, Role, SystemContent

    effort = reasoning_effort or DEFAULT_REASONING_EFFORT
    if effort not in REASONING_EFFORTS:
        raise HarmonyRenderError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                                 param="reasoning_effort")
    date = current_date or datetime.now(timezone.utc).strftime("%Y-%m-%d")
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize())) \
        .with_conversation_start_date(date)
    if knowledge_cutoff:
        system = system.with_knowledge_cutoff(knowledge_cutoff)
    if model_identity:
        system = system.with_model_identity(model_identity)
    messages = list(messages)
    instructions = [t for t in (_text(m) for m in messages if _field(m, "role") in ("system", "developer")) if t]
    functions = tool_descriptions(tools)
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or functions:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if functions:
            dev = dev.with_function_tools(functions)
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        role = _field(m, "role")
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, _text(m)))
        elif role == "assistant":
            calls = [_call_parts(c) for c in (_field(m, "tool_calls") or ())]
            reasoning = _field(m, "reasoning_content") or _field(m, "reasoning")
            if reasoning:
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            content = _text(m)
            if content:
                out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel(
                    "commentary" if calls else "final"))
            for call_id, name, arguments in calls:
                if not FUNCTION_NAME.match(name):
                    raise HarmonyRenderError(f"messages[{i}].tool_calls: function name {name!r} is not valid",
                                             param=f"messages.{i}.tool_calls")
                if call_id:
                    call_names[call_id] = name
                out.append(Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel("commentary")
                           .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))
        elif role == "tool":
            name = call_names.get(_field(m, "tool_call_id") or "") or _field(m, "name")
            if not name:
                raise HarmonyRenderError(f"messages[{i}] (role tool) needs the tool_call_id of an earlier assistant "
                                         "tool call (or the function's name)", param=f"messages.{i}.tool_call_id")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), _text(m))
                       .with_channel("commentary").with_recipient("assistant"))
    return out


class HarmonyRenderer:
    """Renders conversations with openai-harmony's encoding: ``render_ids`` (o200k_harmony token ids, what a
    GPT-OSS checkpoint's own tokenizer gives for the same text) and ``render_text`` (the same, decoded)."""

    def __init__(self, encoding, vocab_dir: str | None = None) -> None:
        self.encoding = encoding
        self.vocab_dir = vocab_dir   # set: long conversations render in worker processes (``render_pool``)

    @classmethod
    def from_vocab_dir(cls, vocab_dir: str) -> "HarmonyRenderer":
        return cls(load_encoding(vocab_dir), vocab_dir)

    def render_ids(self, messages: Iterable[Any], **kw: Any) -> list[int]:
        """Token ids of the prompt, ending with ``<|start|>assistant`` (see ``harmony_messages`` for ``kw``). A
        conversation past ``render_pool.LONG_CHARS`` renders in a worker process when the renderer knows its
        vocabulary folder: harmony holds the GIL while it renders."""
        from loraplex.platform.inference.harmony import render_pool

        messages = list(messages)
        if self.vocab_dir is not None and render_pool.text_size(messages, kw) > render_pool.LONG_CHARS:
            ids = render_pool.render_ids(self.vocab_dir, messages, kw)
            if ids is not None:
                return ids
        return self.render_here(messages, **kw)

    def render_here(self, messages: Iterable[Any], **kw: Any) -> list[int]:
        """``render_ids`` in the calling thread."""
        from openai_harmony import Conversation, Role

        convo = Conversation.from_messages(harmony_messages(messages, **kw))
        try:
            return list(self.encoding.render_conversation_for_completion(convo, Role.ASSISTANT))
        except Exception as e:  # noqa: BLE001 - the renderer's refusal (e.g. a schema it cannot type) is a 400
            raise HarmonyRenderError(f"harmony could not render the conversation: {e}") from None

    def render_text(self, messages: Iterable[Any], **kw: Any) -> str:
        return self.encoding.decode_utf8(self.render_ids(messages, **kw))

    @property
    def stop_token_ids(self) -> list[int]:
        """``<|return|>`` and ``<|call|>`` in o200k_harmony ids."""
        return list(self.encoding.stop_tokens_for_assistant_actions())
