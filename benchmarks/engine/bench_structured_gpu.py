"""TPOT with half the requests under a JSON schema vs all unconstrained, at the GPT-OSS-20B shape, on one GPU.

    PYTHONPATH=$PWD python3 benchmarks/engine/bench_structured_gpu.py                 # H200: about 3 minutes
    PYTHONPATH=$PWD python3 benchmarks/engine/bench_structured_gpu.py --scale tiny --device cpu   # smoke run

Needs llguidance (a no-dependency abi3 wheel: ``llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl`` serves
Python 3.9-3.13). When it does not import, the script installs the first ``llguidance-*.whl`` it finds in
``$LLGUIDANCE_WHEEL_DIR``, ``shared/wheels`` or ``.`` into a temporary folder (pip, ``--no-deps``, offline).

Workload: GPT-OSS-20B's config with dummy bf16 weights (``loraplex.bench.workload``), 8 random rank-16 PEFT
adapters (attention + experts, request i uses adapter i % 8), closed loop at concurrency 16, random prompts of
``--input-len`` tokens, ``--output-len`` new tokens per request (greedy, ``ignore_eos``). Tokenizer: the GPT-OSS
tokenizer files are not on the device, so a synthetic byte-level BPE of the same size (201,088 ids) is built at
run time (``grammar_vocab.py``, ~5 s) and saved beside the model config; the grammar library wraps it once
(reported as ``tokenizer_ms``). Constrained requests use one of 8 schemas (an object holding an array of at least
64 small objects: strings, bounded numbers, enums), so no document can end before ``--output-len`` and every
request decodes the same number of tokens as a free one.

Variants (CUDA graphs and overlapped scheduling on, as the engine defaults on a GPU):
    free           every request unconstrained
    half           every other request constrained (masks filled on the step thread, one row at a time)
    half_pool      the same with llguidance's thread pool filling the masks (``fill_threads``)

Checks: every constrained output is accepted token by token by a fresh matcher of its grammar, every request
decodes ``--output-len`` tokens. Reports TPOT (median and mean over requests, after the warm-up ones) per variant
and half/free, host ms per step spent filling masks and advancing matchers, the grammar cache's hit rate and
compile times of the engine's schemas, and compile + first-mask times of the 25 suite schemas
(engine/structured/schema_suite.py) against the 201k vocabulary. Prints a table; writes
``$OUT/bench_structured_gpu.json``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def ensure_llguidance() -> str:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        dirs = [os.environ.get("LLGUIDANCE_WHEEL_DIR", ""), "shared/wheels", "."]
        wheels = [w for d in dirs if d for w in sorted(glob.glob(os.path.join(d, "llguidance-*.whl")))]
        if not wheels:
            sys.exit("llguidance is not installed and no llguidance-*.whl was found in $LLGUIDANCE_WHEEL_DIR, "
                     "shared/wheels or .; carry llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl")
        target = tempfile.mkdtemp(prefix="llguidance-")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                        target, wheels[0]], check=True)
        sys.path.insert(0, target)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llguidance")
    except PackageNotFoundError:
        return "unknown"


def long_schema(k: int) -> dict:
    item = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                             "score": {"type": "number", "minimum": 0, "maximum": 100},
                                             "tag": {"enum": ["alpha", "beta", "gamma"]}},
            "required": ["name", "score", "tag"], "additionalProperties": False}
    return {"title": f"report-{k}", "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10**6},
                           "items": {"type": "array", "minItems": 64, "items": item}},
            "required": ["id", "items"], "additionalProperties": False}


def build(args, work: str):
    import torch

    from grammar_vocab import synthetic_bpe_tokenizer
    from loraplex.bench.workload import GPT_OSS_20B, GPT_OSS_TINY, write_model_config, write_random_adapters
    from loraplex.engine import LLMEngine
    from loraplex.engine.lora.fetch import file_uri
    from loraplex.engine.lora.manager import sha256_file
    from loraplex.engine.lora.ref import AdapterRef

    base = GPT_OSS_20B if args.scale == "full" else GPT_OSS_TINY
    t0 = time.perf_counter()
    tok = synthetic_bpe_tokenizer(base["vocab_size"])
    tok_dir = os.path.join(work, "tokenizer")
    tok.save_pretrained(tok_dir)
    tokenizer_build_s = time.perf_counter() - t0
    config = dict(base, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    model_dir = write_model_config(os.path.join(work, "model"), config)
    folders = write_random_adapters(os.path.join(work, "adapters"), config, num=args.adapters, rank=args.rank,
                                    device=args.device)
    refs = [AdapterRef(f"bench/a{k}/1", file_uri(f), sha256_file(os.path.join(f, "adapter_model.safetensors")))
            for k, f in enumerate(folders)]
    bs = 16
    max_len = args.input_len + args.output_len + bs
    blocks = -(-max_len // bs) * args.concurrency + 64
    engine = LLMEngine.from_pretrained(
        model_dir, tokenizer=tok_dir, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
        load_format="dummy", progress=False, max_model_len=max_len, max_num_seqs=args.concurrency,
        max_num_batched_tokens=4096, block_size=bs, num_kv_blocks=blocks, swap_space_bytes=0,
        enable_prefix_caching=False, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
        max_cpu_loras=max(16, args.adapters), adapter_cache_dir=os.path.join(work, "adapter-cache"))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, base["vocab_size"] - 16, (args.requests + args.warmup, args.input_len),
                            generator=gen).tolist()
    return engine, refs, prompts, tokenizer_build_s


def run_variant(engine, refs, prompts, args, constrained_every: int | None, label: str, pool: bool) -> dict:
    from loraplex.engine import SamplingParams
    from loraplex.engine.structured import StructuredOutput

    free = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    schemas = [long_schema(k) for k in range(8)]

    def params(i: int) -> tuple[SamplingParams, dict | None]:
        if constrained_every is None or i % constrained_every:
            return free, None
        schema = schemas[(i // constrained_every) % len(schemas)]
        return SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                              structured=StructuredOutput(json_schema=schema)), schema

    if engine.structured is not None:
        engine.structured.fill_threads = args.fill_threads if pool else 1
        fill0, adv0, rows0 = engine.structured.fill_s, engine.structured.advance_s, engine.structured.num_masked_rows
    total = args.warmup + args.requests
    next_i, in_flight, done, steps, overlapped0 = 0, {}, {}, 0, engine.num_overlapped_steps
    t_start = time.perf_counter()
    while len(done) < total:
        while next_i < total and len(in_flight) < args.concurrency:
            p, schema = params(next_i)
            rid = f"{label}-{next_i}"
            engine.add_request(rid, prompts[next_i], p, refs[next_i % len(refs)])
            in_flight[rid] = (next_i, schema)
            next_i += 1
        for out in engine.step():
            if out.finished:
                i, schema = in_flight.pop(out.request_id)
                done[i] = (out, schema)
        steps += 1
    wall = time.perf_counter() - t_start
    tpots, bad = [], []
    for i, (out, schema) in sorted(done.items()):
        if len(out.output_token_ids) != args.output_len:
            bad.append(f"request {i}: {len(out.output_token_ids)} tokens ({out.finish_reason}, {out.error})")
        if schema is not None and not grammar_accepts(engine, schema, out.output_token_ids):
            bad.append(f"request {i}: its tokens leave the grammar")
        m = out.metrics
        if i >= args.warmup and m.first_token_time is not None and len(out.output_token_ids) > 1:
            tpots.append((m.finished_time - m.first_token_time) / (len(out.output_token_ids) - 1) * 1e3)
    res = {"variant": label, "requests": args.requests, "steps": steps, "wall_s": wall,
           "tpot_ms_median": statistics.median(tpots), "tpot_ms_mean": statistics.fmean(tpots),
           "overlapped_steps": engine.num_overlapped_steps - overlapped0, "errors": bad[:10], "num_errors": len(bad)}
    if engine.structured is not None and constrained_every is not None:
        s = engine.structured
        res.update(fill_ms_per_step=(s.fill_s - fill0) * 1e3 / steps, advance_ms_per_step=(s.advance_s - adv0) * 1e3
                   / steps, masked_rows_per_step=(s.num_masked_rows - rows0) / steps)
    return res


def grammar_accepts(engine, schema: dict, tokens: list[int]) -> bool:
    from loraplex.engine.structured import StructuredOutput

    matcher = engine.structured.compiler.compile(StructuredOutput(json_schema=schema)).new_matcher()
    return matcher.advance_to(tokens)


def suite_compile_times(engine) -> dict:
    import torch

    from loraplex.engine.structured import StructuredOutput
    from loraplex.engine.structured.bitmask import bitmask_width
    from loraplex.engine.structured.schema_suite import SCHEMAS

    compiler = engine.structured.compiler
    mask = torch.zeros((1, bitmask_width(compiler.vocab_size)), dtype=torch.int32)
    comp, first = [], []
    for k, schema in enumerate(SCHEMAS.values()):
        t0 = time.perf_counter()
        m = compiler.compile(StructuredOutput(json_schema=dict(schema, title=f"fresh-{k}"))).new_matcher()
        t1 = time.perf_counter()
        m.fill_bitmask(mask, 0)
        first.append((time.perf_counter() - t1) * 1e3)
        comp.append((t1 - t0) * 1e3)
    return {"suite_schemas": len(comp), "compile_ms_median": statistics.median(comp), "compile_ms_max": max(comp),
            "first_mask_ms_median": statistics.median(first), "first_mask_ms_max": max(first)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["full", "tiny"], default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--fill-threads", type=int, default=8)
    args = ap.parse_args(argv)
    report = {"llguidance": ensure_llguidance(), "args": vars(args)}
    import torch

    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    report["host_cpus"] = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as work:
        t0 = time.perf_counter()
        engine, refs, prompts, report["tokenizer_build_s"] = build(args, work)
        report["engine_start_s"] = time.perf_counter() - t0
        engine._structured_decoding().compiler.warm()
        report["tokenizer_ms"] = engine.structured.compiler.tokenizer_ms
        report["async_scheduling"] = engine.async_scheduling
        report["cuda_graphs"] = engine.runner.num_cuda_graphs
        rows = [run_variant(engine, refs, prompts, args, None, "free", False),
                run_variant(engine, refs, prompts, args, 2, "half", False),
                run_variant(engine, refs, prompts, args, 2, "half_pool", True)]
        report["cache"] = engine.structured.cache.stats()
        report["suite_compile"] = suite_compile_times(engine)
        engine.close()
    free = rows[0]["tpot_ms_median"]
    for r in rows:
        r["tpot_vs_free"] = r["tpot_ms_median"] / free
    report["variants"] = rows
    print(f"GPT-OSS-20B shape ({args.scale}), C={args.concurrency}, {args.adapters} adapters, "
          f"in {args.input_len} / out {args.output_len}, llguidance {report['llguidance']}, "
          f"{report['host_cpus']} host CPUs, overlap {report['async_scheduling']}, graphs {report['cuda_graphs']}")
    print("| variant | TPOT p50 ms | TPOT mean ms | vs free | fill ms/step | advance ms/step | rows/step | "
          "overlapped steps | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['tpot_ms_median']:.2f} | {r['tpot_ms_mean']:.2f} | {r['tpot_vs_free']:.3f} | "
              f"{r.get('fill_ms_per_step', 0):.2f} | {r.get('advance_ms_per_step', 0):.2f} | "
              f"{r.get('masked_rows_per_step', 0):.1f} | {r['overlapped_steps']}/{r['steps']} | {r['num_errors']} |")
    c, s = report["cache"], report["suite_compile"]
    print(f"grammar cache: {c['hits']} hits / {c['misses']} misses (hit rate {c['hit_rate']:.2f}), engine schema "
          f"compile ms median {c['compile_ms_median']:.2f} max {c['compile_ms_max']:.2f}; tokenizer wrap "
          f"{report['tokenizer_ms']:.0f} ms")
    print(f"suite ({s['suite_schemas']} schemas, new each): compile ms median {s['compile_ms_median']:.2f} max "
          f"{s['compile_ms_max']:.2f}, first mask ms median {s['first_mask_ms_median']:.2f} max "
          f"{s['first_mask_ms_max']:.2f}")
    for r in rows:
        for e in r["errors"]:
            print(f"ERROR {r['variant']}: {e}")
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_structured_gpu.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    if any(r["num_errors"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
