"""Speculative decoding at the GPT-OSS-20B shape on one GPU: the real cost of proposing and verifying, with
*replayed proposals at a set acceptance length* (dummy weights make acceptance meaningless: every figure of a
replay variant is labelled so), bf16 and MXFP4 experts, verify steps eager and through CUDA graphs.

    PYTHONPATH=$PWD python3 benchmarks/engine/bench_spec_gpu.py                   # H200: about 4 minutes
    PYTHONPATH=$PWD python3 benchmarks/engine/bench_spec_gpu.py --output-len 300  # if time-bound
    PYTHONPATH=$PWD python3 benchmarks/engine/bench_spec_gpu.py --scale tiny --device cpu --output-len 24 \
        --input-len 64                                                              # CPU smoke run of the flow

Stages:
  1. check (tiny llama and gpt_oss checkpoints, float32, on the device's kernels): greedy tokens with speculation
     equal those without, base requests and two PEFT adapters (attention; experts on gpt_oss) mixed: replayed
     drafts with a wrong one planted and the *target deciding* (replay_forced off), verify steps eager and through
     the padded decode path (CUDA graphs on a GPU). PASS / FAIL per case.
  2. per expert format (bf16, then ``--quantization mxfp4``): one engine (GPT-OSS-20B config, dummy weights, 8
     random PEFT adapters r32 on attention + experts (distinct adapters read from ``--adapter-files`` 2 files, so
     the run writes 1.4 GB, not 5.6), C = 16 requests at once, request i on adapter i % 8,
     ``--input-len`` 1600 / ``--output-len`` 600 greedy tokens: one burst, so every prompt is computed before the
     first verify step and no arrival interrupts them; the serving workload's closed loop with arrivals is
     ``benchmarks/serve/run_h200.sh`` stages spec-bf16-L / spec-mxfp4-L), variants:
        plain              speculation off (the requests opt out); its outputs are the recording
        replay L (graphs)  L = 2.0, 2.5, 3.0 with k = 2, 3, 3 drafts (per-draft acceptance rate r with
                           1 + r + ... + r^k = L), verify steps through CUDA graphs (the decode graphs' rows)
        replay 3.0 eager   the same at L = 3.0 with every verify step eager
     Before the first measured variant, a warm-up of the same shapes (all C requests, prompts of ``--input-len``,
     12 output tokens, speculation off, then replayed at each k, eager and graphs): first-time JIT compiles and
     autotuning stay out of every variant's times.
     The replay proposer proposes the recording's next tokens with a wrong one planted after a Bernoulli(r) run,
     and the verifier keeps what the plan says (the target's own verdict is computed, sampled and discarded):
     every cost is real, the acceptance is set. Every token a sequence gets is the recording's (the one after a
     rejected or at the bonus position, and those sampled without drafts: after the prefill, the last one), so
     in bf16 on dummy weights, where the target's own argmax differs from the recording's, no sequence leaves its
     recording and steps drop to about output_len / L. A replay variant whose outputs differ from the recording
     or whose measured acceptance length is more than 10% off the set one (3 standard errors where that is
     wider: a small run) is a FAIL: the script exits 1.

Reported per variant: OTPS per request (mean of output tokens / end-to-end latency), TTFT and TPOT (means per
request; TPOT = (end-to-end - TTFT) / (output tokens - 1), so it counts the several tokens of a verify step), the
engine steps, the mean step time of pure decode steps (plain) or pure verify steps (replay) and tokens per such
step, measured acceptance length, proposer ms per step, verify steps through graphs. Prints a table; writes
``$OUT/bench_spec_gpu.json`` (rewritten after every variant, so a run stopped by ``--total-time`` keeps what it
measured). ``--variants 3.0/3/graphs`` runs one replay variant; ``--profile-steps N`` adds a torch profiler table of N
decode and N verify steps per expert format (``StepProfile``: wall vs device busy per step, host phases).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VARIANTS = ((2.0, 2, True), (2.5, 3, True), (3.0, 3, True), (3.0, 3, False))  # (length, k, graphs)


def parse_variants(text: str) -> tuple:
    """``--variants``: 'all', or comma-separated LENGTH/K/graphs|eager (e.g. 3.0/3/graphs) -> (length, k, graphs)."""
    if text == "all":
        return VARIANTS
    out = []
    for item in text.split(","):
        length, k, path = item.strip().split("/")
        if path not in ("graphs", "eager"):
            raise ValueError(f"--variants: {item!r}: the verify path is 'graphs' or 'eager'")
        out.append((float(length), int(k), path == "graphs"))
    return tuple(out)


# ---- 1. the check ------------------------------------------------------------------------------------------------
def check(device: str, work: str) -> list[dict]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.lora.ref import AdapterRef
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    results = []
    for family in ("llama", "gpt_oss"):
        base = make_tiny_checkpoint(family, os.path.join(work, f"tiny-{family}"))
        refs = []
        for name, r, seed in (("a", 4, 1), ("b", 8, 2)):
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            torch.manual_seed(seed)
            moe = family == "gpt_oss"
            cfg = LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else None)
            folder = os.path.join(work, f"tiny-{family}-{name}")
            get_peft_model(model, cfg).save_pretrained(folder)
            refs.append(AdapterRef(f"check/{family}-{name}/1", f"file://{folder}"))
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 11, 5, 9, 13, 6)]
        adapters = [None, refs[0], refs[1], refs[0], None, refs[1]]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

        def engine(spec=None):
            e = LLMEngine.from_pretrained(base, device=device, dtype="float32", block_size=16, max_num_seqs=8,
                                          num_kv_blocks=256, progress=False, enable_lora=True, max_loras=2,
                                          max_lora_rank=8, adapter_cache_dir=os.path.join(work, f"cache-{family}"),
                                          speculative=spec, eager_warmup_budget_s=0.0)  # a check, not timed
            for ref in refs:
                e.load_adapter(ref, wait=True)
            return e

        ref = engine()
        want = [o.output_token_ids for o in ref.generate(prompts, params, adapters)]
        ref.close()
        del ref
        for graphs in (False, True):
            e = engine(dict(method="replay", num_speculative_tokens=3, replay_acceptance_rate=0.6,
                            replay_forced=False, verify_cuda_graphs=graphs))
            for p, w in zip(prompts, want):
                e.spec.proposer.record(p, w)
            got = [o.output_token_ids for o in e.generate(prompts, params, adapters)]
            snap = e.spec.snapshot()
            mism = sum(g != w for g, w in zip(got, want))
            results.append(dict(family=family, verify="graphs" if graphs else "eager", mismatched_requests=mism,
                                acceptance_length=snap["acceptance_length"], graph_steps=snap["graph_steps"],
                                verify_steps=snap["verify_steps"], ok=mism == 0 and snap["accepted"] > 0
                                and (not graphs or snap["graph_steps"] > 0 or device == "cpu")))
            print(f"[check] {family} verify {results[-1]['verify']}: "
                  f"{'PASS' if results[-1]['ok'] else 'FAIL'} ({mism} of {len(want)} requests differ, acceptance "
                  f"length {snap['acceptance_length']:.2f}, {snap['graph_steps']}/{snap['verify_steps']} verify steps "
                  f"on graphs)", flush=True)
            e.close()
            del e
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


# ---- 2. the serving variants ---------------------------------------------------------------------------------------
def start_engine(args, work: str, quantization: str | None):
    from loraplex.bench.engine_setup import use_in_place_fetcher
    from loraplex.bench.serve import prepare_adapters
    from loraplex.bench.workload import GPT_OSS_20B, GPT_OSS_TINY, write_model_config
    from loraplex.engine import LLMEngine
    from loraplex.engine.lora.fetch import file_uri
    from loraplex.engine.lora.ref import AdapterRef

    import torch

    config = GPT_OSS_20B if args.scale == "full" else GPT_OSS_TINY
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model_dir = write_model_config(os.path.join(work, "model"), config)
    t0 = time.perf_counter()
    files = max(1, min(args.adapter_files, args.adapters))
    folders, _ = prepare_adapters(os.path.join(work, "adapters"), config, num=files, rank=args.rank,
                                  device=args.device, dtype=getattr(torch, dtype))
    adapters_s = time.perf_counter() - t0
    # adapter k reads file k % files: distinct adapters (own ids, own GPU copies) without writing 8 files of 700 MB
    refs = [AdapterRef(f"bench/adapter-{k}/1", file_uri(folders[k % files])) for k in range(args.adapters)]
    bs = 16
    max_len = args.input_len + args.output_len + bs
    t0 = time.perf_counter()
    engine = LLMEngine.from_pretrained(
        model_dir, device=args.device, dtype=dtype, load_format="dummy", progress=False, max_model_len=max_len,
        max_num_seqs=args.concurrency, max_num_batched_tokens=2048, block_size=bs,
        num_kv_blocks=-(-max_len // bs) * args.concurrency + 64, swap_space_bytes=0, enable_prefix_caching=False,
        enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, max_cpu_loras=max(16, args.adapters),
        adapter_cache_dir=os.path.join(work, "adapter-cache"), quantization=quantization,
        speculative=dict(method="replay", num_speculative_tokens=max(k for _, k, _ in args.variants),
                         replay_forced=True, verify_cuda_graphs=True))
    use_in_place_fetcher(engine)
    for ref in refs:
        engine.load_adapter(ref, wait=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    return engine, refs, config, dict(adapters_s=adapters_s, engine_start_s=time.perf_counter() - t0,
                                      cuda_graphs=engine.runner.num_cuda_graphs,
                                      verify_graphs=getattr(engine.spec.executor.verify_graphs, "num_graphs", 0))


def step_kind(out) -> str:
    """'decode' (every entry one token, no drafts), 'verify' (decodes, at least one with drafts) or 'mixed'."""
    if any(s.num_new_tokens != 1 + len(s.draft_token_ids) or not s.sample for s in out.scheduled):
        return "mixed"
    return "verify" if any(s.draft_token_ids for s in out.scheduled) else "decode"


def run_variant(engine, refs, prompts, args, label: str, speculative: bool, record: dict | None = None,
                profile: "StepProfile | None" = None) -> dict:
    """All prompts at once (C = len(prompts)), to completion; per-step times by kind, per-request rates;
    ``profile``: a torch profiler over some of its steps (``StepProfile``)."""
    import torch

    from loraplex.engine import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, speculative=speculative)
    kinds: list[str] = []
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        kinds.append(step_kind(out))
        return out

    engine.scheduler.schedule = watched
    spec0 = engine.spec.snapshot()
    finals, step_ms = {}, []
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"{label}-{i}", p, params, refs[i % len(refs)])
        t_start = time.perf_counter()
        while engine.has_unfinished_requests():
            if profile is not None:
                profile.before_step(len(step_ms))
            t0 = time.perf_counter()
            for o in engine.step():
                if o.finished:
                    finals[int(o.request_id.rsplit("-", 1)[1])] = o
            step_ms.append((time.perf_counter() - t0) * 1e3)
            if profile is not None:
                profile.after_step(kinds[-1] if kinds else "none", step_ms[-1])
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t_start
    finally:
        engine.scheduler.schedule = schedule
        if profile is not None:
            profile.close()
    spec1 = engine.spec.snapshot()
    kinds = kinds[:len(step_ms)]
    by_kind = {k: [t for t, kk in zip(step_ms, kinds) if kk == k] for k in ("decode", "verify", "mixed")}
    otps, tpot, ttft, e2e = [], [], [], []
    for o in finals.values():
        m, n = o.metrics, len(o.output_token_ids)
        e2e_s, ttft_s = m.finished_time - m.arrival_time, m.first_token_time - m.arrival_time
        otps.append(n / e2e_s)
        ttft.append(ttft_s * 1e3)
        e2e.append(e2e_s * 1e3)
        if n > 1:  # per request: the time after the first token over the tokens after it (speculation included)
            tpot.append((e2e_s - ttft_s) / (n - 1) * 1e3)
    d = {k: spec1[k] - spec0[k] for k in ("proposed", "accepted", "verified", "emitted", "verify_steps",
                                             "graph_steps", "propose_ms", "verify_ms")}
    res = dict(variant=label, requests=len(finals), output_len=args.output_len, wall_s=wall,
               otps_per_request=statistics.fmean(otps), tpot_ms=statistics.fmean(tpot) if tpot else None,
               ttft_ms=statistics.fmean(ttft), e2e_ms=statistics.fmean(e2e), steps=len(step_ms),
               **{f"{k}_steps": len(v) for k, v in by_kind.items()},
               **{f"{k}_step_ms": statistics.fmean(v) if v else None for k, v in by_kind.items()},
               acceptance_length=(d["accepted"] + d["verified"]) / d["verified"] if d["verified"] else None,
               tokens_per_verify_step=d["emitted"] / d["verify_steps"] if d["verify_steps"] else None,
               propose_ms_per_step=d["propose_ms"] / d["verify_steps"] if d["verify_steps"] else None,
               verify_steps_on_graphs=d["graph_steps"], verify_steps_total=d["verify_steps"],
               verifications=d["verified"],
               replayed=speculative,
               all_tokens=all(len(o.output_token_ids) == args.output_len for o in finals.values()))
    if record is not None:
        if speculative:  # forced replay reproduces the recording
            res["matches_recording"] = all(record[tuple(o.prompt_token_ids)] == o.output_token_ids
                                           for o in finals.values())
        else:
            for o in finals.values():
                record[tuple(o.prompt_token_ids)] = list(o.output_token_ids)
    return res


class StepProfile:
    """``--profile-steps N``: a torch profiler (CPU and CUDA activities) over N steps of one kind ('decode' in the
    plain variant, 'verify' in a replay one), started ``start`` steps into the variant (past the prefills), with the
    engine's host phases marked (``record_function``: spec.propose, scheduler.schedule, the step's execution,
    scheduler.update; the rest of ``LLMEngine.step`` is output building). Writes ``$OUT/profile_<name>.txt``: per
    step the wall time, the device's kernel and copy time (busy; wall - busy is device idle, host time not
    overlapped) and each marked phase's host time (waits on the device included: an overlapped decode step's
    update waits for the previous step's tokens), then the profiler's table sorted by device time; with
    ``trace`` also a gzipped Chrome trace. Profiled steps run slower than unprofiled ones (the profiler's own host
    cost): read the idle share and the phases, not the absolute wall."""

    PHASES = ("engine.propose", "engine.schedule", "engine.execute", "engine.update")

    def __init__(self, engine, kind: str, steps: int, path: str, *, start: int = 40, trace: bool = False) -> None:
        self.engine, self.kind, self.steps, self.path, self.start, self.trace = engine, kind, steps, path, start, trace
        self.prof = None
        self.wall_ms: list[float] = []
        self.summary: dict | None = None
        self._undo: list = []

    def _mark(self, obj, attr: str, label: str) -> None:
        import torch

        fn = getattr(obj, attr)

        def marked(*a, **kw):
            with torch.profiler.record_function(label):
                return fn(*a, **kw)
        self._undo.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, marked)

    def before_step(self, index: int) -> None:
        import torch

        if self.prof is not None or self.summary is not None or index < self.start:
            return
        e = self.engine
        self._mark(e.spec, "propose", "engine.propose")
        self._mark(e.scheduler, "schedule", "engine.schedule")
        for obj, attr in ((e.spec, "execute"), (e.runner, "execute"), (e.runner, "launch_decode")):
            self._mark(obj, attr, "engine.execute")
        self._mark(e.scheduler, "update", "engine.update")
        self._mark(e.scheduler, "update_resolved", "engine.update")
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()

    def after_step(self, kind: str, wall_ms: float) -> None:
        if self.prof is None:
            return
        if kind == self.kind:
            self.wall_ms.append(wall_ms)
        if len(self.wall_ms) >= self.steps:
            self.close()

    def close(self) -> None:
        import torch

        if self.prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        prof, self.prof = self.prof, None
        for obj, attr, before in reversed(self._undo):
            if before is None:
                delattr(obj, attr)  # the class's method again
            else:
                setattr(obj, attr, before)  # a wrapper the benchmark had set (run_variant's step watcher)
        self._undo.clear()
        n = max(len(self.wall_ms), 1)
        events = prof.key_averages()

        def dev_us(e) -> float:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)

        busy_us = sum(dev_us(e) for e in events)
        phases = {e.key: e.cpu_time_total / 1e3 / n for e in events if e.key in self.PHASES}
        wall = statistics.fmean(self.wall_ms) if self.wall_ms else float("nan")
        self.summary = dict(kind=self.kind, steps=len(self.wall_ms), wall_ms_per_step=wall,
                            device_busy_ms_per_step=busy_us / 1e3 / n,
                            device_idle_ms_per_step=wall - busy_us / 1e3 / n,
                            host_phase_ms_per_step=phases)
        lines = [f"{self.kind} steps: {len(self.wall_ms)} profiled (other steps in the window are included in the "
                 f"table; in a steady run there are none)",
                 f"wall ms / step {wall:.3f}   device busy ms / step {busy_us / 1e3 / n:.3f}   device idle ms / step "
                 f"{wall - busy_us / 1e3 / n:.3f}",
                 "host phases ms / step: " + ", ".join(f"{k.split('.')[1]} {v:.3f}" for k, v in phases.items()),
                 "", events.table(sort_by="self_device_time_total" if torch.cuda.is_available()
                                  else "self_cpu_time_total", row_limit=45, max_name_column_width=60)]
        with open(self.path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        if self.trace:
            prof.export_chrome_trace(self.path.replace(".txt", ".trace.json.gz"))  # gzip: files come back <= 16 MiB


def warm_up(engine, refs, args, config: dict, phase: str, graphs: tuple) -> None:
    """The measured shapes once before the first measured variant (first-time JIT compiles and autotuning land
    here, not in a variant's times): all C requests with prompts of ``--input-len`` (other tokens than the measured
    ones), a few output tokens, speculation off, then replayed at every variant's k, verify eager and through
    graphs."""
    from loraplex.bench.workload import request_plan
    from loraplex.engine.spec_decode import acceptance_rate_for

    plan = request_plan(num_requests=args.concurrency, num_adapters=args.adapters, mix="even",
                        input_len=args.input_len, vocab=config["vocab_size"], seed=1)
    prompts = [p.prompt for p in plan]
    short = argparse.Namespace(**{**vars(args), "output_len": min(12, args.output_len)})
    spec, replay = engine.spec, engine.spec.proposer
    record: dict = {}
    run_variant(engine, refs, prompts, short, f"{phase}-warm", False, record)
    for p, toks in record.items():
        replay.record(list(p), toks)
    for k in sorted({k for _, k, _ in args.variants}):
        for use_graphs in sorted({g for _, kk, g in args.variants if kk == k}):
            spec.num_speculative_tokens = replay.k = k
            replay.rate = acceptance_rate_for(min(k + 1.0, 3.0), k)
            if not use_graphs:
                spec.executor.verify_graphs = spec.executor.decode_graphs = None
            try:
                run_variant(engine, refs, prompts, short, f"{phase}-warm-k{k}-{int(use_graphs)}", True)
            finally:
                spec.executor.verify_graphs, spec.executor.decode_graphs = graphs


def acceptance_tolerance(length: float, k: int, rate: float, verified: int) -> float:
    """How far a measured acceptance length may be off the set one: 10%, or 3 standard errors of the mean over
    ``verified`` verifications where that is wider (a small run: the accepted count per verification is 0..k,
    P(a) = rate^a (1 - rate) for a < k, rate^k for a = k)."""
    p = [rate ** a * (1 - rate) for a in range(k)] + [rate ** k]
    mean = sum(a * q for a, q in enumerate(p))
    sd = sum((a - mean) ** 2 * q for a, q in enumerate(p)) ** 0.5
    return max(0.1 * length, 3 * sd / max(verified, 1) ** 0.5)


def replay_failures(res: dict) -> list[str]:
    """What makes a replay variant's figures meaningless: outputs off the recording, or a measured acceptance
    length off the set one by more than ``acceptance_tolerance`` (10% on a full run)."""
    bad = []
    if not res.get("matches_recording"):
        bad.append("outputs differ from the recording")
    got, want = res.get("acceptance_length"), res["set_acceptance_length"]
    tol = res["acceptance_tolerance"]
    if got is None or abs(got - want) > tol:
        bad.append(f"acceptance length {got if got is None else round(got, 3)} is more than {tol:.3f} off the set "
                   f"{want}")
    return [f"{res['variant']}: {b}" for b in bad]


def serve_stage(args, work: str, quantization: str | None, deadline: float, report: dict, emit) -> None:
    import torch

    from loraplex.bench.workload import request_plan
    from loraplex.engine.spec_decode import acceptance_rate_for

    phase = quantization or ("bf16" if args.device == "cuda" else "float32")
    engine, refs, config, info = start_engine(args, work, quantization)
    report["engines"][phase] = info
    print(f"[bench] {phase}: engine started in {info['engine_start_s']:.1f} s, {info['cuda_graphs']} decode graphs, "
          f"{info['verify_graphs']} verify graphs", flush=True)
    plan = request_plan(num_requests=args.concurrency, num_adapters=args.adapters, mix="even",
                        input_len=args.input_len, vocab=config["vocab_size"], seed=0)
    prompts = [p.prompt for p in plan]
    spec = engine.spec
    replay = spec.proposer
    graphs = (spec.executor.verify_graphs, spec.executor.decode_graphs)
    t0 = time.perf_counter()
    warm_up(engine, refs, args, config, phase, graphs)
    info["warm_up_s"] = time.perf_counter() - t0
    print(f"[bench] {phase}: warm-up {info['warm_up_s']:.1f} s", flush=True)
    record: dict = {}
    out_dir = os.environ.get("OUT", ".")

    def profile_for(kind: str, name: str) -> StepProfile | None:
        if not args.profile_steps or report["profiled"].get(f"{phase} {kind}"):
            return None
        return StepProfile(engine, kind, args.profile_steps, os.path.join(out_dir, f"profile_{phase}_{kind}.txt"),
                           start=min(40, args.output_len // 4), trace=args.profile_trace and kind == "verify")

    def keep_profile(prof: StepProfile | None, res: dict) -> None:
        if prof is not None and prof.summary is not None:
            report["profiled"][f"{phase} {prof.kind}"] = res["profile"] = prof.summary

    prof = profile_for("decode", "plain")
    res = run_variant(engine, refs, prompts, args, f"{phase} plain", False, record, prof)
    keep_profile(prof, res)
    report["variants"].append(dict(res, phase=phase))
    print(f"[bench] {phase} plain: {res['otps_per_request']:.1f} OTPS/request, TPOT {res['tpot_ms']:.2f} ms, "
          f"{res['steps']} steps, mixed step {res['mixed_step_ms'] or float('nan'):.1f} ms", flush=True)
    emit()
    for p, toks in record.items():
        replay.record(list(p), toks)
    for length, k, use_graphs in args.variants:
        name = f"{phase} replay L={length} k={k} {'graphs' if use_graphs else 'eager'}"
        if time.monotonic() > deadline:
            report["skipped"].append(f"{name} (--total-time)")
            continue
        spec.num_speculative_tokens = replay.k = k
        replay.rate = acceptance_rate_for(length, k)
        if not use_graphs:
            spec.executor.verify_graphs = spec.executor.decode_graphs = None
        prof = profile_for("verify", name) if use_graphs else None
        try:
            res = run_variant(engine, refs, prompts, args, name, True, record, prof)
        finally:
            spec.executor.verify_graphs, spec.executor.decode_graphs = graphs
        keep_profile(prof, res)
        res.update(phase=phase, set_acceptance_length=length, k=k, rate=replay.rate, verify="graphs" if use_graphs
                   else "eager", label="replayed proposals at a set acceptance rate (dummy weights)",
                   acceptance_tolerance=acceptance_tolerance(length, k, replay.rate, res["verifications"]))
        report["variants"].append(res)
        report["failures"] += replay_failures(res)
        print(f"[bench] {name}: {res['otps_per_request']:.1f} OTPS/request, TPOT {res['tpot_ms']:.2f} ms, verify "
              f"step {res['verify_step_ms'] or float('nan'):.2f} ms, acceptance {res['acceptance_length'] or 0:.2f} "
              f"(set {length}), {res['steps']} steps, matches recording: {res['matches_recording']}", flush=True)
        emit()
    engine.close()
    del engine
    import gc

    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def table(report: dict) -> str:
    rows = ["| variant | OTPS / request | TTFT ms | TPOT ms | steps | decode step ms | verify step ms | "
            "tokens / verify step | acceptance length | proposer ms / step | verify steps on graphs |", "|" + "---|" * 11]
    for v in report["variants"]:
        def f(key, fmt="{:.2f}"):
            return fmt.format(v[key]) if v.get(key) is not None else "-"
        graphs = f"{v['verify_steps_on_graphs']}/{v['verify_steps_total']}" if v.get("verify_steps_total") else "-"
        rows.append(f"| {v['variant']}{' (replayed)' if v.get('replayed') else ''} | {f('otps_per_request', '{:.1f}')}"
                    f" | {f('ttft_ms', '{:.1f}')} | {f('tpot_ms')} | {v['steps']} | {f('decode_step_ms')} | "
                    f"{f('verify_step_ms')} | {f('tokens_per_verify_step')} | {f('acceptance_length')} | {f('propose_ms_per_step', '{:.3f}')}"
                    f" | {graphs} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["full", "tiny"], default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--adapter-files", type=int, default=2, help="distinct adapter files (adapter k reads k %% F)")
    ap.add_argument("--input-len", type=int, default=1600)
    ap.add_argument("--output-len", type=int, default=600)
    ap.add_argument("--quantizations", default="none,mxfp4", help="expert formats, in order: none (bf16), mxfp4")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--total-time", type=float, default=235.0, help="no new variant starts after this many seconds")
    ap.add_argument("--work-dir", default=None, help="model config and adapters (reused when already there)")
    ap.add_argument("--variants", default="all", help="replay variants: 'all' or LENGTH/K/graphs|eager, comma "
                    "separated (e.g. 3.0/3/graphs)")
    ap.add_argument("--profile-steps", type=int, default=0, help="torch profiler over this many decode steps (plain) "
                    "and verify steps (first graphs replay variant) per expert format: $OUT/profile_*.txt (0: off)")
    ap.add_argument("--profile-trace", action="store_true", help="with --profile-steps: also a Chrome trace of the "
                    "verify steps ($OUT/profile_*_verify.trace.json.gz)")
    args = ap.parse_args()
    args.variants = parse_variants(args.variants)
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.monotonic()
    deadline = t_start + args.total_time
    import torch

    env = dict(python=sys.version.split()[0], torch=torch.__version__,
               device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    report = dict(env=env, args=vars(args), check=[], engines={}, variants=[], skipped=[], failures=[], profiled={},
                  note="replay variants: proposals replayed from the plain run at a set acceptance rate; dummy "
                       "weights, so acceptance is set, not measured; every cost (propose, verify forward, "
                       "acceptance, KV rollback) is real")
    path = os.path.join(out_dir, "bench_spec_gpu.json")

    def emit() -> None:
        report["elapsed_s"] = time.monotonic() - t_start
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)

    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        work = args.work_dir or tmp
        if not args.skip_check:
            report["check"] = check(args.device, os.path.join(work, "check"))
            emit()
        for q in args.quantizations.split(","):
            if time.monotonic() > deadline:
                report["skipped"].append(f"{q} (--total-time)")
                continue
            serve_stage(args, work, None if q == "none" else q, deadline, report, emit)
    emit()
    print(table(report))
    for name, p in report["profiled"].items():
        print(f"profile {name}: {p['steps']} steps, wall {p['wall_ms_per_step']:.2f} ms, device busy "
              f"{p['device_busy_ms_per_step']:.2f} ms, idle {p['device_idle_ms_per_step']:.2f} ms; host phases ms: "
              + ", ".join(f"{k.split('.')[1]} {v:.2f}" for k, v in p["host_phase_ms_per_step"].items()))
    if report["check"]:
        print("check:", "PASS" if all(c["ok"] for c in report["check"]) else "FAIL")
    if report["skipped"]:
        print("skipped:", ", ".join(report["skipped"]))
    for line in report["failures"]:
        print("FAIL:", line)
    print(f"elapsed {report['elapsed_s']:.0f} s; {path}")
    if report["failures"] or (report["check"] and not all(c["ok"] for c in report["check"])):
        sys.exit(1)


if __name__ == "__main__":
    main()
