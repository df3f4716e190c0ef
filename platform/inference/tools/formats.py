"""How each model family writes tool calls: the wrapper around a call's JSON, how calls and results in history
are written back, and the system-prompt text that tells a model without a tool-aware chat template about the tools.

    family (model_type)          a call                                                   several calls
    qwen3, qwen3_moe, qwen2      <tool_call>\\n{"name": N, "arguments": {..}}\\n</tool_call>   one block each, "\\n"
    llama (Llama 3.1 JSON)       {"name": N, "parameters": {..}}                          joined by "; "
    mixtral, mistral             [TOOL_CALLS] [{"name": N, "arguments": {..}}]            one list, ", "

Other model types use Hermes'. ``region_start`` opens the calls in the output (None: only at the start of the
output, where ``start_chars`` may begin them: Llama's ``{``, Mistral's ``[`` when the tokenizer drops the
``[TOOL_CALLS]`` special token's text), ``region_end`` closes them (None: the end of the output).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from loraplex.platform.inference.tools.request import Function


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    args_key: str                 # the arguments' key in a call object
    call_prefix: str              # before each call object (Hermes: "<tool_call>\n")
    call_suffix: str              # after each call object
    call_separator: str           # between two calls
    list_prefix: str              # before all the calls (Mistral: "[TOOL_CALLS] [")
    list_suffix: str              # after all the calls
    region_start: str | None      # what opens calls in the output (None: the output's start only)
    region_end: str | None        # what closes them (None: the end of the output)
    separators: str               # characters allowed between call objects, besides whitespace
    start_chars: str = ""         # at the output's start, these open calls without ``region_start``

    # ---- writing ----
    def call_object(self, name: str, arguments: str) -> str:
        """One call's JSON text, ``arguments`` being JSON text already."""
        return f'{{"name": {_dumps(name)}, "{self.args_key}": {arguments}}}'

    def calls_text(self, calls: Iterable[tuple[str, str]]) -> str:
        """The text of an assistant turn that made ``calls`` ((name, arguments JSON text) pairs)."""
        parts = [self.call_prefix + self.call_object(n, a or "{}") + self.call_suffix for n, a in calls]
        return self.list_prefix + self.call_separator.join(parts) + self.list_suffix

    def result_text(self, name: str, content: str) -> str:
        """A tool's result, as the user-turn text a template without tool support gets."""
        if self.name == "hermes":
            return f"<tool_response>\n{content}\n</tool_response>"
        if self.name == "mistral":
            return f"[TOOL_RESULTS] {_dumps({'name': name, 'content': content})} [/TOOL_RESULTS]"
        return f"Output of the function {name}: {content}"

    def system_prompt(self, functions: Iterable[Function]) -> str:
        """The tools as system-prompt text, in the family's own wording (for templates that do not take ``tools``)."""
        tools = [f.openai_tool() for f in functions]
        if self.name == "hermes":
            listed = "\n".join(_dumps(t) for t in tools)
            return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                    f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
                    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
        if self.name == "mistral":
            return (f"[AVAILABLE_TOOLS] {_dumps(tools)} [/AVAILABLE_TOOLS]\nTo call functions, answer with "
                    '[TOOL_CALLS] followed by a JSON list of {"name": <function-name>, "arguments": '
                    "<args-json-object>} objects.")
        listed = "\n\n".join(_dumps(t) for t in tools)
        return ("You have access to the following functions. To call a function, respond with only a JSON object "
                'of the form {"name": function name, "parameters": dictionary of argument name and its value}; '
                'separate several calls with "; ". Do not use variables.\n\n' + listed)


HERMES = ToolFormat("hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n", "", "", "<tool_call>",
                    "</tool_call>", "")
LLAMA3_JSON = ToolFormat("llama3_json", "parameters", "", "", "; ", "", "", "<|python_tag|>", None, ";",
                         start_chars="{")
MISTRAL = ToolFormat("mistral", "arguments", "", "", ", ", "[TOOL_CALLS] [", "]", "[TOOL_CALLS]", "]", "[,",
                     start_chars="[")

FORMATS_BY_MODEL_TYPE = {"qwen3": HERMES, "qwen3_moe": HERMES, "qwen2": HERMES, "qwen2_moe": HERMES,
                         "llama": LLAMA3_JSON, "mixtral": MISTRAL, "mistral": MISTRAL}


def format_for(model_type: str | None) -> ToolFormat:
    """The tool-call format of a ``model_type`` (Hermes' for any other)."""
    return FORMATS_BY_MODEL_TYPE.get(model_type or "", HERMES)
