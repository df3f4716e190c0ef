"""Scheduler.update of a verify entry, driven directly with token lists that run past a stop (the verifier cuts
them first; the scheduler must stop at the same token on its own): the tokens appended, the status, the computed
count, the score, the tenant's charge and the blocks released equal appending the tokens one at a time with the
stop checks after each."""
from __future__ import annotations

import pytest

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.logprobs import TokenLogprob
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.sequence import Sequence, SequenceGroup, SequenceStatus

EOS, STOP = 7, 9
PROMPT = [11, 12, 13, 14, 15, 16]  # block size 4: the verify entry's slots cross a block boundary


def one_at_a_time(prompt, outputs, tokens, max_tokens, max_model_len, ignore_eos):
    """The reference: each token appended, then EOS / a stop token / the length limits checked."""
    outputs = list(outputs)
    for i, t in enumerate(tokens):
        outputs.append(t)
        if (not ignore_eos and t == EOS) or t == STOP:
            return outputs, SequenceStatus.FINISHED_STOPPED, i + 1
        if len(outputs) >= max_tokens or len(prompt) + len(outputs) >= max_model_len:
            return outputs, SequenceStatus.FINISHED_LENGTH, i + 1
    return outputs, SequenceStatus.RUNNING, len(tokens)


@pytest.mark.parametrize("tokens, max_tokens, max_model_len, ignore_eos", [
    ([21, 22, 23, 24], 50, 64, False),   # all kept
    ([21, EOS, 23, 24], 50, 64, False),  # EOS in the middle
    ([21, EOS, 23, 24], 50, 64, True),   # ... ignored
    ([21, 22, STOP, EOS], 50, 64, True),  # a stop token
    ([21, 22, 23, 24], 3, 64, False),    # max_tokens reached at the third (one output before the step)
    ([21, 22, EOS, 24], 3, 64, False),   # EOS and max_tokens at the same token: stopped
    ([21, 22, 23, 24], 50, 9, False),    # max_model_len reached at the second
    ([EOS], 50, 64, False),              # the target's token only
])
@pytest.mark.parametrize("with_logprobs", [False, True])
def test_update_verified_stops_like_one_token_at_a_time(tokens, max_tokens, max_model_len, ignore_eos,
                                                        with_logprobs):
    sched = Scheduler(SchedulerConfig(max_model_len=max_model_len, eos_token_ids=[EOS]),
                      KVCacheManager(16, 4, enable_prefix_caching=True))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, stop_token_ids=[STOP])
    seq = Sequence(1, "r", PROMPT)
    sched.add(SequenceGroup("r", [seq], params, arrival_time=0.0, tenant="t"))
    out = sched.schedule()  # the prefill
    sched.update(out, {seq.seq_id: 30}, {seq.seq_id: [TokenLogprob(30, -0.25, 1)]} if with_logprobs else None)
    seq.spec_token_ids = tokens[:-1]
    out = sched.schedule()
    (entry,) = out.scheduled
    assert entry.draft_token_ids == tokens[:-1] and entry.num_new_tokens == len(tokens)
    charged = sched._groups["r"].tenant_state.output_tokens
    logprobs = [TokenLogprob(t, -0.5 - 0.125 * i, 1) for i, t in enumerate(tokens)]
    sched.update(out, {seq.seq_id: list(tokens)}, {seq.seq_id: logprobs} if with_logprobs else None)

    want, status, n = one_at_a_time(PROMPT, [30], tokens, max_tokens, max_model_len, ignore_eos)
    assert seq.output_token_ids == want
    assert seq.status is status
    assert sched._groups.get("r") is None or sched._groups["r"].tenant_state.output_tokens == charged + n
    score = 0.0
    for lp in ([-0.25] + [e.logprob for e in logprobs[:n]] if with_logprobs else []):
        score += lp
    assert seq.cumulative_logprob == score
    if status is SequenceStatus.RUNNING:
        assert seq.num_computed_tokens == seq.num_tokens - 1
        assert len(seq.block_ids) == sched.kv.num_blocks_for(seq.num_tokens)  # rejected drafts' slots released
    else:
        assert seq.block_ids == []
    sched.kv.check_invariants()


def test_append_tokens_matches_append_token():
    a, b = Sequence(1, "a", [1, 2]), Sequence(2, "b", [1, 2])
    for t, lp in zip([5, 6, 7], [-0.1, -0.2, -0.3]):
        a.append_token(t, lp)
    b.append_tokens([5, 6, 7], [-0.1, -0.2, -0.3])
    assert a.output_token_ids == b.output_token_ids == [5, 6, 7]
    assert a.cumulative_logprob == b.cumulative_logprob
    c, d = Sequence(3, "c", [1]), Sequence(4, "d", [1])
    c.cumulative_logprob = d.cumulative_logprob = -0.0
    d.append_tokens([])
    assert repr(d.cumulative_logprob) == "-0.0"  # nothing appended, nothing added
    c.append_token(8)
    c.append_token(9)
    d.append_tokens([8, 9])
    assert c.output_token_ids == d.output_token_ids and repr(c.cumulative_logprob) == repr(d.cumulative_logprob)
