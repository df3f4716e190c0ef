"""The padded static-buffer decode path of ``DecodeGraphs`` (what CUDA graphs replay), run eagerly on CPU: it must
give the normal path's greedy tokens and logits (relative error max|d|/max|ref| <= 1e-5) for every family, with
adapters and base requests in one batch, batches padded up to a bucket (3 -> 4) and sequences growing past block
boundaries; padded rows must neither fault nor touch the KV cache (torch reference and Triton kernels); steps the
path does not serve run eagerly.
Capture itself needs CUDA: benchmarks/engine/check_cuda_graphs.py."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.cuda_graphs import DecodeGraphs, batch_buckets
from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.loader import load_model
from loraplex.engine.lora.slots import LoRASlots, max_adapter_bytes
from loraplex.engine.stats import empty_stats, engine_stats
from loraplex.engine.testing.adapters import random_adapter
from loraplex.kernels import reference

FAMILIES = ["gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3"]
MAX_RANK = 4
NEW_TOKENS = (14, 9, 5, 12, 3, 7)          # different lengths: the batch shrinks 6 -> 5 -> 4 -> 3 -> 2 -> 1
SLOT_OF_REQUEST = (0, None, 5, 0, None, 5)  # adapters (resident slots 0 and 5) and base requests mixed


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (a padded batch changes matmul shapes: float32 rounding, not exactness)."""
    return ((got - ref).abs().max() / ref.abs().max()).item()


def fill_random_slots(slots: LoRASlots, seed: int) -> None:
    """Random adapters of ranks 4 and 2 in resident slots 0 and 5 (no PEFT needed: both paths share them); slot 3
    holds an adapter no request uses."""
    for slot, rank in ((0, 4), (5, 2), (3, 1)):
        slots.load(slot, random_adapter(slots, f"random/{slot}", rank=rank, seed=seed * 10 + slot, scale=1.0))


def run_engine(path: str, family: str, *, padded: bool, prompts: list[list[int]], setup=None, **kw):
    """Greedy outputs, per-request logits rows and (for the padded path) the (batch, bucket) of each padded step.
    ``setup(runner)``, if given, sets up the decode path instead (after LoRA is attached, before any request)."""
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
                                       max_num_batched_tokens=64, enable_prefix_caching=False, progress=False, **kw)
    runner = engine.runner
    slots = runner.init_lora(max_rank=MAX_RANK)
    fill_random_slots(slots, seed=FAMILIES.index(family))
    seq_slot: dict[int, int] = {}
    execute = runner.execute
    runner.execute = lambda out, sampling, lora_slots=None: execute(out, sampling, lora_slots=seq_slot)
    buckets = []
    if setup is not None:
        setup(runner)
    elif padded:
        graphs = runner.init_decode_graphs(capture=False)
        run = graphs.run
        graphs.run = lambda out, ls: (buckets.append((len(out.scheduled), graphs.bucket_for(len(out.scheduled)))),
                                      run(out, ls))[1]
    logits = defaultdict(list)
    runner.logits_hook = lambda seqs, lg: [logits[s.request_id].append(lg[j].clone()) for j, s in enumerate(seqs)]
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=NEW_TOKENS[i], temperature=0.0, ignore_eos=True))
        if SLOT_OF_REQUEST[i] is not None:
            seq_slot[engine._requests[rid].group.seqs[0].seq_id] = SLOT_OF_REQUEST[i]
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.output_token_ids
    return engine, final, logits, buckets


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_decode_matches_the_normal_path(family, tiny_checkpoint):
    path = tiny_checkpoint(family)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (5, 3, 9, 5, 6, 2)]
    prompts[3] = prompts[0]  # same prompt with slot 0 (request 0) and the base (request 1 gets it below)
    prompts[1] = prompts[0]
    _, want, want_logits, _ = run_engine(path, family, padded=False, prompts=prompts)
    engine, got, got_logits, buckets = run_engine(path, family, padded=True, prompts=prompts)
    assert got == want
    for rid, rows in want_logits.items():
        assert len(got_logits[rid]) == len(rows) == NEW_TOKENS[int(rid[1:])]
        err = max(rel_err(a, b) for a, b in zip(got_logits[rid], rows))
        assert err <= 1e-5, f"{family} {rid}: logits differ by {err} (relative)"
    # the adapter really changes the model: request 0 (slot 0) and request 1 (base) share their prompt
    assert (want_logits["r0"][0] - want_logits["r1"][0]).abs().max() > 1e-2
    # every decode step took the padded path, across buckets, and a batch of 3 was padded to 4
    assert (3, 4) in buckets and {b for _, b in buckets} >= {1, 2, 4, 8}, buckets
    assert len(buckets) == max(NEW_TOKENS) - 1 == engine.runner.decode_graphs.num_steps
    assert engine.runner.lora.state.token_lora_idx is None and not engine.runner.lora.state.always_on


