"""Where a CUDA-graph decode step's GPU time goes: every kernel of a few replayed steps, by kind, and the idle time
between them.

The stage "perf" engine of ``check_cuda_graphs.py`` (GPT-OSS-20B shape, dummy weights, 8 random rank-32 adapters
resident; ``--quantization mxfp4|int8`` for those experts) decodes ``--batch`` requests, synchronised steps replayed
from the decode graphs, under the torch profiler (CUDA activity). Each step's kernels (told apart by the host time
between steps, longer than ``--split-us``) give:

- span: first kernel start to last kernel end; busy: the union of the kernels' intervals (kernels launched with PDL
  or on the LoRA side stream overlap the kernel before them); idle = span - busy;
- per kind (``KINDS``, first matching pattern of the kernel name): kernels per step, summed duration, what they add
  to busy (each kernel, in start order, counts only its time past the end of everything before it: a kernel
  overlapped by an earlier one counts little; the kinds' additions sum to busy), and the idle time just before
  kernels of that kind (what waits on their launch);
- the largest gaps with the kernels on either side.

A kernel that starts under PDL counts from its launch, so its duration includes the wait for the kernel before it:
the kinds' durations overlap and add up to more than busy; their additions do not.

    python3 benchmarks/engine/step_timeline_gpu.py --quantization mxfp4 --batch 1,16 --adapters 0,8 --out F.json
    python3 benchmarks/engine/step_timeline_gpu.py --device cpu --scale tiny   # smoke run: CPU ops, no graphs
"""
from __future__ import annotations

import argparse
import functools
import gzip
import importlib.util
import json
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(ROOT)

# (kind, pattern on the kernel name); the first match wins, "other" takes the rest
KINDS = (
    ("expert GEMM gate_up (MXFP4)", r"^_gate_up_(finish_)?kernel"),
    ("expert GEMM down (MXFP4)", r"^_down_kernel"),
    ("expert GEMM (bf16 / INT8)", r"_moe_(gate_up|down)_kernel|int8"),
    ("expert LoRA shrink", r"_moe_lora_shrink"),
    ("expert LoRA expand / fused", r"_moe_lora_(expand|fused)"),
    ("attention LoRA shrink", r"_lora_shrink"),
    ("attention LoRA expand", r"_lora_expand"),
    ("paged attention", r"_paged_attention|_merge_splits"),
    ("dense GEMM (cuBLAS)", r"gemm|nvjet|xmma|cutlass|splitKreduce"),
    ("expert pair sum", r"_sum_pairs"),
    ("routing and alignment", r"_moe_route|_moe_align"),
    ("rms norm", r"_rms_norm"),
    ("rotary + KV write", r"_rotary|_reshape_and_cache"),
    ("activation", r"_act_and_mul"),
)
_KIND_RE = tuple((kind, re.compile(pat, re.IGNORECASE)) for kind, pat in KINDS)


def kind_of(name: str) -> str:
    for kind, pat in _KIND_RE:
        if pat.search(name):
            return kind
    return "other"


def kernel_events(trace: dict) -> list[dict]:
    """The GPU kernels of a Chrome trace written by ``torch.profiler``: name, start and duration (µs), stream."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            out.append(dict(name=ev["name"], ts=float(ev["ts"]), dur=float(ev["dur"]),
                            stream=(ev.get("args") or {}).get("stream", ev.get("tid"))))
    return sorted(out, key=lambda e: e["ts"])


def split_steps(events: list[dict], split_us: float) -> list[list[dict]]:
    """Kernels grouped into runs that no idle gap longer than ``split_us`` interrupts (one run per step)."""
    runs: list[list[dict]] = []
    end = None
    for ev in events:
        if end is None or ev["ts"] - end > split_us:
            runs.append([])
            end = ev["ts"]
        runs[-1].append(ev)
        end = max(end, ev["ts"] + ev["dur"])
    return runs


def analyse_step(kernels: list[dict], top_gaps: int = 12) -> dict:
    """Span, busy (union of intervals), idle, per-kind totals and the largest gaps of one step's kernels."""
    span0 = kernels[0]["ts"]
    span1 = max(k["ts"] + k["dur"] for k in kernels)
    busy = 0.0
    covered = span0  # end of the union so far
    kinds: dict[str, dict] = {}
    gaps = []
    prev = None
    for k in kernels:
        kind = kind_of(k["name"])
        row = kinds.setdefault(kind, dict(kernels=0, us=0.0, adds_us=0.0, idle_before_us=0.0))
        row["kernels"] += 1
        row["us"] += k["dur"]
        end = k["ts"] + k["dur"]
        gap = k["ts"] - covered
        if gap > 0:
            row["idle_before_us"] += gap
            gaps.append(dict(us=round(gap, 2), before=prev["name"][:80] if prev else None, after=k["name"][:80]))
        added = max(0.0, end - max(covered, k["ts"]))
        row["adds_us"] += added
        busy += added
        covered = max(covered, end)
        prev = k
    gaps.sort(key=lambda g: -g["us"])
    return dict(kernels=len(kernels), span_us=round(span1 - span0, 1), busy_us=round(busy, 1),
                idle_us=round(span1 - span0 - busy, 1),
                kinds={k: {f: (round(x, 1) if f != "kernels" else x) for f, x in v.items()}
                       for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["adds_us"])},
                top_gaps=gaps[:top_gaps])


