"""benchmarks/engine/step_timeline_gpu.py: its trace analysis on made-up kernel timelines (steps split at host gaps,
busy time as the union of overlapping kernels, idle time charged to the kernel that waited), the kernel names of
this repository's Triton kernels sorted into their kinds, and a CPU smoke run of the whole script."""
from __future__ import annotations

import json

import pytest

from tests.utils.scripts import load_script

timeline = load_script("engine", "step_timeline_gpu")


def _k(name, ts, dur, stream=7):
    return dict(name=name, ts=float(ts), dur=float(dur), stream=stream)


def test_kernel_events_reads_only_kernels_sorted_by_start():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "_down_kernel", "ts": 30, "dur": 5, "args": {"stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 100},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 2, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "_gate_up_kernel", "ts": 10, "dur": 15, "args": {"stream": 9}},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3},
    ]}
    events = timeline.kernel_events(trace)
    assert [(e["name"], e["ts"], e["dur"], e["stream"]) for e in events] == [
        ("_gate_up_kernel", 10.0, 15.0, 9), ("_down_kernel", 30.0, 5.0, 7)]


def test_split_steps_cuts_at_gaps_longer_than_the_threshold_only():
    events = [_k("a", 0, 10), _k("b", 15, 10), _k("c", 400, 5), _k("d", 1000, 5), _k("e", 1004, 1)]
    runs = timeline.split_steps(events, split_us=300)
    assert [[e["name"] for e in r] for r in runs] == [["a", "b"], ["c"], ["d", "e"]]
    # a long kernel covers the time after it: a kernel starting inside it continues the run
    runs = timeline.split_steps([_k("long", 0, 1000), _k("inside", 900, 5), _k("after", 1200, 5)], split_us=300)
    assert [[e["name"] for e in r] for r in runs] == [["long", "inside", "after"]]


def test_analyse_step_busy_is_the_union_and_idle_is_charged_to_the_kernel_that_waited():
    kernels = [
        _k("_rms_norm_kernel", 0, 2),  # 0-2
        _k("nvjet_tst_64x8_64x16_1x1_v_bz_TNT", 5, 10),  # gap 3: 5-15
        _k("_lora_shrink_kernel", 6, 4, stream=9),  # side stream, inside the GEMM: no idle, no busy added
        _k("_gate_up_kernel", 13, 20),  # PDL start under the GEMM: 13-33, adds 18 busy
        _k("_moe_lora_shrink_kernel", 40, 5),  # gap 7: 40-45
        _k("_down_kernel", 44, 10),  # 44-54, adds 9
    ]
    step = timeline.analyse_step(kernels, top_gaps=5)
    assert step["kernels"] == 6
    assert step["span_us"] == 54.0
    assert step["busy_us"] == pytest.approx(2 + 10 + 18 + 5 + 9)
    assert step["idle_us"] == pytest.approx(3 + 7)
    kinds = step["kinds"]
    # each kernel adds only its time past everything that started before it: the side-stream shrink inside the
    # GEMM adds nothing, the PDL-started gate_up GEMM its 18 µs past the GEMM's end
    assert kinds["dense GEMM (cuBLAS)"] == dict(kernels=1, us=10.0, adds_us=10.0, idle_before_us=3.0)
    assert kinds["expert LoRA shrink"] == dict(kernels=1, us=5.0, adds_us=5.0, idle_before_us=7.0)
    assert kinds["attention LoRA shrink"] == dict(kernels=1, us=4.0, adds_us=0.0, idle_before_us=0.0)
    assert kinds["expert GEMM gate_up (MXFP4)"] == dict(kernels=1, us=20.0, adds_us=18.0, idle_before_us=0.0)
    assert kinds["expert GEMM down (MXFP4)"] == dict(kernels=1, us=10.0, adds_us=9.0, idle_before_us=0.0)
    assert sum(v["adds_us"] for v in kinds.values()) == pytest.approx(step["busy_us"])
    # kinds come in order of what they add, gaps largest first with their neighbours
    assert list(kinds)[:2] == ["expert GEMM gate_up (MXFP4)", "dense GEMM (cuBLAS)"]
    assert step["top_gaps"] == [
        dict(us=7.0, before="_gate_up_kernel", after="_moe_lora_shrink_kernel"),
        dict(us=3.0, before="_rms_norm_kernel", after="nvjet_tst_64x8_64x16_1x1_v_bz_TNT")]


def test_mean_steps_averages_kinds_over_steps():
    one = timeline.analyse_step([_k("_rms_norm_kernel", 0, 2), _k("_down_kernel", 4, 6)])
    two = timeline.analyse_step([_k("_rms_norm_kernel", 0, 4), _k("_down_kernel", 4, 6), _k("_down_kernel", 12, 2)])
    mean = timeline.mean_steps([one, two])
    assert mean["steps"] == 2 and mean["kernels"] == 2.5
    assert mean["span_us"] == pytest.approx((10 + 14) / 2)
    assert mean["idle_us"] == pytest.approx((2 + 2) / 2)
    assert mean["kinds"]["expert GEMM down (MXFP4)"] == dict(kernels=1.5, us=7.0, adds_us=7.0, idle_before_us=2.0)
    assert mean["kinds"]["rms norm"] == dict(kernels=1.0, us=3.0, adds_us=3.0, idle_before_us=0.0)


@pytest.mark.parametrize("name, kind", [
    ("_gate_up_kernel", "expert GEMM gate_up (MXFP4)"),
    ("_gate_up_finish_kernel", "expert GEMM gate_up (MXFP4)"),
    ("_down_kernel", "expert GEMM down (MXFP4)"),
    ("_moe_gate_up_kernel", "expert GEMM (bf16 / INT8)"),
    ("_moe_down_kernel", "expert GEMM (bf16 / INT8)"),
    ("_moe_lora_shrink_kernel", "expert LoRA shrink"),
    ("_moe_lora_expand_kernel", "expert LoRA expand / fused"),
    ("_lora_shrink_compact_kernel", "attention LoRA shrink"),
    ("_lora_expand_kernel", "attention LoRA expand"),
    ("_paged_attention_kernel", "paged attention"),
    ("_merge_splits_kernel", "paged attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "dense GEMM (cuBLAS)"),
    ("_sum_pairs_kernel", "expert pair sum"),
    ("_moe_align_pair_kernel", "routing and alignment"),
    ("_moe_route_kernel", "routing and alignment"),
    ("_rotary_cache_kernel", "rotary + KV write"),
    ("_reshape_and_cache_kernel", "rotary + KV write"),
    ("void at::native::vectorized_elementwise_kernel<4>", "other"),
])
def test_kind_of_names_this_repositorys_kernels(name, kind):
    assert timeline.kind_of(name) == kind


def test_script_runs_on_the_cpu(tmp_path):
    out = tmp_path / "timeline.json"
    rc = timeline.main(["--device", "cpu", "--scale", "tiny", "--batch", "2", "--adapters", "0,2", "--steps", "2",
                        "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    # no GPU, so no kernels: each (batch, adapters) row says so instead of inventing figures
    assert [(r["batch"], r["adapters"], r["error"]) for r in report["rows"]] == [
        (2, 0, "no GPU kernels traced"), (2, 2, "no GPU kernels traced")]
