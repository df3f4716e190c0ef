from __future__ import annotations

import pytest

from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence, SequenceGroup, SequenceStatus


def test_fork_copies_the_stream_but_not_the_blocks():
    parent = Sequence(1, "r", [1, 2, 3])
    parent.append_token(7, logprob=-0.5)
    parent.num_computed_tokens, parent.block_ids, parent.status = 3, [4, 5], SequenceStatus.RUNNING
    child = parent.fork(2)
    assert (child.seq_id, child.parent_seq_id, child.request_id) == (2, 1, "r")
    assert child.all_token_ids == [1, 2, 3, 7] and child.num_computed_tokens == 3 and child.block_ids == []
    assert child.cumulative_logprob == -0.5 and child.status is SequenceStatus.RUNNING
    child.append_token(9, logprob=-1.0)
    assert parent.output_token_ids == [7] and child.cumulative_logprob == -1.5  # independent lists
    assert parent.fork().seq_id not in (1, 2)


def test_group_add_remove_and_best_of_ranking():
    g = SequenceGroup.from_prompt("r", [1, 2], SamplingParams(n=2, best_of=3))
    a = g.seq
    b, c = a.fork(), a.fork()
    g.add_seq(b)
    g.add_seq(c)
    with pytest.raises(ValueError, match=f"sequence {b.seq_id} is already in request 'r'"):
        g.add_seq(b)
    with pytest.raises(ValueError, match="sequence of request 'x' added to request 'r'"):
        g.add_seq(Sequence(99, "x", [1]))
    for s, lp in ((a, -3.0), (b, -1.0), (c, -2.0)):
        s.append_token(5, lp)
        s.status = SequenceStatus.FINISHED_STOPPED
    assert g.best_seqs(2) == [b, c] and g.is_finished()
    g.remove_seq(c)
    assert g.seqs == [a, b] and g.unfinished_seqs() == []
    assert g.seqs_with_status(SequenceStatus.FINISHED_STOPPED) == [a, b]
