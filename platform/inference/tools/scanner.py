"""A streaming scanner of one call object, ``{"name": "get_weather", "arguments": {...}}``, fed a character at a
time (after its opening ``{``): it reports the name once its string closes and the arguments' text as it arrives.

    scanner = CallScanner(args_keys=("arguments", "parameters"))
    scanner.feed(ch) -> "more" | "done" | "error"      after each: scanner.name, scanner.take_arguments()

Only the object's top level is parsed (keys, and where each value ends: strings, nesting, escapes); the
arguments' text is passed on as the model wrote it. An arguments value that is a JSON string (some models quote
the object) is given back decoded, once it closes. Keys other than the name and the arguments are skipped.
"""
from __future__ import annotations

import json

_PRIMITIVE = set("-+.0123456789eEtruefalsn")


class _Value:
    """Where one JSON value ends: ``feed(ch)`` -> True while ``ch`` belongs to it; ``done`` once it closed."""

    def __init__(self, first: str) -> None:
        self.kind = "container" if first in "{[" else "string" if first == '"' else "primitive"
        self.depth = 1 if self.kind == "container" else 0
        self.in_string = self.kind == "string"
        self.escaped = False
        self.done = False

    def feed(self, ch: str) -> bool:
        if self.kind == "primitive":
            if ch in _PRIMITIVE:
                return True
            self.done = True
            return False
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.kind == "string":
                    self.done = True
            return True
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.done = True
        return True


class CallScanner:
    def __init__(self, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.args_keys = args_keys
        self.state = "key"            # key | key_string | colon | value_start | value | after_value | done | error
        self.key = ""
        self._escaped = False
        self._value: _Value | None = None
        self._value_text = ""
        self.name: str | None = None  # once its string closed (None when it is not a string)
        self.has_name = False
        self.arguments_kind: str | None = None
        self.arguments_done = False
        self._arguments = ""          # text not yet taken

    def take_arguments(self) -> str:
        """The arguments' text that came since the last call (a string-valued one only once it closed)."""
        if self.arguments_kind == "string" and not self.arguments_done:
            return ""
        text, self._arguments = self._arguments, ""
        return text

    def feed(self, ch: str) -> str:
        """Take one character: "more", "done" (the object closed) or "error" (it is not a call object)."""
        if self.state in ("done", "error"):
            return self.state
        if self.state == "value":
            if self._value.feed(ch):
                self._value_text += ch
                if self._is_arguments() and self._value.kind != "string":
                    self._arguments += ch
                if self._value.done:
                    self._end_value()
                return "more"
            self._end_value()          # a primitive ended before ``ch``
        if self.state == "key_string":
            if self._escaped:
                self._escaped = False
                self.key += ch
            elif ch == "\\":
                self._escaped = True
                self.key += ch
            elif ch == '"':
                try:
                    self.key = json.loads(f'"{self.key}"')
                except ValueError:
                    return self._fail()
                self.state = "colon"
            else:
                self.key += ch
            return "more"
        if ch.isspace():
            return "more"
        if self.state == "key":
            if ch == '"':
                self.key, self.state = "", "key_string"
            elif ch == "}":
                self.state = "done"
            else:
                return self._fail()
        elif self.state == "colon":
            if ch != ":":
                return self._fail()
            self.state = "value_start"
        elif self.state == "value_start":
            if ch not in '{["' and ch not in _PRIMITIVE:
                return self._fail()
            self._value, self._value_text, self.state = _Value(ch), ch, "value"
            if self._is_arguments():
                self.arguments_kind = self._value.kind
                if self._value.kind != "string":
                    self._arguments += ch
        elif self.state == "after_value":
            if ch == ",":
                self.state = "key"
            elif ch == "}":
                self.state = "done"
            else:
                return self._fail()
        return self.state if self.state == "done" else "more"

    def _is_arguments(self) -> bool:
        return self.key in self.args_keys and not self.arguments_done

    def _end_value(self) -> None:
        text = self._value_text
        if self.key == "name" and not self.has_name:
            self.has_name = True
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            self.name = value if isinstance(value, str) else None
        elif self._is_arguments():
            self.arguments_done = True
            if self._value.kind == "string":
                try:
                    self._arguments = json.loads(text)
                except ValueError:
                    self._arguments = text
        self.state = "after_value"

    def _fail(self) -> str:
        self.state = "error"
        return "error"
