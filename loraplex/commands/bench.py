"""``loraplex bench serve``: the GPT-OSS-20B multi-LoRA serving workload against the in-process engine.

The workload: the GPT-OSS-20B shape with dummy bf16 weights, N random PEFT adapters of rank r on attention and
experts (default 8 of rank 32, an even mix), random prompts of 1600 tokens, 600 output tokens each (EOS ignored),
a closed loop of C = 16 clients (``--stagger``: client k starts k * STAGGER s in), base-only and with adapters on
one engine. Method, targets and current figures: docs/performance.md.

    loraplex bench serve                                   # GPT-OSS-20B shape, 8 adapters r32, C=16, 64 requests
    loraplex bench serve --scale tiny --out /tmp/bench     # CPU smoke run (tiny model, short prompts)
    loraplex bench serve --num-requests 16 --output-len 256 --int8 --hf-baseline --out $OUT
    loraplex bench serve --tensor-parallel-size 2 --enforce-eager --out $OUT/tp2      # two GPUs (NCCL)
    loraplex bench serve --quantization int8 --work-dir /tmp/w   # INT8 experts only, adapters of an earlier stage
    loraplex bench serve --quantization mxfp4 --out $OUT          # MXFP4 experts only (GPT-OSS's native format)
    loraplex bench serve --hf-only --hf-output-len 32            # the HF transformers (+ PEFT) baseline only
    loraplex bench combine --out $OUT a/bench_serve.json b/bench_serve.json   # one table of several runs
    loraplex bench serve --speculative-method replay --num-speculative-tokens 3 --speculative-acceptance-length 2.5
                                                   # replayed proposals at a set acceptance (real propose/verify cost)

Reports per-request output tokens/s, TTFT p50/p99, TPOT, total throughput and peak memory for the base model
alone and with the adapters (same engine, same run), optionally with INT8 experts and HF transformers + PEFT.
Writes bench_serve.json and bench_serve.md into --out (rewritten after every scenario); setup costs (adapter
writes, engine start, warm-ups) are in the JSON's ``setup_s``, the engine's KV pool / CUDA graphs / TP in ``engine``.
"""
from __future__ import annotations

import argparse
import shlex

# --scale tiny shrinks the workload too unless a flag says otherwise.
TINY_DEFAULTS = dict(num_adapters=2, rank=4, concurrency=3, num_requests=5, input_len=24, output_len=6,
                     max_num_batched_tokens=64, block_size=4)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks of the engine", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench_command", required=True)
    s = sub.add_parser("serve", help="closed-loop serving benchmark (GPT-OSS-20B multi-LoRA workload)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--scale", choices=("full", "tiny"), default="full",
                   help="full: GPT-OSS-20B shape; tiny: toy model and workload for a CPU smoke run")
    s.add_argument("--num-adapters", type=int, default=None, help="adapters (default 8; tiny 2)")
    s.add_argument("--rank", type=int, default=None, help="adapter rank (default 32; tiny 4)")
    s.add_argument("--concurrency", type=int, default=None, help="clients in the closed loop (default 16)")
    s.add_argument("--num-requests", type=int, default=None, help="requests per scenario (default 64)")
    s.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 1600)")
    s.add_argument("--output-len", type=int, default=None, help="output tokens, EOS ignored (default 600)")
    s.add_argument("--mix", choices=("even", "zipf", "uniform"), default="even", help="adapter mix")
    s.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine step token budget (2048)")
    s.add_argument("--block-size", type=int, default=None, help="KV block size (16)")
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    s.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    s.add_argument("--no-base-only", action="store_true", help="skip the base-only scenario")
    s.add_argument("--no-warmup", action="store_true", help="skip the per-scenario warm-up")
    s.add_argument("--int8", action="store_true",
                   help="then start a second engine with INT8 experts and run the scenarios again")
    s.add_argument("--quantization", choices=("int8", "mxfp4"), default=None,
                   help="run the engine with INT8 or MXFP4 experts only (no float phase)")
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel ranks (GPUs 0..N-1 on CUDA; CPU processes over gloo otherwise)")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    s.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlapped decode steps (default: the engine's, on with CUDA graphs)")
    s.add_argument("--hf-baseline", action="store_true",
                   help="also time HF transformers (and + PEFT with one adapter) at batch = concurrency")
    s.add_argument("--hf-only", action="store_true", help="only the HF baseline (no engine scenarios)")
    s.add_argument("--hf-output-len", type=int, default=None, help="HF output tokens (default: --output-len)")
    s.add_argument("--stagger", type=float, default=0.0,
                   help="client k sends its first request k * STAGGER s in (0: all at once, so every wave's "
                        "prompts arrive together)")
    s.add_argument("--scenario-time", type=float, default=None,
                   help="seconds after which a scenario starts no new request")
    s.add_argument("--total-time", type=float, default=None,
                   help="hard limit in seconds for the whole run (running requests are aborted, later skipped)")
    s.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many decode steps per scenario, then one arrival (a new prompt's prefill "
                        "mixed with the decodes; torch profiler + cProfile; profile_*.txt in --out)")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning"),
                   help="engine log level (start-up: KV pool, CUDA graph capture, tensor-parallel workers)")
    _speculative_flags(s)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default=None, help="folder for bench_serve.json / bench_serve.md")
    s.add_argument("--work-dir", default=None,
                   help="where config.json and adapters go (default: temp); adapters already there are reused")
    s.set_defaults(func=run_serve)
    c = sub.add_parser("combine", help="one table of several bench_serve.json reports, checked against the serving "
                                       "workload's targets")
    c.add_argument("reports", nargs="+", help="bench_serve.json files; LABEL=PATH names a run (default: folder)")
    c.add_argument("--out", default=None, help="folder for bench_combined.json / bench_combined.md")
    c.set_defaults(func=run_combine)


