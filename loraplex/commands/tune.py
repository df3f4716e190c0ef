"""``loraplex tune``: search Triton launch configs for a model's shapes on the current GPU and write
``tuning_configs/<device>/<op>.json`` through ``kernels.tuning.write_configs`` (the loader's naming function).

    loraplex tune --model gpt-oss-20b --rank 32 --m 1,16,64,128,256,512
    loraplex tune --model gpt-oss-20b --ops fused_moe_lora,lora_shrink --m 128,512 --time-budget 90 --out /tmp/t
    loraplex tune --model /path/to/checkpoint --out /tmp/tuning      # any MoE config.json the engine reads
    loraplex tune --model gpt-oss-20b --ops lora_shrink,lora_expand --lora-targets o   # the o projection's LoRA

For every tunable op (fused_moe, fused_moe_int8, fused_moe_mxfp4, lora_shrink, lora_expand, lora_shrink_expand
on the qkv and o projections, fused_moe_lora) and M, each candidate (block sizes, warps, stages, split-K, group
size; for the LoRA ops also programmatic dependent launch, "PDL", and fused_moe_lora's one-kernel path, "FUSED")
is timed by CUDA-graph replay with a cold L2 (``tuning_cases.bench_time_ms``) and the fastest wins. A candidate
that fails to launch or to be captured in a graph is skipped; one that would win is first checked against the
torch reference and refused when its error is more than twice the default config's and above 5e-3 (``accurate``);
benchmarks/kernels/check_gpu.py then checks the tuned configs against the references. Compiles are shared across
M (M is not a constexpr). ``--time-budget`` is shared out over the (op, M) cases in order, each getting its share
plus what earlier cases left; a case past its share keeps the best so far (candidates are ordered best bets first);
only the ``--ops`` cases' inputs are built.

The LoRA cases' adapters follow the serving mix per M (``tuning_cases.serving_mix``): from M = 64, 32 adapters
Zipf-distributed over the tokens through a table as wide as the engine's decode graph of M rows; below, 8 round
robin; from M = 1024, a mixed prefill + decode step (one prompt chunk beside M / 16 Zipf decodes).
``--max-loras N`` instead uses N adapters round robin at every M.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("tune", help="tune Triton kernel configs for a model on this GPU",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a preset (gpt-oss-20b, qwen3-30b-a3b) or a checkpoint folder with config.json")
    p.add_argument("--max-loras", type=int, default=None,
                   help="N adapters round robin at every M (default: the serving mix per M, see above)")
    p.add_argument("--rank", type=int, default=32, help="max LoRA rank (adapters are padded to it)")
    p.add_argument("--m", default="1,16,64,128,256,512", help="token counts to tune, comma-separated")
    p.add_argument("--ops", default="", help="only these ops (comma-separated tuning-file names)")
    p.add_argument("--lora-targets", default="qkv,o",
                   help="the attention projections whose dense LoRA ops are tuned (comma-separated: qkv, o); "
                        "the other's entries in the files are kept")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--out", default=None, help="tuning folder (default: LORAPLEX_TUNING_DIR or tuning_configs/)")
    p.add_argument("--time-budget", type=float, default=0.0, help="stop searching after this many seconds")
    p.set_defaults(func=run)


def resolve_shapes(model: str):
    from loraplex.kernels.tuning_cases import PRESETS, ModelShapes

    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    from loraplex.engine.config import ModelConfig

    return ModelShapes.from_model_config(ModelConfig.from_pretrained(model))


def parse_ms(text: str) -> list[int]:
    try:
        ms = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SystemExit(f"--m must be comma-separated integers, got {text!r}") from None
    if not ms or ms[0] < 1:
        raise SystemExit(f"--m needs positive token counts, got {text!r}")
    return ms


def parse_targets(text: str) -> tuple[str, ...]:
    """``--lora-targets``: the dense LoRA projections (qkv, o), in the order given, each once."""
    from loraplex.kernels.tuning_cases import DENSE_LORA_TARGETS

    targets = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [t for t in targets if t not in DENSE_LORA_TARGETS]
    if bad or not targets:
        raise SystemExit(f"--lora-targets takes one or more of {', '.join(DENSE_LORA_TARGETS)} "
                         f"(comma-separated), got {text!r}")
    return targets


# A candidate whose output is further from the reference than this is refused (``accurate``): twice the default
# config's relative error, and at least ERR_FLOOR (tilings and split-K orders round differently, so equal
# configs differ by up to about 1.5x; a miscompiled tile is off by orders of magnitude, or by a few rows).
ERR_FACTOR = 2.0
ERR_FLOOR = 5e-3


def accurate(err: float, default_err: float) -> bool:
    """Whether a candidate's relative error ``err`` is close enough to the default config's (NaN: never)."""
    return err <= max(ERR_FACTOR * default_err, ERR_FLOOR)


def tune_case(case, deadline: float) -> tuple[dict, float, float]:
    """(best config, its time ms, default time ms); candidates after ``deadline`` (time.monotonic) are skipped.
    A candidate faster than the best so far is checked against the torch reference (``case.check(cfg)``) before
    it wins: one that is not ``accurate`` (a tile Triton miscompiles) is refused with a warning. After the space,
    ``case.refine(best)`` (where the case has one) gives candidates built on the winner, tried the same way."""
    import torch

    from loraplex.kernels import tuning_cases

    default_ms = tuning_cases.bench_time_ms(lambda: case.run(case.default), strict=True)
    best, best_ms = dict(case.default), default_ms
    default_err = case.check(case.default) if case.check is not None else None

    def better(cfg: dict) -> float | None:
        """cfg's time if it beats the best so far and is accurate, else None."""
        try:
            ms = tuning_cases.bench_time_ms(lambda: case.run(cfg), strict=True)
        except Exception as e:  # noqa: BLE001  (out of resources etc.: skip the candidate)
            logger.info("%s M=%d: %s failed (%s)", case.label, case.m, cfg, type(e).__name__)
            torch.cuda.synchronize()
            return None
        if ms >= best_ms:
            return None
        if default_err is not None:
            err = case.check(cfg)
            if not accurate(err, default_err):
                logger.warning("%s M=%d: %s refused: relative error %.3g against the default config's %.3g",
                               case.label, case.m, cfg, err, default_err)
                return None
        return ms

    def search(cfgs) -> None:
        nonlocal best, best_ms
        for cfg in cfgs:
            if time.monotonic() > deadline:
                return
            ms = better(cfg)
            if ms is not None:
                best, best_ms = dict(cfg), ms

    search(case.space)
    if case.refine is not None:
        search(case.refine(dict(best)))
    return best, best_ms, default_ms


