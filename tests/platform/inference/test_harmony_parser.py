"""The harmony output parser: channels routed to reasoning / content / tool calls, the same result whatever the
split points of the stream (every character boundary of text, every token boundary of ids), agreement with
openai-harmony's own parser on well-formed outputs, and malformed outputs degrading to content."""
from __future__ import annotations

import pytest
from openai_harmony import Role

from loraplex.engine.testing.tiny_tokenizer import build_tiny_tokenizer
from loraplex.platform.inference.harmony import MARKERS, HarmonyParser, TextFeed, TokenFeed, load_encoding
from tests.utils.harmony_vocab import o200k_vocab_dir

REASONED = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
            '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>')
CALLED = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|>'
          '<|start|>assistant<|channel|>commentary<|message|>Checking the weather for you.<|end|>'
          '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
          '{"location":"San Francisco"}<|call|>')
CALLED_ROLE_RECIPIENT = ('<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.get_weather'
                         '<|channel|>commentary json<|message|>{"location": "東京"}<|call|>')
UNICODE = '<|channel|>analysis<|message|>考える 🙂<|end|><|start|>assistant<|channel|>final<|message|>答え: 四 🙂<|return|>'


def parse_text(text: str, pieces: list[int] | None = None, functions=("get_weather",)) -> HarmonyParser:
    """Parse ``text`` fed in pieces cut at ``pieces`` (character offsets); checks the deltas add up."""
    parser = HarmonyParser(functions=functions, call_id=lambda: "call_1")
    feed = TextFeed(parser)
    cuts = [0, *(pieces or []), len(text)]
    content = reasoning = args = ""
    for a, b in zip(cuts, cuts[1:]):
        d = feed.push(text[a:b])
        content, reasoning = content + d.content, reasoning + d.reasoning
        args += "".join(t.arguments for t in d.tool_calls)
    d = feed.finish()
    content, reasoning = content + d.content, reasoning + d.reasoning
    args += "".join(t.arguments for t in d.tool_calls)
    assert (content, reasoning) == (parser.content, parser.reasoning)
    assert args == "".join(c.arguments for c in parser.tool_calls)
    return parser


def result(p: HarmonyParser) -> tuple:
    return p.content, p.reasoning, [(c.name, c.arguments) for c in p.tool_calls], p.finish_reason


