"""Incremental parser of a GPT-OSS completion in the harmony format (what the model writes after the prompt's
``<|start|>assistant``), turned into OpenAI's chat fields as it streams::

    <|channel|>analysis<|message|>User asks 2+2.<|end|>                         -> reasoning
    <|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>           -> content (a preamble)
    <|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a":2}<|call|>
                                                                                 -> tool call "add", arguments
    <|start|>assistant<|channel|>final<|message|>4<|return|>                     -> content

``HarmonyParser`` takes the stream as ordinary text (``push_text``) and harmony markers (``push_marker``); two
front ends feed it: ``TokenFeed`` (token ids; each special token is one id, so markers are never split) and
``TextFeed`` (text that spells the markers out, split anywhere: a possible marker prefix is held back).

Routing of a message's body, by its header (the recipient ``to=...`` may sit in the role or the channel part):
``analysis`` -> reasoning; ``final`` and ``commentary`` without recipient -> content; ``commentary`` to
``functions.NAME`` of a function the request offered -> a tool call; anything else (unknown channel or
recipient, a header that never closes, text outside any message) degrades to content, never to an error.
``<|return|>`` ends with finish reason "stop", ``<|call|>`` after a tool call with "tool_calls".
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
STOP_MARKERS = (RETURN, CALL)   # decode-time stop tokens of the format (``<|end|>`` only ends one message)
MAX_HEADER_CHARS = 256          # a header longer than this is not one: its text degrades to content
_RECIPIENT = re.compile(r"\bto=(\S+)")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A tool call's part of a delta: ``id`` and ``name`` in its first part only, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class HarmonyDelta:
    """What one push added: content, reasoning and tool-call parts (falsy when nothing)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def merge(self, other: "HarmonyDelta") -> "HarmonyDelta":
        self.content += other.content
        self.reasoning += other.reasoning
        for part in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == part.index and part.id is None:
                last.arguments += part.arguments
            else:
                self.tool_calls.append(ToolCallDelta(part.index, part.id, part.name, part.arguments))
        return self


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass(frozen=True)
class Header:
    """A parsed message header: role (empty for the first message, given by the prompt), channel, recipient,
    content type (``<|constrain|>json`` or a bare word)."""

    role: str = ""
    channel: str = ""
    recipient: str = ""
    content_type: str = ""

    @classmethod
    def parse(cls, parts: list[str]) -> "Header":
        role_part, channel_part, constrain_part, where = "", "", "", "role"
        for p in parts:
            if p == CHANNEL:
                where = "channel"
            elif p == CONSTRAIN:
                where = "constrain"
            elif where == "role":
                role_part += p
            elif where == "channel":
                channel_part += p
            else:
                constrain_part += p
        found = _RECIPIENT.search(role_part) or _RECIPIENT.search(channel_part)
        recipient = found.group(1) if found else ""
        role_words = _RECIPIENT.sub(" ", role_part).split()
        channel_words = _RECIPIENT.sub(" ", channel_part).split()
        content_type = constrain_part.strip() or (" ".join(channel_words[1:]) if len(channel_words) > 1 else "")
        return cls(role=role_words[0] if role_words else "", channel=channel_words[0] if channel_words else "",
                   recipient=recipient, content_type=content_type)


