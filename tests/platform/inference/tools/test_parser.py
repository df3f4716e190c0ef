"""The streaming tool-call parser: each family's calls out of the text, content around them, the same result
however the text is split, the stream's delta layout, and degradation of what is not a call to content."""
from __future__ import annotations

import json
import random

import pytest

from loraplex.platform.inference.tools import HERMES, LLAMA3_JSON, MISTRAL, ToolCallFeed

FUNCTIONS = {"get_weather", "add"}
W = ("get_weather", {"city": "Paris", "unit": "c"})
A = ("add", {"a": [1, {"b": "}]"}], "s": "quote \" brace {"})

CASES = [   # format, text, content, calls
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": [1, {"b": "}]"}], '
             '"s": "quote \\" brace {"}}'
             '\n</tool_call>', "Let me check.", [W, A]),
    (HERMES, '<tool_call>{"arguments": {"city": "Paris", "unit": "c"}, "name": "get_weather"}</tool_call> Done.',
     "Done.", [W]),                                           # arguments first: sent when the name closes
    (HERMES, 'Plain <tool and <b>text</b>  with  spaces.\n', 'Plain <tool and <b>text</b>  with  spaces.\n', []),
    (HERMES, 'Hi <tool_call>{"name": "nope", "arguments": {}}</tool_call> bye',
     'Hi <tool_call>{"name": "nope", "arguments": {}}</tool_call> bye', []),     # not an offered function
    (HERMES, 'x <tool_call>not json</tool_call>', 'x <tool_call>not json</tool_call>', []),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": [1, {\\"b\\": \\"}]\\"}], \\"s\\": '
             '\\"quote \\\\\\" brace {\\"}"}\n</tool_call>', "", [A]),         # arguments sent as a JSON string
    (LLAMA3_JSON, ' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; {"name": "add", '
                  '"parameters": {"a": [1, {"b": "}]"}], "s": "quote \\" brace {"}}', "", [W, A]),
    (LLAMA3_JSON, '{"answer": 42, "name": 3}', '{"answer": 42, "name": 3}', []),
    (LLAMA3_JSON, 'Use {"name": "add", "parameters": {}} here', 'Use {"name": "add", "parameters": {}} here', []),
    (LLAMA3_JSON, '{"name": "add"}', "", [("add", {})]),
    (MISTRAL, 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
              '{"name": "add", "arguments": {"a": [1, {"b": "}]"}], "s": "quote \\" brace {"}}] ', "Sure.", [W, A]),
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]', "", [W]),
    (MISTRAL, '[1, 2] is a list', '[1, 2] is a list', []),
]


def run(fmt, pieces):
    feed = ToolCallFeed(fmt, functions=FUNCTIONS)
    content, parts = "", []
    for p in pieces:
        d = feed.push(p)
        content += d.content
        parts += d.tool_calls
    d = feed.finish()
    return feed, content + d.content, parts + d.tool_calls


def calls_of(feed):
    return [(c.name, json.loads(c.arguments)) for c in feed.tool_calls]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_every_split_gives_the_same(fmt, text, content, calls):
    for pieces in ([text], list(text), [text[i:i + 3] for i in range(0, len(text), 3)],
                   *([text[:k], text[k:]] for k in range(1, len(text)))):
        feed, streamed, parts = run(fmt, pieces)
        assert (feed.content, calls_of(feed)) == (content, calls), pieces
        assert streamed == content
        assert feed.finish_reason == ("tool_calls" if calls else None)
        # the delta layout: per call, id and name first, then arguments only
        by_index: dict[int, str] = {}
        for p in parts:
            if p.index not in by_index:
                assert p.id and p.name and p.index == len(by_index)
                by_index[p.index] = p.arguments
            else:
                assert p.id is None and p.name is None
                by_index[p.index] += p.arguments
        assert [by_index[i] for i in sorted(by_index)] == [c.arguments for c in feed.tool_calls]


def test_arguments_stream_as_they_come():
    text = HERMES.calls_text([("get_weather", '{"city": "Paris", "unit": "c"}')])
    feed = ToolCallFeed(HERMES, functions=FUNCTIONS)
    parts = [feed.push(ch).tool_calls for ch in text]
    named_at = next(i for i, p in enumerate(parts) if p)
    assert text[:named_at + 1].endswith('"get_weather"')      # the name goes out as soon as its string closes
    assert sum(1 for p in parts if p and p[0].arguments) > 10   # then the arguments, piece by piece
    assert feed.tool_calls[0].id.startswith("call_")


def test_a_cut_call_keeps_what_came_and_the_engine_reason():
    feed, content, _ = run(HERMES, ['Ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'])
    assert content == "Ok" and [(c.name, c.arguments) for c in feed.tool_calls] == [("get_weather", '{"city": "Pa')]
    assert feed.finish_reason is None   # "length" stays
    feed, content, _ = run(HERMES, ["Ok <tool_call>\n{\"na"])
    assert content == 'Ok <tool_call>\n{"na' and not feed.tool_calls
    feed, content, _ = run(HERMES, ["Ok <tool_"])
    assert content == "Ok <tool_" and not feed.tool_calls


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_text_without_calls_is_kept_whole(fmt):
    rng = random.Random(0)
    alphabet = list('ab {}[]":,;\n\\') + ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", '"name"', "get_weather"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cut = rng.randint(0, len(text))
        feed, content, _ = run(fmt, [text[:cut], text[cut:]])   # never raises
        if not feed.tool_calls:
            assert content == text and feed.content == text
