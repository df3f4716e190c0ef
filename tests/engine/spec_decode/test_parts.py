"""The pieces of speculative decoding on their own: settings, prompt lookup, the replay plan, trimming a sequence's
blocks, the counters, the opt-out field on the wire, and the ``loraplex engine serve`` flags."""
from __future__ import annotations

import numpy as np
import pytest

from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec_decode import SpeculativeConfig, acceptance_rate_for, expected_acceptance_length
from loraplex.engine.spec_decode.ngram import NgramProposer, find_continuation
from loraplex.engine.spec_decode.proposer import SpecSequence
from loraplex.engine.spec_decode.replay import ReplayProposer
from loraplex.engine.spec_decode.stats import MAX_ADAPTERS, SpecDecodeStats


@pytest.mark.parametrize("bad, message", [
    (dict(method="eagle9"), "not supported"), (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=17), "num_speculative_tokens"), (dict(method="draft"), "needs draft_model"),
    (dict(draft_model="/d"), "use method='draft'"), (dict(ngram_min=3, ngram_max=2), "ngram_max"),
    (dict(replay_acceptance_rate=1.5), "replay_acceptance_rate"), (dict(verify_cuda_graphs="yes"), "bool"),
])
def test_settings_are_checked(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**bad)


def test_engine_config_takes_a_dict_and_refuses_tensor_parallel():
    cfg = EngineConfig(model="/m", speculative={"method": "ngram", "num_speculative_tokens": 5})
    assert cfg.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    with pytest.raises(ValueError, match="unknown speculative setting"):
        EngineConfig(model="/m", speculative={"method": "ngram", "k": 5})
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(model="/m", speculative={"method": "ngram"}, tensor_parallel_size=2)


def test_sampling_params_opt_out():
    assert SamplingParams().speculative is True
    assert SamplingParams.from_dict({"speculative": False}).speculative is False
    with pytest.raises(ValueError, match="speculative must be a bool"):
        SamplingParams(speculative="no")


def test_acceptance_rate_for_length():
    for k in (2, 3, 4):
        for length in (1.0, 2.0, 2.5, 3.0):
            if length <= k + 1:
                assert expected_acceptance_length(acceptance_rate_for(length, k), k) == pytest.approx(length, abs=1e-9)
    assert acceptance_rate_for(3.0, 3) == pytest.approx(0.8105, abs=1e-3)
    with pytest.raises(ValueError, match="raise k"):
        acceptance_rate_for(3.5, 2)


def test_prompt_lookup():
    t = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3], dtype=np.int64)
    assert find_continuation(t, 3, 1, 4) == [4, 5, 9]           # suffix "1 2 3" occurred at 0
    assert find_continuation(t, 2, 1, 2) == [4, 5]              # the longest n tried first: "2 3"
    t2 = np.array([7, 8, 7, 9, 7], dtype=np.int64)
    assert find_continuation(t2, 2, 1, 3) == [9, 7]             # "7": its most recent earlier occurrence
    assert find_continuation(np.array([1, 2, 3], dtype=np.int64), 3, 1, 3) == []
    seq = Sequence(1, "r", [5, 6, 5, 6, 5])
    prop = NgramProposer(k=4, n_min=1, n_max=3)
    got = prop.propose([SpecSequence(seq, "r", None, SamplingParams(), None, num_draft_tokens=2)])
    assert got[0].token_ids == [6, 5] and got[0].probs is None
    seq.append_token(6)                                          # the history follows the sequence incrementally
    assert prop.propose([SpecSequence(seq, "r", None, SamplingParams(), None, 4)])[0].token_ids == [5, 6]
    prop.release(1)
    assert prop.stats()["sequences"] == 0


def test_replay_plan():
    prop = ReplayProposer(k=3, rate=0.5, vocab_size=50, seed=1)
    rec = [10, 11, 12, 13, 14, 15, 16, 17]
    prop.record([1, 2], rec)
    seq = Sequence(1, "r", [1, 2])
    seq.append_token(10)
    seen = set()
    for _ in range(200):
        p = prop.propose([SpecSequence(seq, "r", None, SamplingParams(), None, 3)])[0]
        a = p.planned_num_accepted
        seen.add(a)
        assert len(p.token_ids) == 3 and p.token_ids[:a] == rec[1:1 + a] and p.planned_tokens == rec[1:2 + a]
        if a < 3:
            assert p.token_ids[a] != rec[1 + a]                 # the planted wrong draft
    assert seen == {0, 1, 2, 3}
    seq.append_token(99)                                         # left its recording: nothing to replay
    assert prop.propose([SpecSequence(seq, "r", None, SamplingParams(), None, 3)]) == [None]


