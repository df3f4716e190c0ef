"""Host (Python) time of one engine decode step, per phase, with the model's own compute taken out.

    python3 benchmarks/engine/bench_step_overhead.py                      # 16 and 64 sequences, all variants
    python3 benchmarks/engine/bench_step_overhead.py --batches 16 --variants greedy --steps 64
    python3 benchmarks/engine/bench_step_overhead.py --device cuda          # captured graphs, on a GPU
    python3 benchmarks/engine/bench_step_overhead.py --batches 16 --variants greedy+lora --spec 3 \
        --profile 25                                # decode vs verify steps (k = 3, L = 3), cProfile top 25
    python3 benchmarks/engine/bench_step_overhead.py --batches 16 --variants greedy+lora --spec 3 \
        --async-scheduling                          # verify steps overlapped: the "exposed" column

A tiny random llama (hidden 72, vocab ``--vocab``, with its byte-level tokenizer) runs on CPU through
``LLMEngine.step`` with the padded decode path of the CUDA-graph runs (``init_decode_graphs(capture=False)``),
so the host-side work is the same as on the GPU. Every phase is timed with ``time.perf_counter`` wrappers (``--clock``):

    schedule   Scheduler.schedule
    pack       decode input packing (DecodeGraphs._write_inputs; ModelRunner.prepare on the eager path)
    model      the model forward and compute_logits (device work on a GPU: excluded from "host")
    sample     Sampler.forward (on a GPU mostly device work plus the .tolist() sync)
    runner     the rest of ModelRunner.execute (row bookkeeping, result dicts)
    update     Scheduler.update
    output     the rest of LLMEngine.step: detokenizer, stop strings, RequestOutput building
    deliver    AsyncEngine's hand-off of the step's outputs to asyncio (``--no-async`` leaves it out)
    host       the sum of the phases' medians but "model": the host time a decode step adds to TPOT (on a GPU
               "sample" is mostly device work: argmax, or sort and softmax for sampled rows)
    exposed    "host" less what runs while the next step is in flight: with ``--async-scheduling``, verify steps
               that all left the next one in flight: "output" and "deliver"; otherwise "host"

Phase times are exclusive (a timed call inside another counts once, in its own phase). A logits hook (timed as
"model") makes every sequence write real text, so the detokenizer sees what a real
model emits. Only steps where every running sequence decodes one token count (median over ``--steps`` such
steps, after ``--output-len`` tokens of warm-up history). Variants: greedy / sampled (temperature 0.8, top-p
0.95, top-k 50), base / 8 adapters (PEFT, ranks 8 and 16, request i uses adapter i % 8). Numbers are µs per step. With
``--device cuda`` the decode graphs are captured and every model call synchronizes, so "model" holds the device
time and the other phases are host time only (the engine itself overlaps a little of the two).

``--spec K``: each variant is measured twice, as plain decode steps and as speculative verify steps with K drafts
per sequence (replayed proposals of the plain run at acceptance length ``--spec-length``, forced, verify rows
through the padded decode path as with ``verify_cuda_graphs``). Only steps where every running sequence verifies
drafts count. Extra phases: "propose" (SpecDecoder.propose) and, for verify steps, "pack" holds the row building
(VerifyExecutor._graph_step) and "sample" the acceptance (VerifyExecutor._verify, _verify_outcomes).
``--async-scheduling`` turns on overlapped scheduling (verify steps stay in flight while the previous step's
outputs are built and delivered; plain decode steps do not overlap here: the text-forcing logits hook keeps them
synchronous). ``--clock thread`` times with the main thread's CPU time instead of wall time: on a shared machine
the time the thread waits descheduled drops out (steadier; blocking waits, e.g. a device sync, drop out too, so
use it on CPU only). ``--profile N`` runs cProfile
over the timed steps ("model" calls left out) and prints the N functions with the largest own time, µs per step.
On CPU, vocabulary-sized work (argmax, gathers of logits rows) is host time but device work on a GPU: a small
``--vocab`` (1024) keeps it near a kernel launch's cost.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

_clock = time.perf_counter  # --clock thread: time.thread_time
PHASES = ("propose", "schedule", "pack", "model", "sample", "runner", "update", "output", "deliver", "host",
          "exposed")


class _Timer:
    """Accumulates seconds per phase for the current step; ``wrap`` times a callable into a phase. Times are
    exclusive: a wrapped call inside another counts for its own phase only."""

    def __init__(self) -> None:
        self.cur: dict[str, float] = defaultdict(float)
        self.profile: cProfile.Profile | None = None  # while set and on, "model" calls are left out of it
        self._inner: list[float] = []  # per open wrapped call: seconds spent in wrapped calls inside it

    def wrap(self, phase: str, fn):
        cur, inner = self.cur, self._inner

        def timed(*a, **kw):
            prof = self.profile if phase == "model" else None
            if prof is not None:
                prof.disable()
            inner.append(0.0)
            t0 = _clock()
            try:
                return fn(*a, **kw)
            finally:
                elapsed = _clock() - t0
                cur[phase] += elapsed - inner.pop()
                if inner:
                    inner[-1] += elapsed
                if prof is not None:
                    prof.enable()
        return timed


def _synced(fn, device: torch.device):
    """``fn`` followed by a device synchronize on CUDA, so its device time lands in the phase that times it."""
    if device.type != "cuda":
        return fn

    def run(*a, **kw):
        r = fn(*a, **kw)
        torch.cuda.synchronize(device)
        return r
    return run


class _TimedModel:
    """Proxy of the model that times its forward and compute_logits (device work included) as "model"."""

    def __init__(self, model, timer: _Timer, device: torch.device) -> None:
        self._model = model
        self.compute_logits = timer.wrap("model", _synced(model.compute_logits, device))
        self._call = timer.wrap("model", _synced(model.__call__, device))

    def __call__(self, *a, **kw):
        return self._call(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


class _TimedGraph:
    """A captured decode graph whose replay (and its device time) is timed as "model"."""

    def __init__(self, graph, timer: _Timer, device: torch.device) -> None:
        self.replay = timer.wrap("model", _synced(graph.replay, device))


class _AsyncSink:
    """An asyncio loop in its own thread and an AsyncEngine-style deliverer (the engine's real hand-off code)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.received = 0

    def make(self, engine):
        from loraplex.engine.async_engine import AsyncEngine

        ae = AsyncEngine.__new__(AsyncEngine)  # the delivery methods only; no engine thread
        ae.engine = engine
        ae._sinks = {}
        return ae

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def make_checkpoint(tmp: str, vocab: int) -> str:
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", os.path.join(tmp, "base"), vocab_size=vocab,
                                max_position_embeddings=2048)


