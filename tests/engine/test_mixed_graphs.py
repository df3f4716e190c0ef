"""The padded static-buffer path of steps with prefill chunks (``MixedGraphs``, what its CUDA graphs replay), run
eagerly on CPU: greedy tokens identical to the eager path's and logits within float32 rounding, for every family
with two PEFT adapters (attention, and the experts on MoE families) and base requests mixed, prompts arriving while
others decode (chunked prefill, a prompt after a prefix-cache hit, steps padded to token buckets), overlapped
scheduling (inputs pending on the device) and speculative decoding (the verify rows beside a prompt); KV blocks
all free at the end. Which steps the path takes and refuses, with which LoRA step slots; capture bookkeeping with
torch.cuda faked; the padding sequence's rows in the attention kernels (reference and Triton, interpreted); the
flags. Capture itself needs CUDA: the tiny stages of benchmarks/engine/check_cuda_graphs.py."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from loraplex.engine import SamplingParams
from loraplex.engine.mixed_graphs import MixedGraphs, token_buckets
from loraplex.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from loraplex.engine.sequence import Sequence
from loraplex.engine.stats import engine_stats
from loraplex.engine.testing.tiny import FAMILIES
from loraplex.kernels import reference
from tests.engine.spec_decode.conftest import adapter_refs, assert_all_free, drive, make_engine, prompt_list

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
GRANULE = 8


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def workload(refs: dict) -> list[tuple]:
    prompts = prompt_list((6, 37, 4, 23, 9, 50), seed=11)  # 50 > the 48-token budget below: chunked
    prompts[4] = prompts[1][:32] + prompts[4] * 3  # r1's prefix (a prefix-cache hit), then repeats (drafts)
    adapters = ["a", None, "b", "a", None, "b"]
    lengths = [18, 9, 14, 11, 16, 7]
    return [(f"r{i}", prompts[i], SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True),
             refs[adapters[i]] if adapters[i] else None) for i in range(6)]


def run(path: str, refs: dict, tmp_path, tag: str, *, mixed: bool, spec: dict | None = None, **kw):
    engine = make_engine(path, spec, adapter_cache_dir=str(tmp_path / f"cache-{tag}"), max_num_batched_tokens=48,
                         **LORA, **kw)
    for ref in refs.values():
        assert engine.load_adapter(ref, wait=True) == "ready"
    runner = engine.runner
    steps = []  # per mixed step: (tokens, sequences, (bucket, LoRA step slots))
    if mixed:
        graphs = runner.init_mixed_graphs(capture=False, granule=GRANULE)
        step, run_bucket = graphs._step, graphs._run_bucket

        def record_step(ids, starts, counts, *rest):
            steps.append((int(counts.sum()), len(counts)))
            return step(ids, starts, counts, *rest)

        graphs._step = record_step
        graphs._run_bucket = lambda key: (steps.append(steps.pop() + (key,)), run_bucket(key))[1]
    logits = defaultdict(list)
    if not kw.get("async_scheduling"):  # (a logits hook keeps steps from overlapping)
        runner.logits_hook = lambda seqs, lg: [logits[s.request_id].append(lg[j].clone())
                                               for j, s in enumerate(seqs)]
    finals = drive(engine, workload(refs), arrivals={0: [0, 1], 3: [2, 3], 6: [4], 9: [5]})
    assert_all_free(engine)
    return engine, {rid: o.output_token_ids for rid, o in finals.items()}, logits, steps


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_steps_match_the_eager_path(family, tiny_checkpoint, peft_folders, tmp_path):
    path = tiny_checkpoint(family)
    refs = adapter_refs(peft_folders(path))
    _, want, want_logits, _ = run(path, refs, tmp_path, "eager", mixed=False)
    engine, got, got_logits, steps = run(path, refs, tmp_path, "mixed", mixed=True)
    assert got == want
    assert engine_stats(engine)["prefix_cache_hits"] >= 32  # r4's prompt starts after r1's cached prefix
    for rid, rows in want_logits.items():
        assert len(got_logits[rid]) == len(rows)
        err = max(rel_err(a, b) for a, b in zip(got_logits[rid], rows))
        assert err <= 1e-5, f"{family} {rid}: logits differ by {err} (relative)"
    # prompts computed beside decodes, padded up to a bucket, one of them a chunk of the 50-token prompt; the
    # steps' adapters read through 8 step slots (the eager steps' count, here max_num_seqs)
    assert steps and all(b >= t and slots in (0, 8) for t, _, (b, slots) in steps), steps
    assert any(b > t for t, _, (b, _) in steps) and any(n > 1 for _, n, _ in steps), steps
    assert any(t == 48 for t, _, _ in steps) and any(slots == 8 for _, _, (_, slots) in steps), steps
    assert engine.runner.mixed_graphs.num_steps == len(steps)
    assert engine.runner.lora.state.token_lora_idx is None and not engine.runner.lora.state.always_on


@pytest.mark.parametrize("family", ["gpt_oss", "llama"])
def test_mixed_steps_launched_behind_a_decode_in_flight(family, tiny_checkpoint, peft_folders, tmp_path):
    """Overlapped scheduling: a step with a prompt is enqueued before the decode step in flight is read back, so
    the decoding rows' inputs are still on the device (pending) when the mixed path writes its buffers."""
    path = tiny_checkpoint(family)
    refs = adapter_refs(peft_folders(path))
    _, want, _, _ = run(path, refs, tmp_path, "eager", mixed=False)
    engine, got, _, steps = run(path, refs, tmp_path, "async", mixed=True, async_scheduling=True)
    assert got == want
    assert engine.num_early_launched_steps > 0 and steps


