"""``loraplex bench serve``: the GPT-OSS-20B multi-LoRA serving workload against the in-process engine, or end to
end through the platform's OpenAI endpoint (``--url``).

The workload: the GPT-OSS-20B shape with dummy bf16 weights, N random PEFT adapters of rank r on attention and
experts (default 8 of rank 32, an even mix), random prompts of 1600 tokens, 600 output tokens each (EOS ignored),
a closed loop of C = 16 clients (``--stagger``: client k starts k * STAGGER s in), base-only and with adapters on
one engine. Method, targets and current figures: docs/performance.md; scenarios and flags: docs/benchmarks.md.

    loraplex bench serve                                   # GPT-OSS-20B shape, 8 adapters r32, C=16, 64 requests
    loraplex bench serve --scale tiny --out /tmp/bench     # CPU smoke run (tiny model, short prompts)
    loraplex bench serve --num-requests 16 --output-len 256 --int8 --hf-baseline --out $OUT
    loraplex bench serve --tensor-parallel-size 2 --enforce-eager --out $OUT/tp2      # two GPUs (NCCL)
    loraplex bench serve --quantization mxfp4 --out $OUT          # MXFP4 experts only (GPT-OSS's native format)
    loraplex bench serve --hf-only --hf-output-len 32            # the HF transformers (+ PEFT) baseline only
  the consolidation envelope:
    loraplex bench serve --concurrency 1,16,64,128,256 --num-adapters 32 --mix zipf --scenario-time 30 \
        --results-dir benchmarks/results                         # concurrency sweep, one engine
    loraplex bench serve --scenario churn --num-adapters 64 --mix zipf --adapter-budget 16   # vs all resident
    loraplex bench serve --scenario fairness --light-rate 1 --heavy-n 1,64 --scheduling-policy fcfs,vtc
    loraplex bench serve --url http://host:8000/v1 --keys-file keys.json --concurrency 1,16,64   # end to end
    loraplex bench plot benchmarks/results/sweep-*.json --out docs/envelope.png
    loraplex bench combine --out $OUT a/bench_serve.json b/bench_serve.json   # one table of several runs
    loraplex bench serve --speculative-method replay --num-speculative-tokens 3 --speculative-acceptance-length 2.5
                                                   # replayed proposals at a set acceptance (real propose/verify cost)

Reports per-request output tokens/s, TTFT p50/p99, TPOT, total and steady throughput, peak memory, and per run
what the engine did (CUDA-graph steps, KV usage peak, resident adapters, adapter load latency, admission waits).
Writes bench_serve.json and bench_serve.md into --out and <scenario>-<model>-<precision>-<date>.json/.md into
--results-dir (rewritten after every run); setup costs (adapter writes, engine start, warm-ups) are in the JSON's
``setup_s``, the engine's KV pool / CUDA graphs / TP in ``engine``.
"""
from __future__ import annotations

import argparse
import shlex

# --scale tiny shrinks the workload too unless a flag says otherwise.
TINY_DEFAULTS = dict(num_adapters=2, rank=4, concurrency=3, num_requests=5, input_len=24, output_len=6,
                     max_num_batched_tokens=64, block_size=4)