def make_adapters(base: str, tmp: str, n: int) -> list[str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = []
    for i in range(n):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        torch.manual_seed(i)
        cfg = LoraConfig(r=8 if i % 2 == 0 else 16, lora_alpha=16, init_lora_weights=False,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        folder = os.path.join(tmp, f"adapter{i}")
        get_peft_model(model, cfg).save_pretrained(folder)
        folders.append(folder)
    return folders


def measure(base: str, adapters: list[str], batch: int, sampled: bool, args, spec: bool = False) -> dict[str, float]:
    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.lora.ref import AdapterRef

    kw = dict(device=args.device, dtype="float32", block_size=16,
              max_num_seqs=batch, max_num_batched_tokens=4096, progress=False, enable_prefix_caching=False,
              max_model_len=2048, num_kv_blocks=batch * 2048 // 16 + 16, num_cpu_blocks=0,
              async_scheduling=args.async_scheduling)
    if spec:
        from loraplex.engine.spec_decode import acceptance_rate_for

        kw.update(speculative=dict(method="replay", num_speculative_tokens=args.spec, replay_forced=True,
                                   replay_acceptance_rate=acceptance_rate_for(args.spec_length, args.spec),
                                   verify_cuda_graphs=True))
    if adapters:
        kw.update(enable_lora=True, max_loras=len(adapters), max_lora_rank=16, max_cpu_loras=len(adapters),
                  adapter_cache_dir=os.path.join(args.tmp, "cache"))
    engine = LLMEngine.from_pretrained(base, **kw)
    runner = engine.runner
    if args.device == "cpu" and not args.eager:
        runner.init_decode_graphs(capture=False)  # the graphs' padded static-buffer path, run eagerly
    elif args.eager:
        runner.decode_graphs = None
    refs = [AdapterRef(f"bench/a{i}/1", f"file://{f}") for i, f in enumerate(adapters)]
    for ref in refs:
        assert engine.load_adapter(ref, wait=True) == "ready", engine.adapters.error(ref)

    timer = _Timer()
    cur = timer.cur
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update = timer.wrap("update", engine.scheduler.update)
    runner.execute = timer.wrap("execute", runner.execute)
    runner.prepare = timer.wrap("pack", runner.prepare)
    runner._set_lora_tokens = timer.wrap("pack", runner._set_lora_tokens)
    if runner.decode_graphs is not None:
        g = runner.decode_graphs
        g._write_inputs = timer.wrap("pack", g._write_inputs)
        g._graphs = {b: _TimedGraph(graph, timer, runner.device) for b, graph in g._graphs.items()}
    runner.sampler.forward = timer.wrap("sample", runner.sampler.forward)
    runner.model = _TimedModel(runner.model, timer, runner.device)
    runner.logits_hook = timer.wrap("model", _text_forcer(engine))
    if spec:
        sd = engine.spec
        sd.propose = timer.wrap("propose", sd.propose)
        sd.execute = timer.wrap("execute", sd.execute)
        sd.launch, sd.finish = timer.wrap("execute", sd.launch), timer.wrap("execute", sd.finish)
        ex = sd.executor
        ex._graphs_for = timer.wrap("pack", ex._graphs_for)
        ex._run_rows = timer.wrap("pack", ex._run_rows)
        ex._verify = timer.wrap("sample", ex._verify)
        ex._verify_outcomes = timer.wrap("sample", ex._verify_outcomes)
        if ex.verify_graphs is not None:
            ex.verify_graphs._write_inputs = timer.wrap("pack", ex.verify_graphs._write_inputs)
            ex.verify_graphs._graphs = {b: _TimedGraph(graph, timer, runner.device)
                                        for b, graph in ex.verify_graphs._graphs.items()}

    sink = _AsyncSink() if not args.no_async else None
    deliverer = sink.make(engine) if sink else None
    max_tokens = args.output_len + (args.steps + 8) * (1 + (args.spec if spec else 0))
    if sampled:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, top_k=50,
                                ignore_eos=True, seed=None)
    else:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
    if spec:  # the plain run's outputs are the replay proposer's recording
        plain = dataclasses.replace(params, speculative=False)
        outs = engine.generate(prompts, plain, [refs[i % len(refs)] if refs else None for i in range(batch)])
        for p, o in zip(prompts, outs):
            engine.spec.proposer.record(p, o.output_token_ids)
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        engine.add_request(rid, prompt, params, adapter=refs[i % len(refs)] if refs else None)
        if deliverer is not None:
            q: asyncio.Queue = asyncio.Queue()
            deliverer._sinks[rid] = (sink.loop, q)
    samples: dict[str, list[float]] = defaultdict(list)
    counted = num_overlapped = 0
    step_no = 0
    kinds: list[str] = []
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        kinds.append(_step_kind(out))
        return out
    engine.scheduler.schedule = watched
    warm_steps = args.output_len // (1 + args.spec) if spec else args.output_len
    prof = cProfile.Profile() if args.profile else None
    while counted < args.steps and engine.has_unfinished_requests():
        cur.clear()
        kinds.clear()
        timed = step_no >= warm_steps
        if prof is not None and timed:
            timer.profile = prof
            prof.enable()
        overlapped = engine.num_overlapped_verify_steps
        t0 = _clock()
        outs = engine.step()
        t1 = _clock()
        if deliverer is not None:
            _deliver_step(deliverer, outs)
        t2 = _clock()
        if prof is not None and timed:
            prof.disable()
            timer.profile = None
        step_no += 1
        overlapped = engine.num_overlapped_verify_steps > overlapped
        sched_n = len(outs)
        if not timed or sched_n != batch or kinds != ["verify" if spec else "decode"]:
            continue
        counted += 1
        step = t1 - t0
        row = dict(propose=cur["propose"], schedule=cur["schedule"], pack=cur["pack"], model=cur["model"],
                   sample=cur["sample"], runner=cur["execute"], update=cur["update"],
                   output=step - sum(cur.values()), deliver=t2 - t1)
        num_overlapped += int(overlapped)
        for k, v in row.items():
            samples[k].append(v)
    if sink is not None:
        sink.close()
    engine.close()
    del engine, runner
    if args.device != "cpu":
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    result = {k: 1e6 * statistics.median(v) for k, v in samples.items()}
    result["host"] = sum(v for k, v in result.items() if k != "model")  # medians add up: steadier than a sum's median
    result["exposed"] = result["host"] - (result["output"] + result["deliver"] if num_overlapped == counted else 0)
    if prof is not None and counted:
        _print_profile(prof, counted, args.profile, f"{batch} sequences, {'verify' if spec else 'decode'} steps")
    return result


def _step_kind(out) -> str:
    """'decode' (every entry one token, no drafts), 'verify' (every entry a decode with drafts) or 'mixed'."""
    if any(s.num_new_tokens != 1 + len(s.draft_token_ids) or not s.sample for s in out.scheduled):
        return "mixed"
    if all(s.draft_token_ids for s in out.scheduled):
        return "verify"
    return "decode" if not any(s.draft_token_ids for s in out.scheduled) else "mixed"


def _print_profile(prof: cProfile.Profile, steps: int, top: int, title: str) -> None:
    """The ``top`` functions by own time, µs per step ("model" calls left out; every timed step is profiled, also
    the few that do not count: a mixed step, say)."""
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"cProfile, {title}: µs per step over {steps} steps (own time, cumulative, calls per step)")
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{os.path.basename(file)}:{line}" if line else file
        print(f"  {1e6 * tottime / steps:9.1f} {1e6 * cumtime / steps:9.1f} {ncalls / steps:8.1f}  {name} ({where})")