@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
def test_verify_steps_with_a_prompt_take_the_mixed_path(family, tiny_checkpoint, peft_folders, tmp_path):
    path = tiny_checkpoint(family)
    refs = adapter_refs(peft_folders(path))
    _, want, _, _ = run(path, refs, tmp_path, "eager", mixed=False)
    spec = dict(method="ngram", num_speculative_tokens=3)
    engine, got, _, steps = run(path, refs, tmp_path, "spec", mixed=True, spec=spec)
    assert got == want
    executor = engine.spec.executor
    assert executor.num_mixed_steps > 0 and steps
    assert engine.spec.snapshot()["proposed"] > 0


def test_buckets_and_which_steps_run_padded(tiny_checkpoint):
    assert token_buckets(48, 8) == [8, 16, 24, 32, 40, 48]
    assert token_buckets(4096)[:3] == [128, 256, 384] and 2048 in token_buckets(4096)
    assert token_buckets(4096)[16:19] == [2304, 2560, 2816] and token_buckets(4096)[-2:] == [3840, 4096]
    assert token_buckets(5000)[-3:] == [4096, 4608, 5000] and token_buckets(100) == [100]
    with pytest.raises(ValueError, match="max_tokens and granule must be >= 1"):
        token_buckets(0)
    engine = make_engine(tiny_checkpoint("llama"))
    runner = engine.runner
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        MixedGraphs(runner, 64, 8, 64, capture=True)
    assert runner.init_mixed_graphs() is None and runner.num_mixed_cuda_graphs == 0  # CPU: no graphs by default
    graphs = runner.init_mixed_graphs(capture=False, granule=8)
    assert graphs.buckets == [8, 16, 24, 32, 40, 48, 56, 64] and graphs.seqs_in(8) == 2 and graphs.seqs_in(64) == 8
    assert graphs.bucket_for(5, 1) == 8 and graphs.bucket_for(9, 1) == 16
    assert graphs.bucket_for(9, 3) == 16 and graphs.bucket_for(13, 5) == 24  # 5 sequences need 20+ tokens
    assert graphs.bucket_for(9, 5) is None    # ... and 9 tokens padded to 24 would be more than doubled
    assert graphs.bucket_for(3, 7) is None   # 28+ tokens for 7 sequences: padding 3 tokens to 32 is too much
    assert graphs.bucket_for(65, 2) is None  # over the largest bucket

    def step(*entries):
        scheduled = []
        for i, (n_new, computed, extra) in enumerate(entries):
            seq = Sequence(i, f"r{i}", list(range(3, 3 + computed + n_new)))
            seq.num_computed_tokens = computed
            scheduled.append(ScheduledSequence(seq, n_new, [0, 1, 2, 3], sample=True, **extra))
        return SchedulerOutput(scheduled=scheduled)

    assert graphs.slot_counts == [0]  # no LoRA attached
    assert graphs.can_run(step((6, 0, {}), (1, 5, {})), None)
    assert not graphs.can_run(step((6, 0, {"prompt_logprobs": 1}), (1, 5, {})), None)
    assert not graphs.can_run(step((60, 0, {}), (8, 5, {})), None)
    assert not graphs.can_run(SchedulerOutput(scheduled=[]), None)
    assert not graphs.can_run(step((6, 0, {}), (1, 5, {})), {0: 1})  # an adapter, and no LoRA to run it
    assert graphs.can_run_entries([([5, 6, 7], 4, [0, 1]), ([8], 9, [2, 3, 4])], [-1, -1])
    assert not graphs.can_run_entries([([5] * 70, 0, list(range(20)))], [-1])
    with pytest.raises(ValueError, match="fits no bucket"):
        graphs.run_entries([([5] * 70, 0, list(range(20)))], [-1])
    with pytest.raises(ValueError, match="LoRA is not attached"):
        graphs.run(step((6, 0, {}), (1, 5, {})), {0: 1})


