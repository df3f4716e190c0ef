"""Where the time of the LoRA ops goes at decode: per-kernel device time (torch profiler, plain launches) next to
the op's CUDA-graph replay time; the difference is launch and dependency gaps between the kernels.

    python3 benchmarks/kernels/probe_lora.py --model gpt-oss-20b --m 1,16,64
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from loraplex.kernels.tuning_cases import PRESETS, bench_time_ms, tunable_cases  # noqa: E402

OPS = ("lora_shrink[qkv]", "lora_expand[qkv]", "fused_moe_lora[gate_up]", "fused_moe_lora[down]")


def kernel_times_us(fn, calls: int = 20) -> dict[str, float]:
    """Mean device time per call of each kernel (and memset/copy) that ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name[:48]] += evt.device_time_total / calls
    return dict(totals)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="gpt-oss-20b", choices=sorted(PRESETS))
    p.add_argument("--m", default="1,16,64")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_lora.py needs a CUDA GPU; torch sees none")
    shapes = PRESETS[args.model]
    print("| op | M | graph replay us | sum of kernels us | kernels (us each) |")
    print("|---|---:|---:|---:|---|")
    for m in (int(v) for v in args.m.split(",")):
        torch.manual_seed(m)
        for case in tunable_cases(shapes, m, 8, 32, torch.bfloat16, "cuda"):
            if case.label not in OPS:
                continue
            replay = bench_time_ms(lambda: case.run(None)) * 1e3
            parts = kernel_times_us(lambda: case.run(None))
            detail = ", ".join(f"{name} {us:.1f}" for name, us in sorted(parts.items(), key=lambda kv: -kv[1]))
            print(f"| {case.label} | {m} | {replay:.1f} | {sum(parts.values()):.1f} | {detail} |", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