def _speculative_flags(s) -> None:
    g = s.add_argument_group("speculative decoding (loraplex/bench/speculative.py)")
    g.add_argument("--speculative-method", choices=("ngram", "draft", "replay"), default=None,
                   help="replay: each scenario first runs without speculation (recorded), then replays those outputs "
                        "at the set acceptance: the real cost of proposing and verifying, labelled as replayed")
    g.add_argument("--num-speculative-tokens", type=int, default=3, help="k: drafts per sequence per step")
    g.add_argument("--speculative-draft-model", default=None, help="draft: folder with the draft's config.json "
                                                                    "(dummy weights, as the target's)")
    g.add_argument("--speculative-acceptance-length", type=float, default=None,
                   help="replay: mean tokens per verification, in [1, k + 1] (default: acceptance rate 0.8)")
    g.add_argument("--speculative-verify-cuda-graphs", action="store_true",
                   help="verify steps as decode rows through CUDA graphs (default: eager)")


def config_from_args(args):
    from loraplex.bench.serve import ServeBenchConfig

    kw = dict(TINY_DEFAULTS) if args.scale == "tiny" else {}
    for name in ("num_adapters", "rank", "concurrency", "num_requests", "input_len", "output_len",
                 "max_num_batched_tokens", "block_size"):
        value = getattr(args, name)
        if value is not None:
            kw[name] = value
    return ServeBenchConfig(scale=args.scale, mix=args.mix, device=args.device, dtype=args.dtype,
                            base_only=not args.no_base_only, warmup=not args.no_warmup, int8=args.int8,
                            hf_baseline=args.hf_baseline, hf_output_len=args.hf_output_len, hf_only=args.hf_only,
                            quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
                            enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                            scenario_time_s=args.scenario_time, stagger_s=args.stagger,
                            profile_steps=args.profile_steps, total_time_s=args.total_time, seed=args.seed,
                            out_dir=args.out, work_dir=args.work_dir,
                            speculative_method=args.speculative_method,
                            num_speculative_tokens=args.num_speculative_tokens,
                            speculative_draft_model=args.speculative_draft_model,
                            speculative_acceptance_length=args.speculative_acceptance_length,
                            speculative_verify_cuda_graphs=args.speculative_verify_cuda_graphs,
                            command=command_line(args), **kw)


def command_line(args) -> str:
    """The invocation, rebuilt from the parsed flags (works when called in-process, not only from a shell)."""
    parts = ["loraplex", "bench", "serve"]
    for key, value in vars(args).items():
        if key == "async_scheduling" and value is False:
            parts.append("--no-async-scheduling")
        if key in ("func", "command", "bench_command") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        parts += [flag] if value is True else [flag, shlex.quote(str(value))]
    return " ".join(parts)


def run_serve(args) -> int:
    from loraplex.bench.report import to_markdown
    from loraplex.bench.serve import run_serve_bench

    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"loraplex bench serve: {e}") from None
    report = run_serve_bench(cfg)
    print(to_markdown(report))
    return 0


def run_combine(args) -> int:
    from loraplex.bench.combine import combine_reports, write_combined

    try:
        combined = combine_reports(args.reports)
    except (OSError, ValueError) as e:
        raise SystemExit(f"loraplex bench combine: {e}") from None
    text = write_combined(combined, args.out)
    print(text)
    return 0