def test_lora_step_slots_pick_the_graph(tiny_checkpoint, tmp_path):
    """A step's adapters pick the graph's LoRA step slots as an eager step's would (0: none; then powers of two of
    at least 8, here capped at max_num_seqs = 16); past MAX_GRAPH_ADAPTERS adapters the step runs eagerly."""
    from loraplex.engine.mixed_graphs import MAX_GRAPH_ADAPTERS

    engine = make_engine(tiny_checkpoint("qwen3_moe"), max_num_seqs=32, max_num_batched_tokens=256,
                         adapter_cache_dir=str(tmp_path / "cache"), **{**LORA, "max_loras": 32})
    graphs = engine.runner.init_mixed_graphs(capture=False, granule=8)
    assert MAX_GRAPH_ADAPTERS == 16 and graphs.slot_counts == [0, 8, 16]
    assert [graphs.step_slots(list(range(k)) + [-1]) for k in (0, 1, 8, 9, 16, 17)] == [0, 8, 8, 16, 16, -1]
    assert graphs.bucket_for(40, 3, 8) == 40 and graphs.bucket_for(40, 3, 32) is None
    entries = [([5] * 6, 0, [0, 1]) for _ in range(17)]
    assert graphs.can_run_entries(entries, list(range(16)) + [-1])
    assert not graphs.can_run_entries(entries, list(range(17)))