def case_deadline(start: float, budget: float, done: int, total: int) -> float:
    """End of case ``done`` (1-based) of ``total`` when ``budget`` seconds from ``start`` are shared out evenly,
    time left by earlier cases carried forward; no budget: never."""
    return start + budget * done / max(total, 1) if budget > 0 else float("inf")


def _emit(bar, line: str) -> None:
    """A result line printed above the progress bar, flushed (logs of a long tuning run stay live)."""
    bar.write(line)
    sys.stdout.flush()


def run(args) -> int:
    import torch

    from loraplex.engine.progress import progress
    from loraplex.kernels import tuning
    from loraplex.kernels.tuning_cases import serving_mix, tunable_cases

    if not torch.cuda.is_available():
        raise SystemExit("loraplex tune needs a CUDA GPU: the configs are specific to the device")
    shapes = resolve_shapes(args.model)
    ms = parse_ms(args.m)
    only = {o for o in args.ops.split(",") if o}
    targets = parse_targets(args.lora_targets)
    dtype = getattr(torch, args.dtype)
    device_name = torch.cuda.get_device_name()
    start = time.monotonic()
    results: dict[str, dict[str, dict[int, dict]]] = {}
    mix_of = (lambda m: args.max_loras) if args.max_loras else serving_mix  # noqa: E731
    mixes = ", ".join(f"M={m}: {mix_of(m)}" for m in ms) if args.max_loras is None else \
        f"{args.max_loras} adapters round robin"
    print(f"tuning {shapes.name} on {device_name}: M={ms}, rank={args.rank}; LoRA {mixes}")
    done, total = 0, None
    for m in ms:
        torch.manual_seed(m)
        cases = tunable_cases(shapes, m, mix_of(m), args.rank, dtype, "cuda", ops=only or None,
                              lora_targets=targets)
        total = total or len(cases) * len(ms)  # same ops at every M
        with progress(cases, desc=f"Tuning M={m}", unit="case") as bar:   # lines go above the bar
            for case in bar:
                done += 1
                deadline = case_deadline(start, args.time_budget, done, total)
                try:
                    best, best_ms, default_ms = tune_case(case, deadline)
                except Exception as e:  # noqa: BLE001  (the default itself failed: nothing to write for it)
                    _emit(bar, f"  {case.label:28s} M={m:<4d} FAILED: {type(e).__name__}: {str(e)[:200]}")
                    continue
                # gate_up and down of fused_moe_lora differ in shape, so both land in one file under two keys
                results.setdefault(case.op, {}).setdefault(tuning.shape_key(case.shape), {})[m] = best
                _emit(bar, f"  {case.label:28s} M={m:<4d} default {default_ms * 1e3:8.1f} us  tuned "
                           f"{best_ms * 1e3:8.1f} us  x{default_ms / best_ms:4.2f}  {best}")
        del cases, bar
        torch.cuda.empty_cache()
    for op, configs in results.items():
        path = tuning.write_configs(op, configs, device_name=device_name, root=args.out)
        print(f"wrote {path}")
    return 0
