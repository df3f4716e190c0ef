"""Host time of an arrival's step in the serving engine, by section: base-only against adapters.

    python3 benchmarks/engine/probe_arrival_host.py --out "$OUT"          # H200: about 90 s on a cold machine
    python3 benchmarks/engine/probe_arrival_host.py --scale tiny --device cpu --concurrency 4 --num-adapters 2 \
        --adapter-files 2 --prompt-len 24 --arrivals 3 --out /tmp/probe   # CPU smoke run (seconds)
    python3 benchmarks/engine/probe_arrival_host.py --emulate-launches --concurrency 16 --num-adapters 8 \
        --adapter-files 8 --quantization mxfp4 --arrivals 6 --out /tmp/probe   # the CUDA path's host work on a CPU

An engine at the workload's shape (default GPT-OSS-20B, dummy bf16 weights, CUDA graphs and overlapped scheduling
as deployed; the eager warm-up off, so the first ``--skip`` arrivals of a phase compile and are not reported)
decodes ``--concurrency`` short requests; then, ``--arrivals`` times, the oldest request is aborted and a fresh
``--prompt-len``-token prompt arrives, and the engine steps until that prompt's first token. Each arrival runs
twice: as serving sees it (the step is called while a decode step is in flight, so it is launched behind it) and
after a device sync (the arrival's step alone). Phase "base" has no adapters; phase "adapters" spreads the decodes
and arrivals over ``--num-adapters`` rank-``--rank`` adapters on attention and experts.

Per arrival: each ``engine.step()`` wall time until the first token, and the host time (``time.perf_counter``
wrappers, inclusive: a section inside another counts in both) of the engine's sections: ``launch_eager`` (the
arrival's forward enqueued), ``model.forward``, ``LoRALinear.forward`` / ``LoRAFusedExperts.forward`` (the wrapped
attention and expert modules, LoRA or not), ``cached launch`` (every launch of a ``cached_launch`` kernel:
count and time), ``triton launch`` (``JITFunction.run``: the launches that went through Triton's dispatch), ``execute``
(sampling and read-back), ``_resolve_inflight``, ``prepare``, ``schedule``, ``set_token_slots``, ``step_table.write``,
``_run_mixed`` (an arrival's step written into the mixed-step graphs' buffers and replayed: with graphs, the
default, it stands in for ``prepare`` and ``model.forward``; ``--no-mixed-cuda-graphs`` runs arrivals eagerly) and
the explicit device waits (``Event.synchronize``). Writes ``probe_arrival_host.json`` under ``--out`` and prints
one line per reported arrival.

``--emulate-launches`` (CPU; ``loraplex.bench.host_emulation``): the CUDA path's launchers run on CPU tensors
with every kernel launch a recorded no-op, at ``--scale host`` unless given (GPT-OSS-20B's depth and experts, toy
widths), MXFP4 experts repacked as on CUDA and the H200's tuning files read. Each row then carries ``launches``
(count by kernel); its times are the host work of the CUDA path less the driver's share of each launch (no
device runs, so the step is host time alone; the numbers computed are meaningless).

``--profile N``: the reported arrivals' steps after a sync also run under cProfile, and each phase's N functions
with the most own time (summed over its reported arrivals; cProfile's own cost inflates small Python functions,
so read it for where the time goes, not for totals) go into the report as ``profile``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(ROOT)


class Sections:
    """Inclusive host time and call count per section name, recorded only while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        self._patched: list[tuple] = []

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = self.totals[name]
                entry[0] += 1
                entry[1] += time.perf_counter() - t
        return timed

    def wrap_method(self, cls, attr: str, name: str) -> None:
        """Time ``cls.attr`` for every instance, until ``restore``."""
        self._patched.append((cls, attr, cls.__dict__.get(attr)))  # None: inherited
        setattr(cls, attr, self.wrap(name, getattr(cls, attr)))

    def restore(self) -> None:
        """Put back the class attributes ``wrap_method`` replaced (they outlive the engine)."""
        while self._patched:
            cls, attr, original = self._patched.pop()
            if original is None:
                delattr(cls, attr)
            else:
                setattr(cls, attr, original)

    def report(self) -> dict[str, tuple[int, float]]:
        """{section: (calls, ms)}, slowest first."""
        return {k: (v[0], round(v[1] * 1e3, 3)) for k, v in sorted(self.totals.items(), key=lambda kv: -kv[1][1])}


