"""Kernel benchmark at a model's decode shapes: time, achieved bandwidth, share of the copy roofline, and the
tuned config's speed-up over the launcher's default. Rows "... kernel(s)" time the LoRA ops with their
metadata computed once and shared (lora_segments per step, moe_align_lora per MoE layer), as a step should;
the plain rows include that metadata in every call.

    python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b --m 1,16,64,256 [--roofline-tbs 4.2]

Bandwidth counts the bytes an op must move at least (activated expert weights, active adapters' A/B, the
activations read and written, the KV of every context token) over CUDA-graph replay time. "tuned" reads
tuning_configs/<device>/ (or LORAPLEX_TUNING_DIR); ops without tuned configs print "-".
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from loraplex.kernels.tuning_cases import (PRESETS, bench_time_ms, misc_cases,  # noqa: E402
                                           shared_metadata_cases, tunable_cases)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-oss-20b", choices=sorted(PRESETS))
    p.add_argument("--m", default="1,16,64,256")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--roofline-tbs", type=float, default=4.2, help="copy roofline in TB/s")
    p.add_argument("--context", type=int, default=2048, help="decode context length per sequence")
    p.add_argument("--only", default="", help="comma-separated label prefixes: run just those ops")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    shapes = PRESETS[args.model]
    print(f"# {shapes.name} decode shapes on {torch.cuda.get_device_name()}, bf16, {args.max_loras} adapters "
          f"of rank {args.rank}, roofline {args.roofline_tbs} TB/s")
    print("| op | M | tuned us | GB/s | % roofline | default us | tuned/default speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m in (int(v) for v in args.m.split(",")):
        torch.manual_seed(m)
        cases = tunable_cases(shapes, m, args.max_loras, args.rank, torch.bfloat16, "cuda")
        cases += misc_cases(shapes, m, torch.bfloat16, "cuda", context=args.context)
        cases += shared_metadata_cases(shapes, m, args.max_loras, args.rank, torch.bfloat16, "cuda")
        for case in cases:
            if args.only and not case.label.startswith(tuple(args.only.split(","))):
                continue
            try:
                ms = bench_time_ms(lambda: case.run(None))
            except Exception as e:  # noqa: BLE001  (report and go on with the other ops)
                print(f"| {case.label} | {m} | error: {type(e).__name__}: {str(e)[:120]} | | | | |", flush=True)
                continue
            gbs = case.nbytes / (ms * 1e-3) / 1e9
            share = 100 * gbs / (args.roofline_tbs * 1e3)
            if case.default is not None:
                dms = bench_time_ms(lambda: case.run(case.default))
                extra = f"{dms * 1e3:.1f} | {dms / ms:.2f}x"
            else:
                extra = "- | -"
            print(f"| {case.label} | {m} | {ms * 1e3:.1f} | {gbs:.0f} | {share:.1f}% | {extra} |", flush=True)
        del cases
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
