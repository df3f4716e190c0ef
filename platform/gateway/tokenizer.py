"""The gateway's tokenizer: prompts are tokenized here (quotas count exact prompt tokens; engines get ids).

Uses the ``tokenizers`` library on the base model's ``tokenizer.json`` (fast, no torch); falls back to
transformers' ``AutoTokenizer`` for folders without one. No tokenizer at all (``ENGINE_MODE=null`` without a
base model): prompts go to the engine as text and count as ``ceil(len(text) / 4)`` tokens.

Chat prompts (``chat_prompt``): the model's chat template, except for GPT-OSS (``model_type`` gpt_oss with the
harmony tokens), whose prompts are rendered in harmony (``loraplex.platform.inference.harmony``) with the
request's ``reasoning_effort`` and ``tools``; its requests also stop at ``<|return|>`` / ``<|call|>``
(``chat_sampling``) and its outputs are parsed into content, reasoning and tool calls (``output_parser``).
Other families get ``tools`` through ``platform/inference/tools/`` in their format (``format_for(model_type)``):
the template renders them (or the format's fallback text does), ``tool_choice`` "required" / named adds the
calls' grammar to the sampling fields, and the output is parsed for calls.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

from loraplex.platform.inference.chat_template import ChatTemplate
from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.tools import (ToolCallFeed, check_schemas, checked_size, format_for,
                                               harmony_tool_grammar, has_tool_history, structured_field,
                                               template_inputs, tool_request)


GIL_FREE_CHARS = 16 * 1024   # texts longer than this are tokenized without holding the GIL (``_encode``)


def model_type(folder: str | None) -> str | None:
    """``model_type`` of the folder's config.json (None without one)."""
    path = os.path.join(folder, "config.json") if folder else None
    if not path or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("model_type")