def test_steps_over_the_largest_bucket_and_prompt_logprobs_run_eagerly(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (4, 7, 3, 6, 5, 8)]
    _, want, want_logits, _ = run_engine(path, "llama", padded=False, prompts=prompts)
    engine, got, got_logits, buckets = run_engine(path, "llama", padded=True, prompts=prompts,
                                                  cuda_graph_max_batch_size=2)
    assert engine.runner.decode_graphs.buckets == [1, 2]
    assert got == want and buckets and all(n <= 2 for n, _ in buckets)
    for rid, rows in want_logits.items():
        assert max(rel_err(a, b) for a, b in zip(got_logits[rid], rows)) <= 1e-5
    graphs = engine.runner.decode_graphs
    from loraplex.engine.scheduler_output import ScheduledSequence, SchedulerOutput
    from loraplex.engine.sequence import Sequence

    seq = Sequence(0, "x", [5, 6, 7])
    seq.num_computed_tokens = 2
    one = ScheduledSequence(seq, 1, [0], sample=True)
    assert graphs.can_run(SchedulerOutput(scheduled=[one]))
    assert not graphs.can_run(SchedulerOutput(scheduled=[ScheduledSequence(seq, 1, [0], True, prompt_logprobs=2)]))
    assert not graphs.can_run(SchedulerOutput(scheduled=[ScheduledSequence(seq, 2, [0], sample=True)]))
    assert not graphs.can_run(SchedulerOutput(scheduled=[one, one, one]))
    with pytest.raises(ValueError, match=r"slot 2 holds no adapter \(resident: \[0, 3, 5\]\)"):
        graphs.run(SchedulerOutput(scheduled=[one]), {0: 2})


