"""Tool calls parsed out of a completion's text as it streams, in the family's format (``formats.py``).

    feed = ToolCallFeed(HERMES, functions={"get_weather"})
    feed.push_output(output_delta) -> HarmonyDelta(content, tool_calls=[ToolCallDelta(index, id, name, arguments)])
    feed.finish() -> HarmonyDelta            then: feed.tool_calls, feed.finish_reason ("tool_calls" | None)

Text outside the calls is ``content``, as it comes; whitespace next to a call is dropped (a reply that is only
calls has no content). A call's id and name go out as soon as its name closes, then its arguments' text in pieces.
A possible beginning of the family's wrapper (``"<tool_"``) is held back until the next piece says what it is.
Nothing here fails a request: a call object that is not one (no ``name``, a function the request did not offer,
broken JSON before the name) comes back as content, wrapper included. A call object still open at the end (the
``max_tokens`` cut) keeps what streamed, and the finish reason stays the engine's ("length"); otherwise a
completion with calls finishes with "tool_calls".
"""
from __future__ import annotations

from typing import Any, Iterable

from loraplex.platform.inference.harmony.parser import HarmonyDelta, ToolCall, ToolCallDelta, new_call_id
from loraplex.platform.inference.tools.formats import ToolFormat
from loraplex.platform.inference.tools.scanner import CallScanner