def test_trim_releases_rejected_drafts_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    seq = Sequence(1, "r", list(range(10, 19)))                  # 9 tokens
    assert kv.allocate_slots(seq, 9)
    seq.num_computed_tokens = 8
    kv.cache_full_blocks(seq)
    assert kv.allocate_slots(seq, 1 + 4)                         # a verify: 1 + k = 5 slots, positions 8..12
    assert len(seq.block_ids) == 4
    seq.append_token(30)                                         # 0 drafts accepted + the target's token
    seq.num_computed_tokens = 9
    kv.cache_full_blocks(seq)
    kv.trim(seq)                                                 # 10 tokens: 3 blocks
    assert len(seq.block_ids) == 3 and kv.num_free_blocks == 7 and kv.num_cached_blocks == 2
    kv.trim(seq, 0)                                              # never below the computed tokens
    assert len(seq.block_ids) == 3
    kv.check_invariants()
    kv.free(seq)
    assert kv.num_free_blocks == 10


def test_counters_per_adapter_stay_bounded():
    stats = SpecDecodeStats()
    stats.record(None, 3, 2, 3)
    stats.record("t/a/1", 4, 0, 1)
    stats.record("t/a/1", 4, 4, 5)
    snap = stats.snapshot()
    assert snap["verified"] == 3 and snap["accepted"] == 6 and snap["acceptance_length"] == pytest.approx(3.0)
    a = next(r for r in snap["adapters"] if r["adapter"] == "t/a/1")
    assert a["acceptance_length"] == pytest.approx(3.0) and a["acceptance_rate"] == pytest.approx(0.5)
    for i in range(MAX_ADAPTERS + 5):
        stats.record(f"x/{i}", 1, 1, 2)
    snap = stats.snapshot()
    assert len(stats._adapters) == MAX_ADAPTERS and len(snap["adapters"]) == 16
    listed = sum(r["verified"] for r in snap["adapters"]) + snap["adapters_other"]["verified"]
    assert listed == snap["verified"] == 3 + MAX_ADAPTERS + 5


def test_engine_serve_flags(serve_speculative):
    assert serve_speculative() is None
    assert serve_speculative("--speculative-method", "draft", "--speculative-draft-model", "/d",
                             "--num-speculative-tokens", "5", "--speculative-verify-cuda-graphs") == \
        SpeculativeConfig(method="draft", draft_model="/d", num_speculative_tokens=5, verify_cuda_graphs=True)
    cfg = serve_speculative("--speculative-method", "ngram", "--speculative-ngram-max", "6")
    assert cfg.method == "ngram" and cfg.ngram_max == 6
    assert serve_speculative("--speculative-draft-model", "/d") is None  # no method: refused, nothing started
    assert serve_speculative.exit_codes[-1] == 2 and 2 not in serve_speculative.exit_codes[:-1]


def test_draft_model_padded_decode_path_matches_eager(tiny_checkpoint):
    """The draft's one-token forwards through the padded decode path (CUDA graphs on a GPU) propose what the eager
    path proposes; the draft's KV follows the target's accepted tokens and is released with the sequence."""
    import torch

    from loraplex.engine.spec_decode.draft_model import DraftModelProposer, DraftRunner

    path = tiny_checkpoint("qwen3_moe")
    seqs = [Sequence(i, f"r{i}", p) for i, p in enumerate([[5, 9, 33, 7, 81], [12, 40, 3], [77] * 9])]
    proposals = []
    for graphs in (False, True):
        runner = DraftRunner(path, device=torch.device("cpu"), dtype=torch.float32, block_size=4, max_model_len=64,
                             max_num_seqs=4, graphs=graphs)
        prop = DraftModelProposer(runner, k=3, vocab_size=320, max_batched_tokens=64)
        batch = [SpecSequence(s, s.request_id, None, SamplingParams(temperature=0.0), None, 3) for s in seqs]
        first = [p.token_ids for p in prop.propose(batch)]
        for s, d in zip(seqs, first):              # the target accepts one draft and adds a token of its own
            s.append_token(d[0])
            s.append_token(300)
        second = [p.token_ids for p in prop.propose(batch)]
        for s in seqs:
            del s.output_token_ids[:]
        runner.kv.check_invariants()
        assert prop.stats()["sequences"] == 3 and (runner.graphs is not None) == graphs
        for s in seqs:
            prop.release(s.seq_id)
        assert runner.kv.num_free_blocks == runner.kv.num_blocks
        proposals.append((first, second))
    assert proposals[0] == proposals[1] and all(len(d) == 3 for d in proposals[0][0])


def test_bad_proposals_are_refused(tiny_checkpoint):
    """A proposer that drafts ids outside the vocabulary or gives probabilities of the wrong shape is a clear error,
    not a corrupted step."""
    import torch

    from loraplex.engine.spec_decode.proposer import Proposal, Proposer
    from tests.engine.spec_decode.conftest import make_engine

    class Bad(Proposer):
        def __init__(self, proposal):
            self.proposal = proposal

        def propose(self, batch):
            return [self.proposal for _ in batch]

    for proposal, message in ((Proposal([5, 400]), "outside"), (Proposal([5, 6], torch.zeros(1, 320)), "shape"),
                              (Proposal([5], torch.zeros(1, 100)), "shape")):
        engine = make_engine(tiny_checkpoint("llama"), dict(method="ngram"))
        engine.spec.proposer = Bad(proposal)
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0))
        with pytest.raises(ValueError, match=message):
            for _ in range(4):
                engine.step()