def test_the_padding_sequence_attends_to_nothing():
    """A step's tokens, then a padding sequence owning the bucket's last tokens with no context, then empty
    sequences: real rows as attention over the real sequences alone, padded rows zero, the cache untouched by
    slot -1 -- in the torch reference and the Triton kernels (interpreted), with sinks and a sliding window."""
    from loraplex.kernels.paged_attention import paged_attention as triton_attention
    from loraplex.kernels.reshape_and_cache import reshape_and_cache as triton_cache

    g = torch.Generator().manual_seed(1)
    nb, bs, kv, d, q_heads = 8, 4, 2, 12, 6
    k_cache, v_cache = torch.randn(nb, bs, kv, d, generator=g), torch.randn(nb, bs, kv, d, generator=g)
    # sequence 0: a 5-token prompt chunk after 2 cached tokens (context 7); sequence 1: one decode (context 4);
    # sequence 2: the padding (tokens 6..9, context 0); sequences 3, 4: empty
    q = torch.randn(10, q_heads, d, generator=g)
    key, value = torch.randn(10, kv, d, generator=g), torch.randn(10, kv, d, generator=g)
    tables = torch.tensor([[2, 6, 0], [5, 0, 0], [0, 0, 0], [7, 7, 7], [7, 7, 7]], dtype=torch.int32)
    seq_lens = torch.tensor([7, 4, 0, 0, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 6, 10, 10, 10], dtype=torch.int32)
    slots = torch.tensor([2 * bs + 2, 2 * bs + 3, 6 * bs, 6 * bs + 1, 6 * bs + 2, 5 * bs + 3, -1, -1, -1, -1])
    sinks = torch.randn(q_heads, generator=g)
    for write, attend in ((reference.reshape_and_cache, reference.paged_attention), (triton_cache, triton_attention)):
        kc, vc = k_cache.clone(), v_cache.clone()
        write(key, value, kc, vc, slots)
        changed = (kc != k_cache).any(-1).any(-1).nonzero().tolist()
        assert changed == [[2, 2], [2, 3], [5, 3], [6, 0], [6, 1], [6, 2]]
        for kw in ({}, {"sinks": sinks, "sliding_window": 3}):
            out = attend(q, kc, vc, tables, seq_lens, qsl, 0.3, **kw)
            real = reference.paged_attention(q[:6], kc, vc, tables[:2], seq_lens[:2], qsl[:3], 0.3, **kw)
            assert torch.allclose(out[:6], real, atol=1e-5) and torch.equal(out[6:], torch.zeros_like(out[6:]))


@pytest.mark.parametrize("fail_key,budget_s", [(None, None), ((16, 8), None), (None, 1e-9)],
                         ids=["all", "failure", "budget"])
def test_capture_bookkeeping_with_fake_cuda(fail_key, budget_s, tiny_checkpoint, peft_folders, tmp_path,
                                            monkeypatch, caplog):
    """capture_all with torch.cuda faked (tests/engine/test_cuda_graphs.py): per token bucket one graph per LoRA
    step-slot count, the largest bucket first; replays give the eager path's tokens; a failed capture leaves no
    graphs and every step eager; a spent budget leaves the largest bucket's widest graph alone, which then serves
    the adapter steps it holds while the rest run eagerly."""
    from tests.engine.test_cuda_graphs import _FakeCuda

    caplog.set_level("INFO", logger="loraplex.engine.graph_capture")
    path = tiny_checkpoint("qwen3_moe")
    refs = adapter_refs(peft_folders(path))
    _, want, _, _ = run(path, refs, tmp_path, "eager", mixed=False)
    engine = make_engine(path, None, adapter_cache_dir=str(tmp_path / "cache-fake"), max_num_batched_tokens=48,
                         **LORA)
    for ref in refs.values():
        assert engine.load_adapter(ref, wait=True) == "ready"
    runner = engine.runner
    graphs = MixedGraphs(runner, 48, runner.max_num_seqs, runner.max_model_len, capture=False, granule=GRANULE)
    graphs.capture = True
    fake = _FakeCuda(graphs, fail_key)
    fake.install(monkeypatch)
    ok = graphs.capture_all(budget_s)
    runner.mixed_graphs = graphs if ok else None
    finals = drive(engine, workload(refs), arrivals={0: [0, 1], 3: [2, 3], 6: [4], 9: [5]})
    assert_all_free(engine)
    assert {rid: o.output_token_ids for rid, o in finals.items()} == want
    if fail_key is not None:
        assert not ok and not graphs.num_graphs
        assert "CUDA graph capture failed" in caplog.text and "running mixed-step steps eagerly" in caplog.text
        assert fake.captured == [(48, 8), (48, 0), (8, 8), (8, 0)]
    elif budget_s is not None:
        assert ok and fake.captured == [(48, 8)] and graphs.buckets == [48]
        assert graphs.bucket_for(40, 2, 8) == 48 and graphs.bucket_for(40, 2, 0) is None
        assert "capture budget of 0 s spent" in caplog.text and graphs.num_steps > 0
    else:
        assert ok and graphs.num_graphs == 12 and fake.forwards[:2] == [(48, 8), (48, 8)]
        assert fake.captured[:4] == [(48, 8), (48, 0), (8, 8), (8, 0)] and graphs.buckets == [8, 16, 24, 32, 40, 48]
        assert "12 mixed-step buckets (8,16,24,32,40,48 x LoRA step slots 0,8)" in caplog.text
        assert graphs.num_steps > 0 and not runner.lora.state.always_on