_TEXT = ("The quick brown fox jumps over the lazy dog. Once upon a time there was a model that served many "
         "adapters at once; héllo wörld, naïve café — 日本語のテキスト. The answer is 42! ")


def _text_forcer(engine):
    """A logits hook that makes every sequence write real text (a random model's bytes are mostly invalid UTF-8,
    which no real model emits): the next token of a fixed text gets a large logit, so greedy and sampled rows
    both pick it."""
    ids = engine.tokenizer.encode(_TEXT * 4, add_special_tokens=False)

    def force(seqs, logits):
        rows = torch.arange(len(seqs))
        targets = torch.tensor([ids[(s.seq_id + s.num_output_tokens) % len(ids)] for s in seqs]).to(logits.device)
        rows = rows.to(logits.device)
        logits[rows, targets] = 1e4
    return force


def _deliver_step(ae, outs) -> None:
    """AsyncEngine._run's routing of one step's outputs (its own hand-off method)."""
    ae._deliver_step(outs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--variants", nargs="+", default=["greedy", "sampled", "greedy+lora", "sampled+lora"])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256, help="decode steps before timing starts")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps")
    ap.add_argument("--eager", action="store_true", help="ModelRunner.prepare path instead of the padded one")
    ap.add_argument("--no-async", action="store_true", help="leave out the AsyncEngine hand-off")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (captured graphs; the model phase synchronizes)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier numbers)")
    ap.add_argument("--spec", type=int, default=0, help="also measure verify steps with this many drafts (0: off)")
    ap.add_argument("--spec-length", type=float, default=3.0, help="the replayed proposals' acceptance length")
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions per step (0: off)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="overlapped scheduling on (verify steps stay in flight while outputs are built)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="wall: perf_counter; thread: the main thread's CPU time (steadier on a shared CPU)")
    args = ap.parse_args(argv)
    global _clock
    _clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    import logging
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        base = make_checkpoint(tmp, args.vocab)
        adapters = make_adapters(base, tmp, 8) if any("lora" in v for v in args.variants) else []
        path = "eager prepare" if args.eager else "CUDA graphs" if args.device == "cuda" else "padded graph path"
        print(f"µs per decode step (median of {args.steps}; history {args.output_len} tokens; vocab {args.vocab}; "
              f"{args.device}, {path}; {args.clock} clock)")
        print(f"{'batch':>5} {'variant':<18}" + "".join(f"{p:>10}" for p in PHASES))
        for batch in args.batches:
            for variant in args.variants:
                for spec in (False, True) if args.spec else (False,):
                    r = measure(base, adapters if "lora" in variant else [], batch, variant.startswith("sampled"),
                                args, spec)
                    name = f"{variant}{f' k={args.spec}' if spec else ''}"
                    print(f"{batch:>5} {name:<18}" + "".join(f"{r.get(p, 0.0):>10.0f}" for p in PHASES), flush=True)


if __name__ == "__main__":
    main()