EXPECTED = {
    REASONED: ("2 + 2 = 4.", 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', [], "stop"),
    CALLED: ("Checking the weather for you.", "Need to use function get_weather.",
             [("get_weather", '{"location":"San Francisco"}')], "tool_calls"),
    CALLED_ROLE_RECIPIENT: ("", "Look it up.", [("get_weather", '{"location": "東京"}')], "tool_calls"),
    UNICODE: ("答え: 四 🙂", "考える 🙂", [], "stop"),
}


@pytest.mark.parametrize("text", list(EXPECTED))
def test_every_character_split(text):
    assert result(parse_text(text)) == EXPECTED[text]
    for i in range(len(text) + 1):
        assert result(parse_text(text, [i])) == EXPECTED[text], f"split at {i}: {text[:i]!r} | {text[i:]!r}"
    assert result(parse_text(text, list(range(1, len(text))))) == EXPECTED[text]   # one character at a time


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_tokenizer(320, harmony=True)


def token_feed(tiny, functions=("get_weather",)) -> TokenFeed:
    markers = {tiny.convert_tokens_to_ids(m): m for m in MARKERS}
    return TokenFeed(HarmonyParser(functions=functions, call_id=lambda: "call_1"), markers=markers,
                     decode=lambda ids: tiny.decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("text", list(EXPECTED))
def test_every_token_split(tiny, text):
    ids = tiny.encode(text, add_special_tokens=False)
    for i in range(len(ids) + 1):
        feed = token_feed(tiny)
        d = feed.push(ids[:i]).merge(feed.push(ids[i:])).merge(feed.finish())
        assert result(feed.parser) == EXPECTED[text], f"split at token {i}"
        assert d.content == feed.parser.content and d.reasoning == feed.parser.reasoning
    feed, seen = token_feed(tiny), []
    for t in ids:   # one id at a time: no delta ever holds half a character
        d = feed.push([t])
        seen.append(d.content + d.reasoning + "".join(c.arguments for c in d.tool_calls))
    feed.finish()
    assert not any("\ufffd" in s for s in seen)
    assert result(feed.parser) == EXPECTED[text]


def test_streamed_tool_call_deltas(tiny):
    feed = token_feed(tiny)
    parts = []
    for t in tiny.encode(CALLED, add_special_tokens=False):
        parts.extend(feed.push([t]).tool_calls)
    first = parts[0]
    assert (first.index, first.id, first.name, first.arguments) == (0, "call_1", "get_weather", "")
    assert all(p.id is None and p.name is None and p.index == 0 for p in parts[1:])
    assert "".join(p.arguments for p in parts) == '{"location":"San Francisco"}'


@pytest.fixture(scope="module")
def encoding(tmp_path_factory):
    return load_encoding(o200k_vocab_dir(str(tmp_path_factory.mktemp("o200k"))))


@pytest.mark.parametrize("text", list(EXPECTED))
def test_agrees_with_openai_harmony(encoding, text):
    """openai-harmony's parser (o200k ids, without the stop token) and ours read the same messages."""
    ids = encoding.encode(text, allowed_special="all")
    messages = encoding.parse_messages_from_completion_tokens(ids[:-1], Role.ASSISTANT)
    reasoning = "".join(m.content[0].text for m in messages if m.channel == "analysis")
    content = "".join(m.content[0].text for m in messages if m.channel in ("final", "commentary") and not m.recipient)
    calls = [(m.recipient.removeprefix("functions."), m.content[0].text) for m in messages if m.recipient]
    ours = parse_text(text)
    assert (ours.content, ours.reasoning, [(c.name, c.arguments) for c in ours.tool_calls]) == \
        (content, reasoning, calls)
    markers = {encoding.encode(m, allowed_special="all")[0]: m for m in MARKERS}
    feed = TokenFeed(HarmonyParser(functions=["get_weather"]), markers=markers, decode=encoding.decode)
    feed.push(ids)
    feed.finish()
    assert (feed.parser.content, feed.parser.reasoning) == (content, reasoning)


@pytest.mark.parametrize("text, functions, expected", [
    # no harmony at all (a plain-text adapter): everything is content, longer than a header can be
    ("Hello! " * 60, (), ("Hello! " * 60, "", [], None)),
    ("Just an answer.", (), ("Just an answer.", "", [], None)),
    # an unterminated channel (cut by max_tokens)
    ("<|channel|>analysis<|message|>Let me think about", (), ("", "Let me think about", [], None)),
    ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Par", (),
     ("Par", "Hm.", [], None)),
    # a header that never reaches <|message|>
    ("<|channel|>analysis then the model rambles", (), ("analysis then the model rambles", "", [], None)),
    # unknown recipient, function not offered, unknown channel: content
    ('<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"q":1}<|call|>', ("get_weather",),
     ('{"q":1}', "", [], "stop")),
    ('<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}<|call|>', ("get_weather",),
     ("{}", "", [], "stop")),
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>', (),
     ("{}", "", [], "stop")),
    ("<|channel|>secret<|message|>visible<|return|>", (), ("visible", "", [], "stop")),
    # another role's message, text between messages, markers out of place, anything after the stop token
    ("<|channel|>final<|message|>a<|end|>stray<|start|>user<|message|>b<|end|>", (), ("astrayb", "", [], None)),
    ("<|channel|>final<|message|>x<|channel|>y<|message|>z<|return|>after<|start|>assistant", (),
     ("xyz", "", [], "stop")),
    ("<|return|>", (), ("", "", [], "stop")),
    ("<|call|>", ("get_weather",), ("", "", [], "stop")),
    ("<|start|><|start|>assistant<|channel|>final<|message|>ok<|return|>", (), ("ok", "", [], "stop")),
])
def test_malformed_outputs_degrade_to_content(text, functions, expected):
    assert result(parse_text(text, functions=functions)) == expected
    for i in range(len(text) + 1):
        assert result(parse_text(text, [i], functions=functions)) == expected, f"split at {i}"