def test_padded_rows_neither_fault_nor_touch_the_cache():
    """Rows with context length 0 and slot -1 (the padding): zeros out, cache unchanged, real rows unaffected --
    in the torch reference and the Triton kernels (interpreted), with sinks and a sliding window."""
    from loraplex.kernels.paged_attention import paged_attention as triton_attention
    from loraplex.kernels.reshape_and_cache import reshape_and_cache as triton_cache

    g = torch.Generator().manual_seed(0)
    nb, bs, kv, d, q_heads = 6, 4, 2, 12, 6
    k_cache, v_cache = torch.randn(nb, bs, kv, d, generator=g), torch.randn(nb, bs, kv, d, generator=g)
    q = torch.randn(4, q_heads, d, generator=g)  # rows 0, 1 real (contexts 7 and 3), rows 2, 3 padding
    key, value = torch.randn(4, kv, d, generator=g), torch.randn(4, kv, d, generator=g)
    tables = torch.tensor([[2, 4, 0], [5, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([7, 3, 0, 0], dtype=torch.int32)
    qsl = torch.arange(5, dtype=torch.int32)
    slots = torch.tensor([4 * bs + 2, 5 * bs + 2, -1, -1])
    sinks = torch.randn(q_heads, generator=g)
    for write, attend in ((reference.reshape_and_cache, reference.paged_attention), (triton_cache, triton_attention)):
        kc, vc = k_cache.clone(), v_cache.clone()
        write(key, value, kc, vc, slots)
        changed = (kc != k_cache).any(-1).any(-1).nonzero().tolist()
        assert changed == [[4, 2], [5, 2]]
        for kw in ({}, {"sinks": sinks, "sliding_window": 3}):
            out = attend(q, kc, vc, tables, seq_lens, qsl, 0.3, **kw)
            real = reference.paged_attention(q[:2], kc, vc, tables[:2], seq_lens[:2], qsl[:3], 0.3, **kw)
            assert torch.allclose(out[:2], real, atol=1e-5) and torch.equal(out[2:], torch.zeros_like(out[2:]))


def test_buckets_config_and_cpu_defaults(tiny_checkpoint):
    assert batch_buckets(1) == [1] and batch_buckets(3) == [1, 2, 3] and batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        batch_buckets(0)
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size must be None \\(max_num_seqs\\) or an integer"):
        EngineConfig(model="x", cuda_graph_max_batch_size=0)
    engine = LLMEngine.from_pretrained(tiny_checkpoint("qwen3"), device="cpu", dtype="float32", block_size=4,
                                       max_num_seqs=4, progress=False)
    runner = engine.runner
    assert runner.decode_graphs is None and runner.num_cuda_graphs == 0 and not runner.graphs_enabled()
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(runner, 4, 64, capture=True)
    s = engine_stats(engine)
    assert s["kv_cache_tokens"] == runner.num_blocks * 4 and s["num_cuda_graphs"] == s["num_mixed_cuda_graphs"] == 0
    assert s["kv_cache_gib"] == round(runner.num_blocks * runner.bytes_per_block / 2**30, 3)
    assert set(empty_stats()) == set(s)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "llama"])
def test_largest_adapter_estimate_is_what_the_slots_take(family, tiny_checkpoint):
    """The sizing-time estimate (before LoRA is attached) equals the bytes a rank-8 adapter on every target takes
    once loaded, and the slots hold nothing before a load."""
    model, cfg = load_model(tiny_checkpoint(family), progress=False)
    want = max_adapter_bytes(model, max_rank=8, dtype=torch.float32)
    slots = LoRASlots(model, cfg, max_rank=8, max_step_slots=4, device="cpu", dtype=torch.float32)
    assert slots.nbytes == 0 and want == slots.max_footprint() > 0
    slots.load(2, random_adapter(slots, "x", rank=8, seed=0))
    assert slots.nbytes == want


def test_eager_steps_see_power_of_two_slot_buckets(tiny_checkpoint):
    """An eager step's L is a power of two of at least 8 (capped by max_step_slots): steps whose adapter counts
    differ inside a bucket launch the same compiled kernels, and the slots past the used ones carry no tokens."""
    model, cfg = load_model(tiny_checkpoint("qwen3_moe"), progress=False)
    slots = LoRASlots(model, cfg, max_rank=4, max_step_slots=64, device="cpu", dtype=torch.float32)
    assert [slots.eager_step_slots(u) for u in (1, 2, 8, 9, 16, 17, 32, 33, 64)] == [8, 8, 8, 16, 16, 32, 32, 64, 64]
    for slot in (3, 5, 9):
        slots.load(slot, random_adapter(slots, f"a{slot}", rank=2, seed=slot))
    slots.set_token_slots(torch.tensor([9, 3, -1, 5, 3], dtype=torch.int32))
    st = slots.state
    assert st.num_slots == 8 and st.active_slots == {3, 5, 9} and slots.step_table.slots == [3, 5, 9]
    assert st.token_lora_idx.tolist() == [2, 0, -1, 1, 0]
    table = slots.step_table.view(0, in_features=4, out_features=(4,), max_rank=4, dtype=torch.float32,
                                  lookup=lambda c, e: ("factors", c)).at(st.num_slots)
    assert [table.lookup(l, 0) for l in (0, 2, 3, 7)] == [("factors", 3), ("factors", 9), None, None]


def test_token_slot_state(tiny_checkpoint):
    model, cfg = load_model(tiny_checkpoint("qwen3_moe"), progress=False)
    slots = LoRASlots(model, cfg, max_rank=4, max_step_slots=4, device="cpu", dtype=torch.float32)
    for slot in (1, 7):
        slots.load(slot, random_adapter(slots, f"a{slot}", rank=2 + slot % 2, seed=slot))
    st = slots.state
    slots.set_token_slots(torch.tensor([7, -1, 1, 7], dtype=torch.int32))
    # two adapters, but the eager step's kernels see the power-of-two bucket (here capped by max_step_slots = 4)
    assert st.active_slots == {1, 7} and st.num_slots == 4 and st.segments is None and not st.always_on
    assert st.token_lora_idx.tolist() == [1, -1, 0, 1]  # step slots: resident 1 -> 0, 7 -> 1
    assert slots.step_table.slots == [1, 7]
    slots.bind_static_token_slots(torch.full((4,), -1, dtype=torch.int32), 4)
    assert st.always_on and st.num_slots == 4 and st.token_lora_idx.shape == (4,)
    slots.set_token_slots(None)
    assert st.token_lora_idx is None and not st.always_on
    with pytest.raises(ValueError, match="static token map must be int32"):
        slots.bind_static_token_slots(torch.zeros(4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="token slots hold -2"):
        slots.set_token_slots(torch.tensor([-2, 0]))
    with pytest.raises(ValueError, match=r"slot 0 holds no adapter \(resident: \[1, 7\]\)"):
        slots.set_token_slots(torch.tensor([0, 1]))


class _FakeCuda:
    """Stands in for the torch.cuda calls of ``DecodeGraphs.capture_all`` on CPU: capture runs the forward once
    (as a real capture records it) and a replay re-runs the bucket's forward into the captured output tensor, so
    the capture/replay bookkeeping (order, warm-up, outputs, fallback) is exercised without a GPU."""

    def __init__(self, graphs: DecodeGraphs, fail_bucket: int | None = None):
        self.graphs, self.fail_bucket, self.captured, self.forwards = graphs, fail_bucket, [], []

    def install(self, monkeypatch):
        fake = self
        fwd = self.graphs._forward
        monkeypatch.setattr(self.graphs, "_forward", lambda b: (fake.forwards.append(b), fwd(b))[1])

        class Graph:
            def replay(self):
                fake.graphs._outputs[self.bucket].copy_(fwd(self.bucket))

        class Capture:
            def __init__(self, graph, pool=None, capture_error_mode="global"):
                self.graph = graph

            def __enter__(self):
                b = fake.forwards[-1]  # the warm-up just ran this bucket
                if b == fake.fail_bucket:
                    raise RuntimeError("operation not permitted when stream is capturing")
                self.graph.bucket = b
                fake.captured.append(b)

            def __exit__(self, *exc):
                return False

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (1 << 30, 1 << 31))


@pytest.mark.parametrize("fail_bucket,budget_s", [(None, None), (2, None), (None, 1e-9)],
                         ids=["all", "failure", "budget"])
def test_capture_bookkeeping_and_fallback_with_fake_cuda(fail_bucket, budget_s, tiny_checkpoint, monkeypatch,
                                                         caplog):
    """capture_all (graph_capture.py) with torch.cuda faked: warm-up then capture per bucket, largest first, then the smallest
    upwards; replays give the normal path's tokens; a capture error leaves no graphs, a warning, and the eager
    path; a spent capture budget leaves the largest bucket only, which then serves every batch (padded)."""
    caplog.set_level("INFO", logger="loraplex.engine.graph_capture")
    path = tiny_checkpoint("qwen3")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (5, 3, 9, 5, 6, 2)]
    _, want, want_logits, _ = run_engine(path, "qwen3", padded=False, prompts=prompts)
    state = {}

    def capture_on_cpu(runner):
        graphs = DecodeGraphs(runner, 8, runner.max_model_len, capture=False)
        graphs.capture = True
        fake = state["fake"] = _FakeCuda(graphs, fail_bucket)
        fake.install(monkeypatch)
        state["ok"] = graphs.capture_all(budget_s)
        runner.decode_graphs = graphs if state["ok"] else None
        state["replays"] = graphs

    engine, got, got_logits, _ = run_engine(path, "qwen3", padded=True, prompts=prompts, setup=capture_on_cpu)
    runner, fake = engine.runner, state["fake"]
    assert got == want
    for rid, rows in want_logits.items():
        assert max(rel_err(a, b) for a, b in zip(got_logits[rid], rows)) <= 1e-5
    if budget_s is not None:
        assert state["ok"] and fake.captured == [8] and runner.cuda_graph_buckets == [8]
        assert state["replays"].num_steps == max(NEW_TOKENS) - 1  # batches of 6 down to 1, all replaying bucket 8
        assert "capture budget of 0 s spent, buckets 1,2,4 left out" in caplog.text
    elif fail_bucket is None:
        assert state["ok"] and fake.captured == [8, 1, 2, 4] and runner.num_cuda_graphs == 4
        assert fake.forwards[:2] == [8, 8]  # warm-up, then capture, largest bucket first
        assert runner.cuda_graph_buckets == [1, 2, 4, 8] and state["replays"].num_steps == max(NEW_TOKENS) - 1
        assert not runner.lora.state.always_on and runner.lora.state.token_lora_idx is None
    else:
        assert not state["ok"] and runner.decode_graphs is None and runner.num_cuda_graphs == 0
        assert "CUDA graph capture failed" in caplog.text and "running decode steps eagerly" in caplog.text
