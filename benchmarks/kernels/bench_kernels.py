"""Kernel benchmark at a model's decode shapes: time, achieved bandwidth, share of the copy roofline, and the
tuned config's speed-up over the launcher's default, per op (fused_moe_lora per target: gate_up, down).

    python3 benchmarks/kernels/bench_kernels.py --model gpt-oss-20b --m 1,16,64,256 [--json out.json]

Timing (``tuning_cases.bench_time_ms``): CUDA-graph replay, as the engine replays decode steps, so host launch
overhead is not counted. "cold" (the headline): every call follows a read of 4x the L2 size, subtracted, so
weights come from HBM as in the engine (between two calls of one layer's op, the other layers' weights pass
through L2); "warm": back-to-back calls, where an op's few MB of adapter weights stay in L2 (faster than HBM
allows, not what a step pays).

Rows: plain rows include the op's own metadata in every call (moe_align_lora, lora_segments, buffer zeroing);
"... kernel(s)" rows take it precomputed as a step runs them (lora_segments once per step, moe_align_lora once
per MoE layer, shared by gate_up and down). Rows "... (variant)" run a named config next to the tuned one:
"two kernels+PDL" (shrink and expand with programmatic dependent launch), "fused" / "fused+PDL" (one kernel),
and "PDL" for lora_expand; their speed-up column is against the default too.

Bytes (``tuning_cases`` byte model): the least an op must move: activated expert weights (bf16; INT8 plus fp32
channel scales; MXFP4 codes plus E8M0 block scales, 4.25 bits a weight); A and B of the adapters used (dense)
or of the distinct (adapter, expert) pairs routed to (expert LoRA: R x (K + N) per pair);
activations read, y read and written by the fused adds; KV of every context token. L2 re-reads and metadata
are not counted. Roofline: the 4.2 TB/s device-to-device copy. "tuned" reads tuning_configs/<device>/ (or
LORAPLEX_TUNING_DIR); ops without tuned configs print "-".

Torch reference rows: ops that replace a torch composition (rotary_embedding, moe_route) also time that reference
("... (torch reference)" row, same graph-replay timing); the Triton row's last column gives the speed-up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from loraplex.kernels.tuning_cases import (PRESETS, bench_time_ms, misc_cases,  # noqa: E402
                                           shared_metadata_cases, tunable_cases)

HEADER = ("| op | M | cold us | GB/s | % roofline | warm us | default cold us | tuned/default | config |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---|")


def _flags(cfg: dict | None) -> str:
    if not cfg:
        return ""
    names = [k for k in ("FUSED", "PDL") if int(cfg.get(k, 0))]
    return "+".join(names) or "plain"


def _timed(fn) -> tuple[float, str]:
    """Cold device time in ms and how it was taken: "graph" replay, or "events" when ``fn`` cannot be captured
    (plain launches, launch overhead included)."""
    try:
        return bench_time_ms(fn, strict=True), "graph"
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        return bench_time_ms(fn), "events"


def _row(label: str, case, ms: float, timing: str, warm: float | None, roofline_tbs: float, **extra) -> dict:
    gbs = case.nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")
    return {"op": label, "m": case.m, "cold_us": ms * 1e3, "gbs": gbs, "roofline_pct": 100 * gbs / (roofline_tbs * 1e3),
            "warm_us": warm * 1e3 if warm is not None else None, "default_cold_us": None, "speedup_vs_default": None,
            "nbytes": case.nbytes, "config": None, "timing": timing, **extra}


def bench_case(case, roofline_tbs: float, with_warm: bool = True) -> list[dict]:
    """Rows (dicts) of one case: the tuned run, then each variant, then the torch reference where the case has one
    (the Triton row then carries ``speedup_vs_reference``)."""
    from loraplex.kernels import tuning

    rows = []
    tuned_cfg = None
    op = case.op or case.label.split("[")[0]  # "... kernel(s)" rows use their op's tuned configs
    if case.default is not None and op in ("lora_shrink", "lora_expand", "fused_moe_lora") or case.op:
        tuned_cfg = tuning.get_config(op, case.shape, case.m, case.default)
    default_ms = bench_time_ms(lambda: case.run(case.default)) if case.default is not None else None
    runs = [("", None)] + list(case.variants.items())
    for name, cfg in runs:
        ms, timing = _timed(lambda: case.run(cfg))
        warm = bench_time_ms(lambda: case.run(cfg), cold=False) if with_warm and not name else None
        rows.append(_row(case.label + (f" ({name})" if name else ""), case, ms, timing, warm, roofline_tbs,
                         default_cold_us=default_ms * 1e3 if default_ms is not None else None,
                         speedup_vs_default=default_ms / ms if default_ms is not None and ms > 0 else None,
                         config=cfg if cfg is not None else tuned_cfg))
    if case.reference is not None:  # the torch composition the Triton op replaces, timed the same way
        ref_ms, timing = _timed(case.reference)
        warm = bench_time_ms(case.reference, cold=False) if with_warm else None
        rows[0]["speedup_vs_reference"] = ref_ms * 1e3 / rows[0]["cold_us"] if rows[0]["cold_us"] > 0 else None
        rows.append(_row(case.label + " (torch reference)", case, ref_ms, timing, warm, roofline_tbs))
    return rows


def markdown_row(r: dict) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    notes = [_flags(r["config"])] if r["config"] else []
    if r["timing"] != "graph":
        notes.append("(NOT graph-captured: events)")
    if r.get("speedup_vs_reference"):
        notes.append(f"{r['speedup_vs_reference']:.1f}x vs torch reference")
    return (f"| {r['op']} | {r['m']} | {r['cold_us']:.1f} | {r['gbs']:.0f} | {r['roofline_pct']:.1f}% | "
            f"{num(r['warm_us'], '.1f')} | {num(r['default_cold_us'], '.1f')} | "
            f"{num(r['speedup_vs_default'], '.2f')}{'x' if r['speedup_vs_default'] is not None else ''} | "
            f"{' '.join(notes)} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-oss-20b", choices=sorted(PRESETS))
    p.add_argument("--m", default="1,16,64,256")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--roofline-tbs", type=float, default=4.2, help="copy roofline in TB/s")
    p.add_argument("--context", default="2048,8192",
                   help="decode context lengths per sequence: the first for every op, the others paged_attention only")
    p.add_argument("--only", default="", help="comma-separated label prefixes: run just those ops")
    p.add_argument("--no-warm", action="store_true", help="skip the warm-L2 column")
    p.add_argument("--json", default="", help="also write the rows here (rewritten after every row)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    shapes = PRESETS[args.model]
    print(f"# {shapes.name} decode shapes on {torch.cuda.get_device_name()}, bf16, {args.max_loras} adapters "
          f"of rank {args.rank}, roofline {args.roofline_tbs} TB/s; CUDA-graph replay, cold L2 (warm: L2-hot)")
    print(HEADER, flush=True)
    out = {"model": shapes.name, "device": torch.cuda.get_device_name(), "max_loras": args.max_loras,
           "rank": args.rank, "roofline_tbs": args.roofline_tbs, "tuning_dir": os.environ.get("LORAPLEX_TUNING_DIR"),
           "rows": []}
    for m in (int(v) for v in args.m.split(",")):
        torch.manual_seed(m)
        cases = tunable_cases(shapes, m, args.max_loras, args.rank, torch.bfloat16, "cuda")
        contexts = [int(v) for v in str(args.context).split(",")]
        cases += misc_cases(shapes, m, torch.bfloat16, "cuda", context=contexts[0])
        for ctx in contexts[1:]:  # paged_attention (split-KV decode path at M <= 66 on GPT-OSS) at longer contexts
            cases += [c for c in misc_cases(shapes, m, torch.bfloat16, "cuda", context=ctx)
                      if c.label.startswith("paged_attention")]
        cases += shared_metadata_cases(shapes, m, args.max_loras, args.rank, torch.bfloat16, "cuda")
        for case in cases:
            if args.only and not case.label.startswith(tuple(args.only.split(","))):
                continue
            try:
                rows = bench_case(case, args.roofline_tbs, with_warm=not args.no_warm)
            except Exception as e:  # noqa: BLE001  (report and go on with the other ops)
                print(f"| {case.label} | {m} | error: {type(e).__name__}: {str(e)[:120]} | | | | | | |", flush=True)
                out["rows"].append({"op": case.label, "m": m, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            for r in rows:
                print(markdown_row(r), flush=True)
            out["rows"] += rows
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump(out, f, indent=1)
        del cases
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