def mean_steps(steps: list[dict]) -> dict:
    """Per-step means of ``analyse_step`` results (kinds averaged over the steps; gaps of the first step)."""
    n = len(steps)
    kinds: dict[str, dict] = {}
    for s in steps:
        for k, v in s["kinds"].items():
            row = kinds.setdefault(k, dict(kernels=0.0, us=0.0, adds_us=0.0, idle_before_us=0.0))
            for f in row:
                row[f] += v[f] / n
    return dict(steps=n, kernels=round(sum(s["kernels"] for s in steps) / n, 1),
                span_us=round(sum(s["span_us"] for s in steps) / n, 1),
                busy_us=round(sum(s["busy_us"] for s in steps) / n, 1),
                idle_us=round(sum(s["idle_us"] for s in steps) / n, 1),
                kinds={k: {f: round(x, 1) for f, x in v.items()}
                       for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["adds_us"])},
                top_gaps=steps[0]["top_gaps"])


@functools.cache
def _perf_module():
    spec = importlib.util.spec_from_file_location("check_cuda_graphs",
                                                  os.path.join(ROOT, "benchmarks", "engine", "check_cuda_graphs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def profile_decode(engine, seq_slot: dict, batch: int, adapters: int, steps: int, prompt_len: int) -> dict:
    """The Chrome trace of ``steps`` synchronised decode steps of ``batch`` requests over ``adapters`` slots."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    rids = _perf_module().add_decode_requests(engine, seq_slot, batch, adapters, steps + 16, prompt_len,
                                              f"timeline-b{batch}-a{adapters}")
    engine.async_scheduling = False
    cuda = engine.runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        for _ in range(4):  # the prefill, then warm decode steps
            engine.step()
        sync()
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
                sync()
                time.sleep(0.002)  # a host gap between steps that split_steps can see
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as f:
                return json.load(f)
    finally:
        for rid in rids:
            engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quantization", default=None, choices=("int8", "mxfp4"))
    p.add_argument("--batch", default="16", help="comma-separated batch sizes")
    p.add_argument("--adapters", default="0,8", help="comma-separated numbers of adapters in the batch")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--split-us", type=float, default=500.0, help="a longer idle gap ends a step")
    p.add_argument("--device", default="cuda")
    p.add_argument("--scale", default="full", choices=("full", "tiny"))
    p.add_argument("--out", help="write the per-step analysis here as JSON")
    args = p.parse_args(argv)

    perf = _perf_module()
    from loraplex.bench.workload import SCALES, write_model_config
    from loraplex.engine import LLMEngine

    report = dict(command=" ".join(sys.argv if argv is None else ["step_timeline_gpu.py", *argv]), quantization=args.quantization, rows=[])
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model_config(os.path.join(tmp, f"gpt-oss-{args.scale}"), SCALES[args.scale])
        engine = LLMEngine.from_pretrained(
            folder, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32", load_format="dummy",
            progress=False, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=2048,
            num_kv_blocks=16 * 32 + 64, enable_prefix_caching=False, swap_space_bytes=0, enable_lora=True,
            max_lora_rank=32, cuda_graph_max_batch_size=16, async_scheduling=False,
            **({"quantization": args.quantization} if args.quantization else {}),
            adapter_cache_dir=os.path.join(tmp, "cache"))
        runner = engine.runner
        if args.device == "cuda":
            import torch

            report["device"] = torch.cuda.get_device_name()
        else:
            runner.init_decode_graphs(capture=False)
        perf.fill_random_slots(runner.lora, 8)
        seq_slot: dict[int, int] = {}
        execute = runner.execute
        runner.execute = lambda out, sampling, lora_slots=None: execute(out, sampling, lora_slots=dict(seq_slot))
        for batch in (int(v) for v in args.batch.split(",")):
            for adapters in (int(v) for v in args.adapters.split(",")):
                trace = profile_decode(engine, seq_slot, batch, adapters, args.steps, args.prompt_len)
                events = kernel_events(trace)
                runs = [r for r in split_steps(events, args.split_us) if len(r) > 1]
                if not runs:
                    print(f"batch {batch}, adapters {adapters}: no GPU kernels traced", flush=True)
                    report["rows"].append(dict(batch=batch, adapters=adapters, error="no GPU kernels traced"))
                    continue
                # the graph replay is each step's longest run of kernels
                longest = max(len(r) for r in runs)
                steps = [analyse_step(r) for r in runs if len(r) >= longest // 2]
                row = dict(batch=batch, adapters=adapters, **mean_steps(steps))
                report["rows"].append(row)
                print(f"\nbatch {batch}, adapters {adapters}: {row['steps']} steps, {row['kernels']} kernels a step, "
                      f"span {row['span_us']:.0f} µs, busy {row['busy_us']:.0f}, idle {row['idle_us']:.0f}")
                print("| kind | kernels | µs | adds to busy, µs | idle before, µs |\n|---|---:|---:|---:|---:|")
                for k, v in row["kinds"].items():
                    print(f"| {k} | {v['kernels']:.0f} | {v['us']:.1f} | {v['adds_us']:.1f} | {v['idle_before_us']:.1f} |")
                for g in row["top_gaps"][:8]:
                    print(f"  gap {g['us']:.1f} µs: {g['before']} -> {g['after']}")
                sys.stdout.flush()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