_SERVE_DEFAULTS: dict = {}  # flag defaults: left out of the rebuilt command line


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
    s.add_argument("--concurrency", default=None,
                   help="clients in the closed loop (default 16); a comma-separated list runs the concurrency sweep "
                        "on one engine, e.g. 1,16,64,128,256")
    s.add_argument("--num-requests", type=int, default=None, help="requests per scenario (default 64)")
    s.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 1600)")
    s.add_argument("--output-len", type=int, default=None, help="output tokens, EOS ignored (default 600)")
    s.add_argument("--mix", choices=("even", "zipf", "uniform"), default="even", help="adapter mix")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="engine step token budget (default: the engine's, 4096 on CUDA)")
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
    s.add_argument("--mixed-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="steps with prefill chunks through CUDA graphs of token buckets (the engine's default)")
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
                   help="seconds after which a scenario (each sweep level) starts no new request; running ones "
                        "finish (the report counts the requests each completed)")
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
    s.add_argument("--results-dir", default=None,
                   help="also write the report as <scenario>-<model>-<precision>[-e2e]-<date>.json/.md here "
                        "(benchmarks/results/ for committed runs)")
    s.add_argument("--label", default=None,
                   help="the scenario part of the results name (default sweep / serve / churn / fairness), e.g. seed")
    s.add_argument("--work-dir", default=None,
                   help="where config.json and adapters go (default: temp); adapters already there are reused")
    e = s.add_argument_group("scenarios and load")
    e.add_argument("--scenario", choices=("load", "churn", "fairness"), default="load",
                   help="load: closed loop at each --concurrency level (several levels: the sweep, one engine); "
                        "churn: more adapters than the adapter budget holds, beside the same run with all resident; "
                        "fairness: a light tenant at a steady rate alone, then beside a heavy one")
    e.add_argument("--requests-per-client", type=int, default=None,
                   help="per level max(--num-requests, K x C) requests (default 2 in a sweep, else off)")
    e.add_argument("--repeats", type=int, default=1,
                   help="load: measure each level N times in a row on the same engine (rows '#1'..'#N'); the "
                        "adapters / base-only TPOT ratio is then that of the samples' mean TPOTs, with the "
                        "per-sample min and max beside it")
    e.add_argument("--ramp", default=None,
                   help="spread each level's first requests over this many seconds, or 'auto' (the previous "
                        "level's TTFT p50 + output-len x TPOT p50, at most --scenario-time; default in a sweep)")
    e.add_argument("--kv-sizing", choices=("workload", "engine"), default=None,
                   help="engine: the engine's own defaults (KV pool from free memory; the default at --scale full); "
                        "workload: max_num_seqs and the KV pool fit the workload exactly (the default at --scale "
                        "tiny)")
    e.add_argument("--cuda-graph-max-batch-size", type=int, default=None,
                   help="largest decode batch replayed from a CUDA graph (default: the engine's)")
    a = s.add_argument_group("adapters and their memory (churn)")
    a.add_argument("--adapter-files", type=int, default=None,
                   help="distinct adapter files (default: one per adapter); adapter k reads file k mod F, each "
                        "loaded and held as its own adapter: 64 adapters of 708 MB need not be written to disk")
    a.add_argument("--adapter-budget", type=int, default=None, metavar="ADAPTERS",
                   help="GPU memory for this many of the run's adapters (their rank and targets, at the engine's "
                        "dtype), passed to the engine as its adapter memory budget")
    a.add_argument("--adapter-memory-gib", type=float, default=None, help="the adapter memory budget in GiB")
    a.add_argument("--max-loras", type=int, default=None,
                   help="the engine's max_loras, a cap on distinct resident adapters (default: none; the adapter "
                        "memory budget decides)")
    a.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in CPU memory (default: max(16, adapters)); lower it to make the churn "
                        "reload from disk too")
    f = s.add_argument_group("tenants (fairness)")
    f.add_argument("--scheduling-policy", default=None,
                   help="comma-separated engine scheduling policies to compare, one engine each (fcfs, vtc); "
                        "default: the engine's")
    f.add_argument("--light-rate", type=float, default=1.0, help="light tenant's requests per second (open loop)")
    f.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson", help="open-loop arrival process")
    f.add_argument("--light-input-len", type=int, default=None, help="light requests' prompt tokens (--input-len)")
    f.add_argument("--light-output-len", type=int, default=None, help="light requests' output tokens (--output-len)")
    f.add_argument("--heavy-factor", type=float, default=10.0,
                   help="heavy tenant's open-loop rate as a multiple of the light rate (default 10)")
    f.add_argument("--heavy-concurrency", type=int, default=None,
                   help="run the heavy tenant as a closed loop of this many clients instead (a flood)")
    f.add_argument("--heavy-n", default="1",
                   help="completions per heavy request (n); comma-separated values run one scenario each, e.g. 1,64")
    f.add_argument("--light-weight", type=float, default=1.0, help="light tenant's scheduling weight")
    f.add_argument("--heavy-weight", type=float, default=1.0, help="heavy tenant's scheduling weight")
    r = s.add_argument_group("end to end through the platform")
    r.add_argument("--url", default=None, help="the platform's OpenAI API, e.g. http://127.0.0.1:8000/v1")
    r.add_argument("--api-key", default=None, help="one tenant's key (with --adapters)")
    r.add_argument("--adapters", default=None,
                   help="comma-separated adapter names of that tenant (their count is the run's adapter count)")
    r.add_argument("--keys-file", default=None,
                   help='JSON {"tenants": [{"name": "light", "key": "...", "adapters": ["bot"]}, ...]}; '
                        "fairness: the first tenant is the light one, the second the heavy one")
    r.add_argument("--base-model", default=None, help="the base model's name at the endpoint (default: the first "
                                                      "of /v1/models)")
    r.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn below this (default: the --scale model's vocabulary)")
    s.set_defaults(func=run_serve)
    _SERVE_DEFAULTS.update({a.dest: a.default for a in s._actions})
    c = sub.add_parser("combine", help="one table of several bench_serve.json reports, checked against the serving "
                                       "workload's targets")
    c.add_argument("reports", nargs="+", help="bench_serve.json files; LABEL=PATH names a run (default: folder)")
    c.add_argument("--out", default=None, help="folder for bench_combined.json / bench_combined.md")
    c.set_defaults(func=run_combine)
    pl = sub.add_parser("plot", help="PNG of output tok/s and TTFT p50/p99 against concurrency from sweep reports "
                                     "(needs matplotlib: pip install 'loraplex[bench]')")
    pl.add_argument("reports", nargs="+", help="sweep JSON reports; LABEL=PATH names a run (default: its results "
                                               "name); in-process and end-to-end runs go on one figure")
    pl.add_argument("--out", required=True, help="the PNG to write, e.g. docs/envelope-sweep.png")
    pl.add_argument("--title", default=None, help="figure title (default: the workload)")
    pl.set_defaults(func=run_plot)


def _csv(value: str | None, cast=str) -> tuple:
    if value is None:
        return ()
    try:
        return tuple(cast(v) for v in value.replace(" ", "").split(",") if v)
    except ValueError:
        raise ValueError(f"expected a comma-separated list, got {value!r}") from None


def _ramp(value: str | None):
    if value is None or value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"ramp must be 'auto' or seconds, got {value!r}") from None


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
    adapter_names = _csv(args.adapters)
    if adapter_names and args.num_adapters is None:
        kw["num_adapters"] = len(adapter_names)
    if args.keys_file and args.num_adapters is None:
        from loraplex.bench.remote import read_keys_file

        kw["num_adapters"] = len(read_keys_file(args.keys_file).adapters)
    return ServeBenchConfig(scale=args.scale, mix=args.mix, device=args.device, dtype=args.dtype,
                            base_only=not args.no_base_only, warmup=not args.no_warmup, int8=args.int8,
                            hf_baseline=args.hf_baseline, hf_output_len=args.hf_output_len, hf_only=args.hf_only,
                            quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
                            enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                            mixed_cuda_graphs=args.mixed_cuda_graphs,
                            scenario_time_s=args.scenario_time, stagger_s=args.stagger,
                            profile_steps=args.profile_steps, total_time_s=args.total_time, seed=args.seed,
                            out_dir=args.out, work_dir=args.work_dir, scenario=args.scenario,
                            requests_per_client=args.requests_per_client, repeats=args.repeats,
                            ramp=_ramp(args.ramp),
                            kv_sizing=args.kv_sizing, cuda_graph_max_batch_size=args.cuda_graph_max_batch_size,
                            adapter_files=args.adapter_files, adapter_budget=args.adapter_budget,
                            adapter_memory_gib=args.adapter_memory_gib, max_loras=args.max_loras,
                            max_cpu_loras=args.max_cpu_loras, scheduling_policies=_csv(args.scheduling_policy),
                            light_rate=args.light_rate, arrivals=args.arrivals, light_input_len=args.light_input_len,
                            light_output_len=args.light_output_len, heavy_factor=args.heavy_factor,
                            heavy_concurrency=args.heavy_concurrency, heavy_n=_csv(args.heavy_n, int),
                            light_weight=args.light_weight, heavy_weight=args.heavy_weight, url=args.url,
                            api_key=args.api_key, keys_file=args.keys_file, adapter_names=adapter_names,
                            base_model=args.base_model, vocab_size=args.vocab_size, results_dir=args.results_dir,
                            label=args.label, speculative_method=args.speculative_method,
                            num_speculative_tokens=args.num_speculative_tokens,
                            speculative_draft_model=args.speculative_draft_model,
                            speculative_acceptance_length=args.speculative_acceptance_length,
                            speculative_verify_cuda_graphs=args.speculative_verify_cuda_graphs,
                            command=command_line(args), **kw)


