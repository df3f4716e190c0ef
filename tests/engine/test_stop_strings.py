from __future__ import annotations

import pytest

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.stop_strings import StopStringMatcher
from loraplex.engine.testing.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(300)


def stream(tok, text, stop, include=False):
    """Feed ``text`` token by token, as the engine will; returns (emitted pieces, stop string, steps used)."""
    ids = tok.encode(text)
    detok, m = IncrementalDetokenizer(tok), StopStringMatcher(stop, include)
    pieces = []
    for n in range(1, len(ids) + 1):
        r = m.append(detok.update(ids[:n]))
        pieces.append(r.new_text)
        if r.stopped:
            return pieces, r.stop_str, n
    pieces.append(m.flush())
    return pieces, None, len(ids)


def test_stop_string_split_over_tokens_is_found_and_cut(tok):
    text = "Hello world! The answer is 42. Bye"
    stop = "answer is"
    ids = tok.encode(text)
    # the stop string really spans a token boundary with this tokenizer
    assert not any(stop in tok.decode([i]) for i in ids)
    pieces, hit, steps = stream(tok, text, [stop])
    assert hit == stop and "".join(pieces) == "Hello world! The "
    assert steps < len(ids)  # stopped in the step that completed it
    assert stop in tok.decode(ids[:steps]) and stop not in tok.decode(ids[:steps - 1])


def test_include_stop_str_in_output(tok):
    pieces, hit, _ = stream(tok, "Hello world! The answer is 42.", ["answer is"], include=True)
    assert hit == "answer is" and "".join(pieces) == "Hello world! The answer is"


def test_no_stop_flushes_the_held_back_tail(tok):
    pieces, hit, _ = stream(tok, "The quick brown fox ans", ["answer"])
    assert hit is None and "".join(pieces) == "The quick brown fox ans"
    assert pieces[-1].endswith("ans")  # "ans" could have grown into "answer": held back until the end


def test_first_completed_stop_wins_and_later_input_is_ignored():
    m = StopStringMatcher(["abcd", "bc"])
    assert m.append("xa").new_text == "x"   # "a" may start "abcd"
    r = m.append("bcd")                      # "bc" completes before "abcd"
    assert (r.new_text, r.stop_str) == ("a", "bc")
    assert m.append("more").new_text == "" and m.text == "xa"
    m2 = StopStringMatcher(["\n\n", "END"])
    out = [m2.append(d).new_text for d in ["one\n", "\ntwo"]]
    assert out == ["one", ""] and m2.stop_str == "\n\n" and m2.text == "one"


def test_no_stop_strings_passes_everything_through():
    m = StopStringMatcher([])
    assert [m.append(d).new_text for d in ["a", "b"]] == ["a", "b"] and m.flush() == ""
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        StopStringMatcher([""])
