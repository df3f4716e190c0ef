"""Incremental stop-string matching over detokenized text, also across token boundaries.

    feed deltas:   "Hel" | "lo, wor" | "ld\\n\\nBye"        stop = ["\\n\\n"]
    emitted:       "Hel" | "lo, wor" | "ld"  -> stopped        (the stop string is cut, and so is what follows)

Each delta is searched together with the last ``len(longest stop) - 1`` characters before it, so a stop string
split over several tokens is found in the step that completes it. While running, a tail of the text that could
still grow into a stop string is held back, so streamed text never has to be retracted; ``flush()`` releases it
when the sequence ends for another reason. With ``include_stop_str_in_output`` the matched string is kept and
nothing needs holding back.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    """The result of one ``append``: text to emit now, and the stop string that ended the output (or None)."""

    new_text: str
    stop_str: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None


class StopStringMatcher:
    """Feed each step's detokenized delta to ``append``; ``text`` is the output text emitted so far."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._full = ""      # all text received
        self._emitted = 0    # characters of _full already emitted
        self.stop_str: str | None = None

    @property
    def text(self) -> str:
        return self._full[:self._emitted]

    def append(self, delta: str) -> StopMatch:
        """Add ``delta`` and return what may be emitted now. After a stop, further input is ignored."""
        if self.stop_str is not None:
            return StopMatch("")
        scanned = len(self._full)
        self._full += delta
        match = self._find(max(0, scanned - self._max_len + 1))
        if match is not None:
            start, stop_str = match
            end = start + (len(stop_str) if self.include_stop_str_in_output else 0)
            self._full = self._full[:end]
            self.stop_str = stop_str
            return StopMatch(self._emit(end), stop_str)
        return StopMatch(self._emit(len(self._full) - self._held_back()))

    def flush(self) -> str:
        """The held-back tail, when the sequence finished without a stop string (EOS, length)."""
        return self._emit(len(self._full))

    def _find(self, search_from: int) -> tuple[int, str] | None:
        """The stop string whose first occurrence at or after ``search_from`` ends first (then starts first)."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = self._full.find(s, search_from)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        if self.include_stop_str_in_output:
            return 0
        for n in range(min(self._max_len - 1, len(self._full)), 0, -1):
            tail = self._full[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        new = self._full[self._emitted:upto]
        self._emitted = upto
        return new