def test_mixed_graph_flags_reach_the_engine_and_the_bench(monkeypatch, tiny_checkpoint):
    """``--no-mixed-cuda-graphs`` (engine serve and bench serve) turns the mixed-step graphs off; the default keeps
    them (CUDA only: on CPU ``init_mixed_graphs()`` makes none), and the bench's rebuilt command line says so."""
    import argparse

    import loraplex.engine.server.serve as serve_mod
    from loraplex.cli import main
    from loraplex.commands.bench import config_from_args, register
    from loraplex.engine.engine_config import EngineConfig

    seen = []
    monkeypatch.setattr(serve_mod, "real_service", lambda model, **kw: seen.append(kw["mixed_cuda_graphs"]))
    monkeypatch.setattr(serve_mod, "serve", lambda make, **kw: make())
    for flags in ([], ["--no-mixed-cuda-graphs"]):
        main(["engine", "serve", "--model", tiny_checkpoint("llama"), *flags])
    assert seen == [True, False] and EngineConfig(model="/m").mixed_cuda_graphs is True
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    for flags, want in (([], True), (["--no-mixed-cuda-graphs"], False)):
        cfg = config_from_args(parser.parse_args(["bench", "serve", "--scale", "tiny", *flags]))
        assert cfg.mixed_cuda_graphs is want and ("--no-mixed-cuda-graphs" in cfg.command) is (not want)
    from loraplex.bench.engine_setup import engine_kwargs

    assert engine_kwargs(cfg, "/tmp/w", device="cpu", dtype="float32", quantization=None)["mixed_cuda_graphs"] is False


@pytest.mark.parametrize("family,aux_ids", [("llama", [1, 2, 4]), ("gpt_oss", [0, 1, 2])])
def test_eagle3_steps_with_a_prompt_give_aux_rows(family, aux_ids, tiny_checkpoint, peft_folders, tmp_path):
    """An EAGLE-3 proposer reads the target's residual stream entering its aux layers: the speculative decoder makes
    the mixed-step graphs give those rows too, and steps with a prompt beside verify rows then take that path with
    every proposal and every output token as on the eager multi-token forward."""
    from loraplex.engine.testing.eagle3 import write_random_eagle3
    from tests.engine.spec_decode.conftest import record_proposals

    path = tiny_checkpoint(family, num_hidden_layers=4) if family == "llama" else tiny_checkpoint(family)
    refs = adapter_refs(peft_folders(path))
    spec = dict(method="eagle3", draft_head=write_random_eagle3(tmp_path / "draft", aux_ids), num_speculative_tokens=3)
    runs = {}
    for mixed in (False, True):
        engine = make_engine(path, spec, adapter_cache_dir=str(tmp_path / f"cache-{mixed}"), max_num_batched_tokens=48,
                             **LORA)
        for ref in refs.values():
            assert engine.load_adapter(ref, wait=True) == "ready"
        assert engine.runner.mixed_aux_layer_ids == tuple(aux_ids)
        if mixed:
            graphs = engine.runner.init_mixed_graphs(capture=False, granule=GRANULE)
            assert graphs.aux_layer_ids == tuple(aux_ids)
        record: list = []
        record_proposals(engine, record)
        finals = drive(engine, workload(refs), arrivals={0: [0, 1], 3: [2, 3], 6: [4], 9: [5]})
        assert_all_free(engine)
        runs[mixed] = ({rid: o.output_token_ids for rid, o in finals.items()},
                       [(t, getattr(a, "adapter_id", None), d) for t, a, d in record], engine.spec.executor)
    (want, want_rec, eager), (got, got_rec, executor) = runs[False], runs[True]
    assert got == want and got_rec == want_rec and len(got_rec) >= 20
    assert eager.num_mixed_steps == 0 and executor.num_mixed_steps > 0