def instrument(engine, sections: Sections, emulating: bool = False) -> None:
    """Wrap the engine's step sections (instance attributes) and the module / launch classes (class attributes,
    until ``sections.restore()``; ``emulating``: inside ``emulated_launches``, whose launch stand-ins are timed)."""
    import torch

    from loraplex.engine.lora import layers

    sections.wrap_method(layers.LoRALinear, "forward", "LoRALinear.forward")
    sections.wrap_method(layers.LoRAFusedExperts, "forward", "LoRAFusedExperts.forward")
    if torch.cuda.is_available() or emulating:
        import triton.runtime.jit as triton_jit

        from loraplex.kernels.launch import CachedLaunch

        sections.wrap_method(triton_jit.JITFunction, "run", "triton launch")
        sections.wrap_method(CachedLaunch, "launch", "cached launch")
        if not emulating:
            sections.wrap_method(torch.cuda.Event, "synchronize", "Event.synchronize")
    runner = engine.runner
    targets = ((engine, ("_lora_slots", "_sampling", "_resolve_inflight")),
               (engine.scheduler, ("schedule", "update", "update_launched")),
               (runner, ("launch_eager", "execute", "launch_decode", "prepare", "_set_lora_tokens", "_run_mixed")))
    for obj, names in targets:
        for name in names:
            setattr(obj, name, sections.wrap(name, getattr(obj, name)))
    if runner.lora is not None:
        runner.lora.set_token_slots = sections.wrap("set_token_slots", runner.lora.set_token_slots)
        runner.lora.step_table.write = sections.wrap("step_table.write", runner.lora.step_table.write)
    runner.model.forward = sections.wrap("model.forward", runner.model.forward)


def top_functions(profiler: cProfile.Profile, n: int) -> list[list]:
    """The ``n`` functions with the most own time: [function, calls, own ms, cumulative ms]."""
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [[f"{os.path.basename(f)}:{line}({name})", nc, round(tt * 1e3, 3), round(ct * 1e3, 3)]
            for (f, line, name), (_, nc, tt, ct, _callers) in rows]


def run_phase(engine, sections: Sections, refs: list, args, prompt, sync_device,
              profiler: cProfile.Profile | None = None, launches=None) -> list[dict]:
    """``args.concurrency`` decoding requests, then the arrivals (module docstring); the reported rows.
    ``profiler``: enabled around the reported arrivals' steps after a sync."""
    from loraplex.engine import SamplingParams

    params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    tag = "adapters" if refs[0] is not None else "base"
    rids = []
    for i in range(args.concurrency):
        rid = f"{tag}-d{i}"
        engine.add_request(rid, prompt(args.decode_prompt_len), params, adapter=refs[i % len(refs)])
        rids.append(rid)
    started: set[str] = set()
    for _ in range(100 * args.concurrency + 1000):
        started.update(o.request_id for o in engine.step() if o.output_token_ids)
        if len(started) >= len(rids):
            break
    else:
        raise RuntimeError(f"{tag}: the decoding requests did not all start")
    for _ in range(4):
        engine.step()
    rows = []
    for a in range(args.arrivals):
        for synced in (False, True):
            engine.abort(rids.pop(0))
            rid = f"{tag}-a{a}-{int(synced)}"
            engine.add_request(rid, prompt(args.prompt_len), params, adapter=refs[(7 * a + 1) % len(refs)])
            rids.append(rid)
            if synced:
                sync_device()
            sections.totals.clear()
            if launches is not None:
                launches.clear()
            sections.on = True
            steps = []
            profiling = profiler is not None and synced and a >= args.skip
            if profiling:
                profiler.enable()
            try:
                for _ in range(1000):
                    t = time.perf_counter()
                    outs = engine.step()
                    steps.append(round((time.perf_counter() - t) * 1e3, 3))
                    if any(o.request_id == rid and o.output_token_ids for o in outs):
                        break
                else:
                    raise RuntimeError(f"{tag}: arrival {rid} got no token in 1000 steps")
            finally:
                sections.on = False
                if profiling:
                    profiler.disable()
            if a >= args.skip:
                row = {"phase": tag, "arrival": a, "after_sync": synced, "steps_ms": steps,
                       "early_launched_steps": engine.num_early_launched_steps, "sections": sections.report()}
                if launches is not None:
                    row["launches"] = {"total": launches.total, "by_kernel": dict(launches.by_kernel.most_common())}
                rows.append(row)
                print(json.dumps(row), flush=True)
            for _ in range(3):
                engine.step()
    for rid in rids:
        engine.abort(rid)
    for _ in range(4):
        engine.step()
    return rows