def command_line(args) -> str:
    """The invocation, rebuilt from the parsed flags (works when called in-process, not only from a shell)."""
    parts = ["loraplex", "bench", "serve"]
    for key, value in vars(args).items():
        if key in ("async_scheduling", "mixed_cuda_graphs") and value is False:
            parts.append("--no-" + key.replace("_", "-"))
        if key in ("func", "command", "bench_command") or value is None or value is False:
            continue
        if key in _SERVE_DEFAULTS and value == _SERVE_DEFAULTS[key]:
            continue
        if key == "api_key":
            value = "KEY"  # never a tenant's key in a report
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
    if cfg.sweep and (cfg.out_dir or cfg.results_dir):
        from loraplex.bench.plot import MatplotlibMissing, plot_report_files

        folder, stem = (cfg.results_dir, report["name"]) if cfg.results_dir else (cfg.out_dir, "bench_serve")
        try:
            print(f"plot: {plot_report_files([report], f'{folder}/{stem}.png')}")
        except MatplotlibMissing:
            print(f"plot: skipped (no matplotlib here); later: loraplex bench plot {folder}/{stem}.json --out "
                  f"{stem}.png")
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


def run_plot(args) -> int:
    from loraplex.bench.plot import MatplotlibMissing, plot_reports

    try:
        path = plot_reports(args.reports, args.out, title=args.title)
    except MatplotlibMissing as e:
        raise SystemExit(f"loraplex bench plot: {e}") from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"loraplex bench plot: {e}") from None
    print(f"wrote {path}")
    return 0
