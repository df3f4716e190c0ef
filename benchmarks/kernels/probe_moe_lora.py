"""Where the time of the expert layer with expert LoRA goes, per expert format: per-kernel device time (torch
profiler, plain launches) of ``moe_experts_lora`` next to the same layer without LoRA, bf16 weights and MXFP4 in
the kernel layout, at the GPT-OSS-20B shape with ``--max-loras`` adapters of ``--rank`` on both expert targets.
MXFP4 + LoRA runs three times: as the engine calls it (at decode and verify-step sizes the expands inside the GEMMs'
epilogues, each GEMM waiting for its shrink only before the epilogue), with the GEMMs waiting for the shrink before
their K loop (``fused_moe_mxfp4.LORA_LATE_WAIT`` off), and with the expands as separate launches
(``moe_experts_lora.EPILOGUE_MAX_BLOCK_M`` 0); the first two are compared with the last. Two timing-only rows
(their outputs are not the layer's) split the epilogue path's LoRA time: "shrinks only" launches the shrinks and
leaves the GEMMs' LoRA epilogues out, "epilogues only" feeds the epilogues rows shrunk once beforehand and launches
no shrink (its GEMMs then wait before their K loop: the alignment launched just before writes the tables they
read). ``--epilogue-max-block-m`` and ``--shrink-split-k`` add (checked) rows with the epilogue bound or the LoRA
calls' split-K changed. The "call" column is the CUDA-graph replay time of the whole call (``bench_time_ms``),
where PDL launches overlap as in the engine's graphs. ``--mix`` picks the tokens' adapters as
``tuning_cases.AdapterMix`` does ("prefill": an arrival step, one prompt chunk beside decodes).

    python3 benchmarks/kernels/probe_moe_lora.py --m 1,16,64     # H200: about 30 s
    python3 benchmarks/kernels/probe_moe_lora.py --m 512,2048 --mix prefill --max-loras 32 --out probe.json
    python3 benchmarks/kernels/probe_moe_lora.py --m 16,64 --only "mxfp4 + LoRA" --shrink-split-k 1,2,4,8,16
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from unittest import mock

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from loraplex.kernels.tuning_cases import bench_time_ms  # noqa: E402
from mxfp4_gemm_gpu import GPT_OSS_20B, lora_inputs, moe_inputs  # noqa: E402
from probe_lora import kernel_times_us  # noqa: E402


def variants(inp: dict, lo: dict, epilogue_max: int | None = None, shrink_splits: tuple[int, ...] = ()) -> dict:
    """label -> a call of the expert layer (bf16 / MXFP4 kernel layout, without and with LoRA); with
    ``epilogue_max``, also the layer with the expands in the GEMMs' epilogues up to row blocks of that size; for
    each of ``shrink_splits``, the MXFP4 layer with both LoRA calls at that split-K (``split_k_config``)."""
    from loraplex.kernels import fused_moe_lora as fml
    from loraplex.kernels import fused_moe_mxfp4 as fm4
    from loraplex.kernels import moe_experts_lora as mel
    from loraplex.kernels.fused_moe import fused_moe
    from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4
    from loraplex.kernels.moe_experts_lora import moe_experts_lora

    def layer(**extra):  # the MXFP4 layer with LoRA, as the engine calls it
        return moe_experts_lora(x, w13, w2, wts, ids, lo["idx"], lo["scaling"], w13_scale=s13, w2_scale=s2, **lkw,
                                **extra)

    def switched(module=mel, also=(), **switches):  # the layer with a module's switches (and ``also``'s) set
        def call():
            with contextlib.ExitStack() as stack:
                for mod, sw in ((module, switches), *also):
                    if sw:
                        stack.enter_context(mock.patch.multiple(mod, **sw))
                return layer()
        return call

    def without_epilogue(gemm):  # the GEMM as launched after its shrink, its LoRA epilogue left out
        def run(*args, lora=None, **kwargs):
            return gemm(*args, lora=None, **kwargs)
        return run

    shrunk, shrink = {}, fml.moe_lora_shrink

    def without_shrink(inp, table, *args, **kwargs):  # each target's rows made once, outside the timed call
        if id(table) not in shrunk:
            shrunk[id(table)] = shrink(inp, table, *args, **kwargs).clone()
        return shrunk[id(table)]

    x, ids, wts = inp["x"], inp["ids"], inp["weights"]
    kw = dict(activation="swiglu_clamp", b13=inp["b13"], b2=inp["b2"])
    lkw = dict(kw, w13_lora=lo["w13_lora"], w2_lora=lo["w2_lora"])
    w13, s13, w2, s2 = inp["kernel"]
    out = {
        "bf16": lambda: fused_moe(x, inp["w13"], inp["w2"], wts, ids, **kw),
        "bf16 + LoRA": lambda: moe_experts_lora(x, inp["w13"], inp["w2"], wts, ids, lo["idx"], lo["scaling"], **lkw),
        "mxfp4": lambda: fused_moe_mxfp4(x, w13, s13, w2, s2, wts, ids, **kw),
        "mxfp4 + LoRA": switched(),
        # the GEMMs wait for the shrink before their K loop instead of before their epilogue
        "mxfp4 + LoRA, GEMMs wait first": switched(module=fm4, LORA_LATE_WAIT=False),
        # separate expand launches at every M (the prefill path)
        "mxfp4 + LoRA, expands apart": switched(EPILOGUE_MAX_BLOCK_M=0),
        # where the LoRA time goes at decode sizes (wrong outputs, timing only): the shrinks launched, the GEMMs
        # without their LoRA epilogue; the GEMMs' epilogues fed by rows shrunk beforehand, no shrink launched
        "mxfp4 + LoRA, shrinks only": switched(module=fm4, gate_up=without_epilogue(fm4.gate_up),
                                               down=without_epilogue(fm4.down)),
        # (no shrink launched: the GEMMs wait before their K loop, which reads tables the kernel just before writes)
        "mxfp4 + LoRA, epilogues only": switched(module=fml, also=((fm4, dict(LORA_LATE_WAIT=False)),),
                                                 moe_lora_shrink=without_shrink),
    }
    if epilogue_max is not None:
        out[epilogue_label(epilogue_max)] = switched(EPILOGUE_MAX_BLOCK_M=epilogue_max)
    for split in shrink_splits:
        out[split_label(split)] = functools.partial(layer, lora_config_override=split_k_config(split))
    return out


def split_k_config(split: int) -> dict:
    """A LoRA config at the tuned decode configs' tile (16-pair blocks, BLOCK_K 128, PDL) with ``split`` K splits."""
    return {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": split, "GROUP_M": 1, "num_warps": 4,
            "num_stages": 3, "FUSED": 0, "PDL": 1}