class HarmonyParser:
    """The state machine. ``functions``: names the request offered as tools (``None``: no tool calls are parsed,
    calls degrade to content). Results so far: ``content``, ``reasoning``, ``tool_calls``, ``finish_reason``
    ("stop" after ``<|return|>``, "tool_calls" after ``<|call|>`` that closed a tool call, else None: the
    engine's reason applies)."""

    def __init__(self, *, functions: Iterable[str] | None = None, call_id: Callable[[], str] = new_call_id) -> None:
        self.functions = frozenset(functions) if functions is not None else frozenset()
        self._call_id = call_id
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []
        self.finish_reason: str | None = None
        self._state = "header"           # header | body | between | raw | done
        self._header: list[str] = []     # texts and CHANNEL / CONSTRAIN markers of the open header
        self._header_chars = 0
        self._route = "content"          # body of the open message: content | reasoning | tool
        self.messages = 0                # messages whose header closed

    @property
    def finished(self) -> bool:
        """A stop marker came or ``finish()`` ran: further input is ignored."""
        return self._state == "done"

    # ---- input ----
    def push_text(self, text: str) -> HarmonyDelta:
        out = HarmonyDelta()
        if not text or self._state == "done":
            return out
        if self._state == "header":
            self._header.append(text)
            self._header_chars += len(text)
            if self._header_chars > MAX_HEADER_CHARS:   # not a header: the model writes plain text
                self._degrade_header(out)
            return out
        if self._state == "between":
            self._state = "raw"
        self._emit(out, text)
        return out

    def push_marker(self, marker: str) -> HarmonyDelta:
        out = HarmonyDelta()
        if self._state == "done":
            return out
        if self._state == "header":
            if marker in (CHANNEL, CONSTRAIN):
                self._header.append(marker)
                return out
            if marker == MESSAGE:
                self._open_body(Header.parse(self._header), out)
                return out
            if marker == START and not "".join(p for p in self._header if p not in (CHANNEL, CONSTRAIN)).strip():
                self._header, self._header_chars = [], 0   # an empty header restarted: nothing lost
                return out
            self._degrade_header(out)
        if marker == START:
            self._state, self._header, self._header_chars = "header", [], 0
        elif marker == END:
            self._state = "between"
        elif marker in STOP_MARKERS:
            was_tool = self._state == "body" and self._route == "tool"
            self.finish_reason = "tool_calls" if marker == CALL and was_tool else "stop"
            self._state = "done"
        # MESSAGE / CHANNEL / CONSTRAIN inside a body or between messages: dropped
        return out

    def finish(self) -> HarmonyDelta:
        """The stream ended (engine finish: stop token, EOS or length): flush an open header as content."""
        out = HarmonyDelta()
        if self._state == "header" and self._header:
            self._degrade_header(out)
        self._state = "done"
        return out

    # ---- internals ----
    def _open_body(self, header: Header, out: HarmonyDelta) -> None:
        self.messages += 1
        self._header, self._header_chars = [], 0
        self._state = "body"
        recipient = header.recipient
        if header.role not in ("", "assistant"):
            self._route = "content"       # the model wrote another role's message: keep its text visible
        elif recipient:
            name = recipient.removeprefix("functions.")
            if recipient.startswith("functions.") and name in self.functions:
                self._route = "tool"
                call = ToolCall(id=self._call_id(), name=name)
                self.tool_calls.append(call)
                out.tool_calls.append(ToolCallDelta(len(self.tool_calls) - 1, call.id, call.name))
            else:
                self._route = "content"   # an unknown recipient: degrade to content
        elif header.channel == "analysis":
            self._route = "reasoning"
        else:
            self._route = "content"       # final, commentary (preamble), unknown channels

    def _emit(self, out: HarmonyDelta, text: str) -> None:
        route = self._route if self._state == "body" else "content"
        if route == "reasoning":
            self.reasoning += text
            out.reasoning += text
        elif route == "tool":
            self.tool_calls[-1].arguments += text
            out.merge(HarmonyDelta(tool_calls=[ToolCallDelta(len(self.tool_calls) - 1, arguments=text)]))
        else:
            self.content += text
            out.content += text

    def _degrade_header(self, out: HarmonyDelta) -> None:
        text = "".join(p for p in self._header if p not in (CHANNEL, CONSTRAIN))
        self._header, self._header_chars = [], 0
        self._state = "raw"
        if text:
            self._emit(out, text)


class TextFeed:
    """Feeds a parser from text that spells the markers out (``"...<|end|><|start|>assistant..."``), in pieces
    split anywhere: a piece's tail that may begin a marker (``"<"``, ``"<|cha"``) waits for the next piece."""

    def __init__(self, parser: HarmonyParser) -> None:
        self.parser = parser
        self._held = ""

    def push(self, text: str) -> HarmonyDelta:
        out = HarmonyDelta()
        buf, self._held = self._held + text, ""
        while buf:
            at = buf.find("<|")
            if at < 0:
                keep = 1 if buf.endswith("<") else 0
                out.merge(self.parser.push_text(buf[:len(buf) - keep]))
                self._held = buf[len(buf) - keep:]
                return out
            out.merge(self.parser.push_text(buf[:at]))
            buf = buf[at:]
            marker = next((m for m in MARKERS if buf.startswith(m)), None)
            if marker is not None:
                out.merge(self.parser.push_marker(marker))
                buf = buf[len(marker):]
            elif any(m.startswith(buf) for m in MARKERS):
                self._held = buf   # a marker may be arriving
                return out
            else:
                out.merge(self.parser.push_text(buf[:2]))
                buf = buf[2:]
        return out

    def finish(self) -> HarmonyDelta:
        out = self.parser.push_text(self._held)
        self._held = ""
        return out.merge(self.parser.finish())


class TokenFeed:
    """Feeds a parser from token ids: ``markers`` maps the harmony special tokens' ids to their text; other ids
    are decoded with ``decode`` (a byte-level decoder, special tokens skipped), holding back a trailing
    incomplete UTF-8 character until the next id completes it. Each id is decoded once."""

    def __init__(self, parser: HarmonyParser, *, markers: dict[int, str], decode: Callable[[list[int]], str]) -> None:
        self.parser = parser
        self.markers = markers
        self.decode = decode
        self._pending: list[int] = []   # ids whose text ends in an incomplete character

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.parser.tool_calls

    @property
    def finish_reason(self) -> str | None:
        return self.parser.finish_reason

    @property
    def finished(self) -> bool:
        return self.parser.finished

    def push_output(self, output) -> HarmonyDelta:
        """Take an engine ``OutputDelta`` (its token ids)."""
        return self.push(output.token_ids)

    def push(self, token_ids: Iterable[int]) -> HarmonyDelta:
        out = HarmonyDelta()
        for t in token_ids:
            marker = self.markers.get(t)
            if marker is None:
                self._pending.append(t)
                text = self.decode(self._pending)
                if not text.endswith("\ufffd"):
                    self._pending = []
                    out.merge(self.parser.push_text(text))
                continue
            out.merge(self._flush())
            out.merge(self.parser.push_marker(marker))
        return out

    def finish(self) -> HarmonyDelta:
        return self._flush().merge(self.parser.finish())

    def _flush(self) -> HarmonyDelta:
        if not self._pending:
            return HarmonyDelta()
        text, self._pending = self.decode(self._pending), []
        return self.parser.push_text(text)
