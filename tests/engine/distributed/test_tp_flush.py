"""Rank 0's step messages: every adapter load travels in a message of its own (full weights are hundreds of MB
at real sizes), everything else is batched, and the order of rank 0's calls is kept."""
from __future__ import annotations

from types import SimpleNamespace

from loraplex.engine.distributed.tp_runner import TPModelRunner


def _runner(sent: list) -> TPModelRunner:
    runner = TPModelRunner.__new__(TPModelRunner)  # only the journal and the group: no model needed
    runner._journal = []
    runner.tp = SimpleNamespace(broadcast_object=lambda obj=None: sent.append(list(obj)))
    return runner


def test_loads_are_sent_alone_and_in_order():
    sent: list = []
    runner = _runner(sent)
    runner._journal += [("clear", 1), ("load", 0, "A"), ("load", 1, "B"), ("tokens", None), ("blocks", [], [], [])]
    runner._flush(("forward", "ids"))
    assert sent == [[("clear", 1)], [("load", 0, "A")], [("load", 1, "B")],
                    [("tokens", None), ("blocks", [], [], []), ("forward", "ids")]]
    assert runner._journal == []
    sent.clear()
    runner._flush(("forward", "ids2"))  # nothing journaled: one message
    assert sent == [[("forward", "ids2")]]