def split_label(split: int) -> str:
    return f"mxfp4 + LoRA, LoRA calls at split-K {split}"


def epilogue_label(n: int) -> str:
    return f"mxfp4 + LoRA, epilogues up to {n}-row blocks"


CHECKED = ("mxfp4 + LoRA", "mxfp4 + LoRA, GEMMs wait first")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--m", default="1,16,64")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--mix", default="even", choices=("even", "zipf", "prefill"))
    p.add_argument("--epilogue-max-block-m", type=int, default=None,
                   help="also time (and check) the layer with the expands in the MXFP4 GEMMs' epilogues up to row "
                        "blocks of this size (the engine's: moe_experts_lora.EPILOGUE_MAX_BLOCK_M)")
    p.add_argument("--shrink-split-k", default="", help="also time (and check) the MXFP4 layer with both LoRA calls at "
                   "each of these split-K counts, comma-separated (``split_k_config``)")
    p.add_argument("--only", default="", help="time only the rows whose label starts with this (e.g. mxfp4)")
    p.add_argument("--out", help="write the rows here as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_moe_lora.py needs a CUDA GPU: it times the expert layer's kernels on the device")
    from loraplex.kernels.tuning_cases import AdapterMix, adapter_indices

    s = GPT_OSS_20B
    rows = []
    print("| layer | M | call us | sum of kernels us | kernels (us each) |")
    print("|---|---:|---:|---:|---|")
    for m in (int(v) for v in args.m.split(",")):
        inp = moe_inputs(s, m, "cuda", 3000 + m)
        lo = lora_inputs(s, m, inp["ids"], args.max_loras, args.rank, "cuda", torch.bfloat16)
        lo["idx"] = adapter_indices(m, AdapterMix(args.max_loras, args.mix), "cuda")
        splits = tuple(int(v) for v in args.shrink_split_k.split(",") if v)
        calls = variants(inp, lo, args.epilogue_max_block_m, splits)
        ref = calls["mxfp4 + LoRA, expands apart"]().float()
        delta = (ref - calls["mxfp4"]().float()).norm().item()
        extra = (() if args.epilogue_max_block_m is None else (epilogue_label(args.epilogue_max_block_m),)) + tuple(
            split_label(v) for v in splits)
        for label in CHECKED + extra:
            err = (calls[label]().float() - ref).norm().item() / max(ref.norm().item(), 1e-30)
            print(f"| M = {m}: {label} against the expands apart: relative error {err:.2e} (LoRA delta "
                  f"{delta / max(ref.norm().item(), 1e-30):.2e} of the output) |", flush=True)
            rows.append(dict(layer=f"check: {label} vs expands apart", m=m, rel_error=err,
                             lora_delta_rel=delta / max(ref.norm().item(), 1e-30)))
        for label, fn in calls.items():
            if not label.startswith(args.only):
                continue
            call = bench_time_ms(fn) * 1e3
            parts = kernel_times_us(fn)
            detail = ", ".join(f"{name} {us:.1f}" for name, us in sorted(parts.items(), key=lambda kv: -kv[1]))
            print(f"| {label} | {m} | {call:.1f} | {sum(parts.values()):.1f} | {detail} |", flush=True)
            rows.append(dict(layer=label, m=m, call_us=round(call, 2), kernels_us=round(sum(parts.values()), 2),
                             kernels={k: round(v, 2) for k, v in parts.items()}))
        del inp, lo
        torch.cuda.empty_cache()
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), shape="gpt-oss-20b experts", max_loras=args.max_loras,
                    rank=args.rank, mix=args.mix)
        with open(args.out, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