class ToolCallFeed:
    """One completion's parser: ``functions`` are the names the request lets it call (others stay content);
    results so far in ``content`` and ``tool_calls``; ``call_id`` makes each call's id."""

    def __init__(self, fmt: ToolFormat, *, functions: Iterable[str], call_id=new_call_id) -> None:
        self.fmt = fmt
        self.functions = frozenset(functions)
        self._call_id = call_id
        self.tool_calls: list[ToolCall] = []
        self._content_parts: list[str] = []
        self.finished = False
        self._state = "text"          # text | region | object
        self._held = ""               # a possible marker's beginning, waiting for the next piece
        self._space = ""              # whitespace not yet known to be content
        self._after_call = False      # the last thing was a call: leading whitespace is dropped
        self._seen_text = False       # content other than whitespace came (start_chars no longer open calls)
        self._raw = ""                # the open region's text since its last call (content if it is not a call)
        self._raw_space = ""          # whitespace held when the region opened
        self._scanner: CallScanner | None = None
        self._open: ToolCall | None = None
        self._region_calls = 0        # calls the open region made

    @property
    def content(self) -> str:
        return "".join(self._content_parts)

    @property
    def finish_reason(self) -> str | None:
        """ "tool_calls" once finished with calls and none left open; None: the engine's reason applies."""
        return "tool_calls" if self.finished and self.tool_calls and self._open is None else None

    # ---- input ----
    def push_output(self, output: Any) -> HarmonyDelta:
        """Take an engine ``OutputDelta`` (its text)."""
        return self.push(output.text)

    def push(self, text: str) -> HarmonyDelta:
        out = HarmonyDelta()
        if self.finished:
            return out
        buf, self._held = self._held + text, ""
        i = 0
        while i < len(buf):
            if self._state == "text":
                i = self._text(buf, i, out)
            elif self._state == "region":
                i = self._region(buf, i, out)
            else:
                i = self._object(buf, i, out)
            if i < 0:              # a marker may be arriving: hold the rest
                break
        return out

    def finish(self) -> HarmonyDelta:
        """The completion ended: flush what was held (an unclosed non-call region comes back as content)."""
        out = HarmonyDelta()
        if self.finished:
            return out
        held, self._held = self._held, ""
        if self._state == "text":
            self._content(out, held)
        else:
            self._raw += held
            if self._state == "object" and self._open is None:
                self._degrade(out)
            elif self._state == "region" and self._raw.strip().strip(self.fmt.separators).strip():
                self._degrade(out)     # an opened region with something that is not a call in it
        if not self.tool_calls and self._space:
            out.content += self._space
            self._content_parts.append(self._space)
        self._space = ""
        self.finished = True
        return out

    # ---- states ----
    def _text(self, buf: str, i: int, out: HarmonyDelta) -> int:
        start = self.fmt.region_start
        if start:
            if buf.startswith(start, i):
                self._open_region(start)
                return i + len(start)
            if buf[i] == start[0] and start.startswith(buf[i:]):
                self._held = buf[i:]
                return -1
        if not self._seen_text and self.fmt.start_chars:
            if buf[i] in self.fmt.start_chars:
                self._open_region("")
                return i                # the region takes the character
            self._content(out, buf[i])
            return i + 1
        end = buf.find(start[0], i + 1) if start else -1
        end = len(buf) if end < 0 else end
        self._content(out, buf[i:end])  # a run up to the next possible marker
        return end

    def _region(self, buf: str, i: int, out: HarmonyDelta) -> int:
        end = self.fmt.region_end
        if end:
            if buf.startswith(end, i):
                if not self._region_calls:   # an empty region ("<tool_call></tool_call>") is text
                    self._raw += end
                    self._degrade(out)
                    return i + len(end)
                self._state, self._raw, self._raw_space = "text", "", ""
                self._after_call = bool(self.tool_calls)
                return i + len(end)
            if buf[i] == end[0] and end.startswith(buf[i:]):
                self._held = buf[i:]
                return -1
        ch = buf[i]
        if ch.isspace() or ch in self.fmt.separators:
            self._raw += ch
            return i + 1
        if ch == "{":
            self._raw += ch
            self._scanner = CallScanner()
            self._state = "object"
            return i + 1
        self._degrade(out)             # not calls after all: the region's text is content, ``ch`` too
        return i

    def _object(self, buf: str, i: int, out: HarmonyDelta) -> int:
        ch = buf[i]
        self._raw += ch
        scanner = self._scanner
        status = scanner.feed(ch)
        if self._open is None and scanner.has_name:
            if scanner.name in self.functions:
                self._open = ToolCall(id=self._call_id(), name=scanner.name)
                self.tool_calls.append(self._open)
                out.tool_calls.append(ToolCallDelta(len(self.tool_calls) - 1, self._open.id, self._open.name))
            else:
                self._degrade(out)     # an unknown function (or a name that is not a string): content
                return i + 1
        if self._open is not None:
            self._arguments(out, scanner.take_arguments())
        if status == "done":
            if self._open is None:
                self._degrade(out)     # an object without a name
                return i + 1
            self._close_call(out)
        elif status == "error":
            if self._open is None:
                self._degrade(out)
            else:                      # the call's object broke after its name: keep the call, the rest is text
                self._close_call(out)
                self._state = "text"
        return i + 1

    # ---- helpers ----
    def _open_region(self, marker: str) -> None:
        self._state, self._raw, self._raw_space, self._space = "region", marker, self._space, ""
        self._region_calls = 0

    def _close_call(self, out: HarmonyDelta) -> None:
        if not self._open.arguments:
            self._arguments(out, "{}")
        self._open, self._scanner = None, None
        self._state, self._raw, self._raw_space = "region", "", ""
        self._region_calls += 1
        self._after_call = True

    def _arguments(self, out: HarmonyDelta, text: str) -> None:
        if text:
            self._open.arguments += text
            out.merge(HarmonyDelta(tool_calls=[ToolCallDelta(len(self.tool_calls) - 1, arguments=text)]))

    def _degrade(self, out: HarmonyDelta) -> None:
        """The open region is not (or no longer) calls: its text goes out as content."""
        raw, space = self._raw, self._raw_space
        self._state, self._raw, self._raw_space, self._scanner = "text", "", "", None
        if self._after_call and not raw.strip():
            return                     # only whitespace after a call: dropped
        self._space = space if not self._after_call else ""
        self._after_call = False
        self._content(out, raw)

    def _content(self, out: HarmonyDelta, text: str) -> None:
        """Text that is content; whitespace at its end waits for what follows (dropped before a call)."""
        body = text.rstrip()
        if not body:
            self._space += text
            return
        piece = body.lstrip() if self._after_call else self._space + body
        self._space = text[len(body):]
        self._after_call, self._seen_text = False, True
        out.content += piece
        self._content_parts.append(piece)