class PromptTokenizer:
    def __init__(self, folder: str | None) -> None:
        self._fast = None
        self._plain = None    # the same tokenizer with special tokens' text encoded as text (built when needed)
        self._hf = None
        self.chat_template = ChatTemplate.from_pretrained(folder) if folder else ChatTemplate(None)
        if folder and os.path.isfile(os.path.join(folder, "tokenizer.json")):
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
            self._json = os.path.join(folder, "tokenizer.json")
        elif folder and os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(folder)
        self.harmony = None
        self.tool_format = format_for(model_type(folder))
        if self.available and model_type(folder) == "gpt_oss":
            from loraplex.platform.inference.harmony import HarmonyChat

            self.harmony = HarmonyChat.for_model(folder, self)

    @property
    def available(self) -> bool:
        return self._fast is not None or self._hf is not None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; chat prompts pass ``add_special_tokens=False`` (templates add their own)."""
        if self._fast is not None:
            return _encode(self._fast, text, add_special_tokens=add_special_tokens)
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        raise RuntimeError("no tokenizer loaded")

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special token recognised (``"<|end|>"`` typed by a tenant stays text)."""
        if self._fast is not None:
            if self._plain is None:
                from tokenizers import Tokenizer

                self._plain = Tokenizer.from_file(self._json)
                self._plain.encode_special_tokens = True
            return _encode(self._plain, text, add_special_tokens=False)
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False, split_special_tokens=True))
        raise RuntimeError("no tokenizer loaded")

    def token_to_id(self, token: str) -> int | None:
        if self._fast is not None:
            return self._fast.token_to_id(token)
        if self._hf is not None:
            i = self._hf.convert_tokens_to_ids(token)
            return None if i is None or i == self._hf.unk_token_id else int(i)
        return None

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped (what ``echo`` returns for a token-id prompt)."""
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=True)
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=True)
        raise RuntimeError("no tokenizer loaded")

    def prompt(self, text: str, *, add_special_tokens: bool) -> tuple[str | list[int], int]:
        """(what the engine gets, prompt token count)."""
        if not self.available:
            return text, max(1, math.ceil(len(text) / 4))
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return ids, len(ids)

    # ---- chat ----
    def chat_prompt(self, body: Any) -> tuple[str | list[int], int]:
        """(what the engine gets, prompt token count) of a chat request: harmony for GPT-OSS, else the model's
        chat template (``ChatTemplateError`` when it refuses), with the request's tools in the family's format
        (``tools.template_inputs``). Bad tools, and ``reasoning_effort`` other than for GPT-OSS, are a 400 naming
        the field."""
        effort = getattr(body, "reasoning_effort", None)
        requested = tool_request(body)   # 400s naming the field
        tools = self._chat_tools(body)
        if self.harmony is None:
            if effort is not None:
                raise InferenceError(400, "'reasoning_effort' applies to reasoning models in the harmony format "
                                          "(GPT-OSS); this deployment's base model is not one: leave it unset",
                                     param="reasoning_effort", code="unsupported_parameter")
            if requested is None and not has_tool_history(body.messages):
                return self.prompt(self.chat_template.render(body.messages), add_special_tokens=False)
            if requested is not None and requested.forced:
                check_schemas(requested)
            template = self.chat_template
            messages, extra = template_inputs(body.messages, requested, self.tool_format,
                                              native=template.supports_tools,
                                              argument_text=template.takes_argument_text)
            return self.prompt(template.render(messages, **extra), add_special_tokens=False)
        if requested is not None and requested.forced:
            check_schemas(requested)
        if self.harmony.renderer is None:   # no o200k vocabulary: the model's own template, told the effort
            if tools:
                raise InferenceError(400, f"'tools' need the harmony renderer, which is unavailable here: "
                                          f"{self.harmony.vocab_error}", param="tools", code="unsupported_parameter")
            return self.prompt(self.chat_template.render(body.messages, reasoning_effort=effort or "medium"),
                               add_special_tokens=False)
        from loraplex.platform.inference.harmony import HarmonyRenderError

        try:
            ids = self.harmony.prompt(body.messages, tools=tools, reasoning_effort=effort)
        except HarmonyRenderError as e:
            raise InferenceError(400, str(e), param=e.param) from None
        return ids, len(ids)

    def chat_sampling(self, body: Any = None) -> dict[str, Any]:
        """Engine sampling fields a chat request adds: harmony's stop tokens for GPT-OSS; for ``tool_choice``
        "required" or a named function, the grammar of the calls (``structured``; harmony's own for GPT-OSS)."""
        tools = tool_request(body) if body is not None else None
        forced = tools is not None and tools.forced
        if self.harmony is not None:
            grammar = {"structured": {"grammar": checked_size(harmony_tool_grammar(tools))}} if forced else {}
            return {"stop_token_ids": self.harmony.stop_token_ids, **grammar}
        return {"structured": structured_field(tools, self.tool_format)} if forced else {}

    def parses_output(self, body: Any) -> bool:
        """Whether chat completions of ``body`` go through ``output_parser`` (harmony, or tools offered)."""
        return self.harmony is not None or tool_request(body) is not None

    def output_parser(self, body: Any):
        """A fresh parser of one chat completion: ``harmony.TokenFeed`` for GPT-OSS, a ``ToolCallFeed`` in the
        family's format when tools were offered, else None."""
        if self.harmony is None:
            tools = tool_request(body)
            return ToolCallFeed(self.tool_format, functions=tools.names) if tools is not None else None
        tools = self._chat_tools(body)
        return self.harmony.parser(functions=[_tool_name(t) for t in tools] if tools else None)

    @staticmethod
    def _chat_tools(body: Any) -> list:
        """The request's tools unless ``tool_choice`` is "none" (then the model is not told of them)."""
        if getattr(body, "tool_choice", None) == "none":
            return []
        return list(getattr(body, "tools", None) or [])


def _encode(tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode(text).ids``. Past ``GIL_FREE_CHARS`` through ``encode_batch``, the same ids: ``encode``
    holds the GIL throughout (seconds for a few MB of text), which stalls the event loop even from a worker
    thread; ``encode_batch`` releases it."""
    if len(text) <= GIL_FREE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _tool_name(tool: Any) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else getattr(tool, "function", None)
    return (fn.get("name") if isinstance(fn, dict) else getattr(fn, "name", "")) or ""