def _probe(engine, sections: Sections, run, args, launches=None) -> tuple[list[dict], dict[str, list]]:
    """Both phases' reported rows, base-only then spread over the run's adapters, and (``--profile``) each
    phase's top functions."""
    import torch

    vocab = run.model_config["vocab_size"]
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=gen).tolist()

    def sync_device() -> None:
        if run.is_cuda:
            torch.cuda.synchronize(run.device)

    rows, profile = [], {}
    for phase, refs in (("base", [None]), ("adapters", run.adapter_refs)):
        profiler = cProfile.Profile() if args.profile else None
        rows += run_phase(engine, sections, refs, args, prompt, sync_device, profiler, launches)
        if profiler is not None:
            profile[phase] = top_functions(profiler, args.profile)
    return rows, profile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default=None,
                   help="workload model shape (full: GPT-OSS-20B, the default; tiny: CPU smoke; host: the default "
                        "with --emulate-launches)")
    p.add_argument("--device", default="auto")
    p.add_argument("--concurrency", type=int, default=128, help="decoding requests beside each arrival (incl. it)")
    p.add_argument("--num-adapters", type=int, default=32)
    p.add_argument("--adapter-files", type=int, default=8, help="distinct adapter files (adapter k reads k mod F)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=1600)
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--arrivals", type=int, default=7)
    p.add_argument("--quantization", default=None, choices=("int8", "mxfp4"),
                   help="expert weights quantised at load (default: the checkpoint's bf16)")
    p.add_argument("--skip", type=int, default=2, help="first arrivals of a phase not reported (kernel compiles)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile the reported arrivals' steps after a sync; report each phase's top N functions")
    p.add_argument("--emulate-launches", action="store_true",
                   help="CPU: run the CUDA path's launchers with every kernel launch a no-op (module docstring)")
    p.add_argument("--mixed-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="arrival steps replay the mixed-step CUDA graphs (the engine's default); "
                        "--no-mixed-cuda-graphs: they run eagerly")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if args.skip >= args.arrivals:
        p.error("--skip must be below --arrivals")
    if args.emulate_launches and args.device not in ("auto", "cpu"):
        p.error("--emulate-launches runs on the CPU; leave --device out")
    if args.scale is None:
        args.scale = "host" if args.emulate_launches else "full"
    if args.emulate_launches:
        args.device = "cpu"

    import tempfile

    import torch

    from loraplex.bench.config import ServeBenchConfig
    from loraplex.bench.engine_run import EngineRun
    from loraplex.bench.engine_setup import engine_kwargs, use_in_place_fetcher
    from loraplex.engine import LLMEngine

    work = args.work_dir or tempfile.mkdtemp(prefix="loraplex-probe-")
    cfg = ServeBenchConfig(scale=args.scale, device=args.device, num_adapters=args.num_adapters, rank=args.rank,
                           concurrency=args.concurrency, input_len=args.prompt_len, output_len=64,
                           kv_sizing="workload", adapter_files=args.adapter_files, work_dir=work,
                           mixed_cuda_graphs=args.mixed_cuda_graphs)
    run = EngineRun(cfg, work, num_adapter_files=min(args.adapter_files, args.num_adapters))
    kw = engine_kwargs(cfg, work, device=run.device.type, dtype=run.dtype, quantization=args.quantization)
    kw["eager_warmup_budget_s"] = 0  # the first --skip arrivals compile instead
    with contextlib.ExitStack() as stack:
        launches = None
        if args.emulate_launches:
            from loraplex.bench.host_emulation import emulated_launches
            from loraplex.engine.quantization.mxfp4_experts import use_mxfp4_kernel_layout

            launches = stack.enter_context(emulated_launches())
        t0 = time.monotonic()
        engine = LLMEngine.from_pretrained(run.folder, **kw)
        use_in_place_fetcher(engine)
        if args.emulate_launches:
            use_mxfp4_kernel_layout(engine.runner.model, any_device=True)
        start_s = time.monotonic() - t0
        sections = Sections()
        try:
            instrument(engine, sections, args.emulate_launches)
            rows, profile = _probe(engine, sections, run, args, launches)
        finally:
            sections.restore()
            engine.close()
    device = torch.cuda.get_device_name() if run.is_cuda else "cpu, launches emulated" if args.emulate_launches \
        else "cpu"
    report = {"args": vars(args), "device": device,
              "torch": torch.__version__, "engine_start_s": round(start_s, 2),
              "async_scheduling": engine.async_scheduling, "mixed_cuda_graphs": engine.runner.num_mixed_cuda_graphs,
              "rows": rows}
    if engine.runner.num_mixed_cuda_graphs:
        mixed = engine.runner.mixed_graphs
        report["mixed_cuda_graph_capture_s"] = round(mixed.capture_seconds, 2)
        report["mixed_cuda_graph_mib"] = round(mixed.graph_memory_bytes / 2**20, 1)
    if profile:
        report["profile"] = profile
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_arrival_host.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
