"""Tool calling for chat completions outside harmony (Llama 3, Qwen3, Mixtral and others): the request's tools
(``request.py``), the family's call format (``formats.py``), the prompt (``prompt.py``), the grammar that enforces
``tool_choice`` "required" / a named function (``grammar.py``) and the output parser (``parser.py``)."""
from loraplex.platform.inference.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat, format_for
from loraplex.platform.inference.tools.grammar import (check_schemas, checked_size, harmony_tool_grammar,
                                                     structured_field, tool_grammar)
from loraplex.platform.inference.tools.parser import ToolCallFeed
from loraplex.platform.inference.tools.prompt import has_tool_history, template_inputs
from loraplex.platform.inference.tools.request import Function, ToolRequest, tool_request

__all__ = ["HERMES", "LLAMA3_JSON", "MISTRAL", "Function", "ToolCallFeed", "ToolFormat", "ToolRequest",
           "check_schemas", "checked_size", "format_for", "harmony_tool_grammar", "has_tool_history",
           "structured_field", "template_inputs", "tool_grammar", "tool_request"]
