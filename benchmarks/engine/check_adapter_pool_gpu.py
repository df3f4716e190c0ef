"""Adapters in GPU memory at their own rank, on the GPU at the GPT-OSS-20B shape (bf16): kernels, graphs, side-stream
loads.

Stage "kernels": the LoRA ops reading each adapter through a LoRATable (address and rank per step slot) with ranks
8 / 16 / 32 mixed in one batch, an empty slot, an attention-only adapter (rank 0 in the expert tables) and tokens
without an adapter, against the torch references at M = 1, 16, 33: dense qkv (K 2880, slices 4096/512/512) and o
(K 4096, N 2880), fused_moe_lora gate_up (E 32, K 2880, N 5760) and down, the whole moe_experts_lora layer, and a
CUDA graph of moe_experts_lora replayed after the table was rewritten to other adapters. PASS: rel. error
(max|d| / max|ref|) <= 1e-2 everywhere. Then device time per call at M = 16 (CUDA-graph replay, cold L2, as
bench_kernels.py), 8 adapters, three layouts through the same kernels: "stacked" (the earlier layout: every slot
zero-padded to rank 32 in one buffer), "own r32" (each adapter its own blob, rank 32: what the engine holds now)
and "mixed" (ranks 8/16/32, each at its size); printed beside the earlier kernels' figures from
docs/performance.md (commit dd2c6fe, same timing) for the regression check.

Stage "engine": an LLMEngine at the GPT-OSS-20B shape (dummy weights, decode graphs up to 16) with 8 random rank-32
adapters resident. (1) Graph replay after a load: a rank-16 adapter is loaded into a slot no graph has seen and
four decoding rows are routed to it; the replayed step's logits must equal the eager forward of the same step
(rel. err <= 2e-2) and differ from the base model's on those rows. (2) Side-stream loads: decode step times (batch
16, 8 adapters) without a load, while a rank-32 adapter (~0.74 GB, pinned) is copied on the side stream (step
times during the copy, the copy's own time, wall time until ``is_ready``), and with the same copy made
synchronously on the step stream before a step (the old critical-path cost).

    PYTHONPATH=$PWD python3 benchmarks/engine/check_adapter_pool_gpu.py          # both stages, < 3 min on an H200
    PYTHONPATH=$PWD python3 benchmarks/engine/check_adapter_pool_gpu.py --stages kernels
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/engine/check_adapter_pool_gpu.py --device cpu --scale tiny
                                   # a smoke run of this script on a CPU (toy shapes, no timing, no graphs)
Writes $OUT/check_adapter_pool_gpu.json (OUT defaults to .). Each stage runs in its own subprocess with a timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(ROOT)

RESULT_PREFIX = "RESULT_JSON "
STAGE_TIMEOUT_S = {"kernels": 90, "engine": 150}
TOL_KERNEL, TOL_GRAPH = 1e-2, 2e-2
# docs/performance.md, call 15 (commit dd2c6fe, bench_kernels.py cold L2, 8 adapters r32, M = 16): the stacked
# layout's kernels before the LoRATable, metadata precomputed
PREVIOUS_US = {"fused_moe_lora[gate_up]": 16.5, "fused_moe_lora[down]": 10.8, "lora_expand[qkv]": 4.7}
SLICES, O_K = (4096, 512, 512), 4096
DEVICE = "cuda"


# ---- kernels ----------------------------------------------------------------------------------------------------
def _tables(num_slots: int, ranks, k: int, widths, *, experts: int = 0, empty=(), dtype=None, device=None):
    """A LoRATable over fresh random factors, slot l at ranks[l % len(ranks)] (``empty``: no weights)."""
    import torch

    from loraplex.kernels.lora_table import LoRATable

    slots = []
    for l in range(num_slots):
        r = ranks[l % len(ranks)]
        row = []
        for n in widths:
            if l in empty:
                row.append(None)
                continue
            lead = (experts,) if experts else ()
            a = (torch.randn(*lead, r, k, device=device or DEVICE) / k ** 0.5).to(dtype)
            b = (torch.randn(*lead, n, r, device=device or DEVICE) * 0.05).to(dtype)
            row.append((a, b))
        slots.append(row)
    return LoRATable.from_factors(slots, in_features=k, out_features=tuple(widths), max_rank=32, num_experts=experts)


def _stacked(num_slots: int, rank: int, k: int, widths, *, experts: int = 0, dtype=None):
    import torch

    from loraplex.kernels.lora_table import LoRATable

    n = sum(widths)
    if experts:
        a = (torch.randn(num_slots, experts, rank, k, device=DEVICE) / k ** 0.5).to(dtype)
        b = (torch.randn(num_slots, experts, n, rank, device=DEVICE) * 0.05).to(dtype)
        return LoRATable.from_stacked(a, b, experts=True)
    a = (torch.randn(len(widths), num_slots, rank, k, device=DEVICE) / k ** 0.5).to(dtype)
    b = (torch.randn(num_slots, n, rank, device=DEVICE) * 0.05).to(dtype)
    return LoRATable.from_stacked(a, b, output_slices=widths)


def stage_kernels(args) -> dict:
    import torch

    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.fused_moe_lora import fused_moe_lora
    from loraplex.kernels.lora_expand import lora_expand
    from loraplex.kernels.lora_shrink import lora_segments, lora_shrink
    from loraplex.kernels.moe_align import moe_align_lora
    from loraplex.kernels.moe_experts_lora import lora_config, moe_experts_lora
    from loraplex.kernels.tuning_cases import PRESETS, bench_time_ms, rel_error

    torch.manual_seed(0)
    s = PRESETS["gpt-oss-20b"]
    dev = DEVICE
    bf16 = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    H, E, A, I = s.hidden, s.num_experts, s.top_k, s.moe_intermediate
    global SLICES, O_K
    if args.scale == "tiny":
        H, E, A, I, SLICES, O_K = 64, 4, 2, 32, (64, 16, 16), 64
    L, ranks = 8, (8, 16, 32)
    qkv = _tables(L, ranks, H, SLICES, empty=(5,), dtype=bf16)
    o = _tables(L, ranks, O_K, (H,), empty=(5,), dtype=bf16)
    gu = _tables(L, ranks, H, (2 * I,), experts=E, empty=(5, 6), dtype=bf16)  # slot 6: attention only
    dn = _tables(L, ranks, I, (H,), experts=E, empty=(5, 6), dtype=bf16)
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).to(bf16)
    w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).to(bf16)
    b13, b2 = (torch.randn(E, 2 * I, device=dev) * 0.1).to(bf16), (torch.randn(E, H, device=dev) * 0.1).to(bf16)
    scaling = torch.ones(L, device=dev)
    moe_kw = dict(activation=s.activation, b13=b13, b2=b2, alpha=1.702, limit=7.0)
    lines, errors = [], {}

    def inputs(m, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(m, H, device=dev, generator=g).to(bf16)
        idx = ((torch.arange(m, device=dev) + 1) % (L + 1) - 1).to(torch.int32)  # 0..7 and -1 (base)
        idx = idx[torch.randperm(m, device=dev, generator=g)]
        weights, ids = torch.topk(torch.randn(m, E, device=dev, generator=g).softmax(-1), A, dim=-1)
        return x, idx, weights, ids

    def check(name, got, want):
        err = rel_error(got, want)
        errors[name] = err
        lines.append(f"{'ok  ' if err <= TOL_KERNEL else 'FAIL'} {name:<40} rel_err={err:.2e}")

    for m in (1, 16, 33):
        x, idx, weights, ids = inputs(m, m)
        for name, table, k, widths in (("qkv", qkv, H, SLICES), ("o", o, O_K, (H,))):
            xs = x if k == H else torch.randn(m, k, device=dev).to(bf16)
            y = torch.randn(m, sum(widths), device=dev).to(bf16)
            got, want = y.clone(), y.clone()
            lora_expand(got, lora_shrink(xs, table, idx, scaling), table, idx, widths)
            ref.lora_expand(want, ref.lora_shrink(xs, table, idx, scaling), table, idx, widths)
            check(f"lora_shrink+expand[{name}] M={m}", got, want)
        for name, table, rows, k, n, tw in (("gate_up", gu, m, H, 2 * I, None), ("down", dn, m * A, I, H, weights)):
            xs = torch.randn(rows, k, device=dev).to(bf16)
            y = torch.randn(m * A, n, device=dev).to(bf16)
            got, want = y.clone(), y.clone()
            fused_moe_lora(got, xs, table, None, ids, idx, scaling, tw)
            ref.fused_moe_lora(want, xs, table, None, ids, idx, scaling, tw)
            check(f"fused_moe_lora[{name}] M={m}", got, want)
        got = moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, w13_lora=gu, w2_lora=dn, **moe_kw)
        want = ref.moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, w13_lora=gu, w2_lora=dn, **moe_kw)
        check(f"moe_experts_lora M={m}", got, want)

    # a graph captured on one table, replayed after the entries were rewritten to other adapters (new addresses,
    # new ranks): the replay must read the new ones
    x, idx, weights, ids = inputs(16, 99)
    live = _tables(L, ranks, H, (2 * I,), experts=E, dtype=bf16)
    live_dn = _tables(L, ranks, I, (H,), experts=E, dtype=bf16)
    other = _tables(L, (32, 8, 16), H, (2 * I,), experts=E, empty=(2,), dtype=bf16)
    other_dn = _tables(L, (32, 8, 16), I, (H,), experts=E, empty=(2,), dtype=bf16)
    call = lambda: moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, w13_lora=live, w2_lora=live_dn,  # noqa
                                    **moe_kw)
    out = call()
    if dev == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
    live.entries.copy_(other.entries)
    live_dn.entries.copy_(other_dn.entries)
    if dev == "cuda":
        graph.replay()
        torch.cuda.synchronize()
    else:  # smoke run: the same call after the rewrite, eagerly
        out = call()
    want = ref.moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, w13_lora=other, w2_lora=other_dn, **moe_kw)
    check("graph replay after a table rewrite", out, want)

    ok = all(e <= TOL_KERNEL for e in errors.values())
    if dev != "cuda":
        return dict(stage="kernels", ok=ok, errors=errors, lines=lines, timing_us={}, previous_us=PREVIOUS_US)
    # ---- timing at M = 16: stacked (padded) vs own r32 vs mixed ranks, same kernels
    x, _, weights, ids = inputs(16, 7)
    idx = (torch.arange(16, device=dev) % L).to(torch.int32)  # every slot active, as bench_kernels
    layouts = {"stacked r32": lambda k, w, e=0: _stacked(L, 32, k, w, experts=e, dtype=bf16),
               "own r32": lambda k, w, e=0: _tables(L, (32,), k, w, experts=e, dtype=bf16),
               "mixed 8/16/32": lambda k, w, e=0: _tables(L, ranks, k, w, experts=e, dtype=bf16)}
    timing = {}
    seg = lora_segments(idx, L)
    y_qkv = torch.randn(16, sum(SLICES), device=dev).to(bf16)
    for layout, make in layouts.items():
        t_qkv = make(H, SLICES)
        t_gu, t_dn = make(H, (2 * I,), E), make(I, (H,), E)
        buf = lora_shrink(x, t_qkv, idx, scaling, segments=seg)
        cfg_gu = lora_config(torch.empty(16 * A, 2 * I), x, t_gu, ids)
        cfg_dn = dict(lora_config(torch.empty(16 * A, H), torch.empty(16 * A, I), t_dn, ids),
                      BLOCK_M=int(cfg_gu["BLOCK_M"]))
        align = moe_align_lora(ids, idx, E, L, int(cfg_gu["BLOCK_M"]))
        pre = torch.randn(16 * A, 2 * I, device=dev).to(bf16)
        h = torch.randn(16 * A, I, device=dev).to(bf16)
        outd = torch.randn(16 * A, H, device=dev).to(bf16)
        rows = {
            "lora_shrink[qkv]": lambda: lora_shrink(x, t_qkv, idx, scaling, segments=seg),
            "lora_expand[qkv]": lambda: lora_expand(y_qkv, buf, t_qkv, idx, SLICES, segments=seg),
            "fused_moe_lora[gate_up]": lambda: fused_moe_lora(pre, x, t_gu, None, ids, idx, scaling, None,
                                                              config=cfg_gu, align=align),
            "fused_moe_lora[down]": lambda: fused_moe_lora(outd, h, t_dn, None, ids, idx, scaling, weights,
                                                           config=cfg_dn, align=align),
            "moe_experts_lora (layer)": lambda: moe_experts_lora(x, w13, w2, weights, ids, idx, scaling,
                                                                 w13_lora=t_gu, w2_lora=t_dn, **moe_kw),
        }
        for op, fn in rows.items():
            timing.setdefault(op, {})[layout] = round(bench_time_ms(fn) * 1e3, 2)
    return dict(stage="kernels", ok=ok, errors=errors, lines=lines, timing_us=timing, previous_us=PREVIOUS_US)


# ---- engine -----------------------------------------------------------------------------------------------------
def _random_adapter(slots, name: str, rank: int, seed: int, *, pinned: bool = False):
    """A random adapter (every target) drawn on the GPU; ``pinned``: then moved to pinned host memory, as the CPU
    tier holds it (else loaded from the GPU tensor: a device-to-device copy)."""
    from loraplex.engine.testing.adapters import random_adapter

    w = random_adapter(slots, name, rank=rank, seed=seed, scale=0.3, device=DEVICE)
    if not pinned or DEVICE != "cuda":
        return w
    w.flat = w.flat.cpu()
    return w.pin_memory()


def _wait(handle, timeout_s: float = 30.0) -> None:
    t0 = time.perf_counter()
    while not handle.done():
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError("adapter copy did not complete")
        time.sleep(0.001)


def stage_engine(args) -> dict:
    import torch

    from loraplex.bench.workload import SCALES, write_model_config
    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.lora.device_copy import DeviceCopier
    from loraplex.kernels.tuning_cases import rel_error

    res: dict = dict(stage="engine")
    cuda = DEVICE == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model_config(os.path.join(tmp, "gpt-oss-20b"), SCALES[args.scale])
        t0 = time.perf_counter()
        engine = LLMEngine.from_pretrained(folder, device=DEVICE, dtype="bfloat16" if cuda else "float32",
                                           load_format="dummy",
                                           progress=False, max_model_len=512, max_num_seqs=16,
                                           num_kv_blocks=16 * 32 + 64, enable_prefix_caching=False,
                                           swap_space_bytes=0, enable_lora=True, max_lora_rank=32,
                                           adapter_memory_bytes=12 << 30, async_scheduling=False,
                                           adapter_cache_dir=os.path.join(tmp, "cache"))
        runner, slots = engine.runner, engine.runner.lora
        if not cuda:
            runner.init_decode_graphs(capture=False)  # smoke run: the padded path stands in for the graphs
        res.update(start_s=round(time.perf_counter() - t0, 1), buckets=runner.cuda_graph_buckets,
                   capture_s=round(runner.decode_graphs.capture_seconds, 2) if runner.decode_graphs else None)
        if cuda and not runner.num_cuda_graphs:
            return dict(res, ok=False, error="no CUDA graphs captured")
        for slot in range(8):
            _wait(slots.load(slot, _random_adapter(slots, f"r32-{slot}", 32, slot)))
        res["adapter_mib"] = {"r32": round(slots.max_footprint(32) / 2**20, 1)}
        seq_slot: dict[int, int] = {}
        execute = runner.execute
        runner.execute = lambda out, sampling, lora_slots=None: execute(out, sampling, lora_slots=dict(seq_slot))
        gen = torch.Generator().manual_seed(0)
        vocab = engine.model_config.vocab_size
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        rids = []
        for i in range(16):
            rid = f"r{i}"
            engine.add_request(rid, torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist(), params)
            seq_slot[engine._requests[rid].group.seqs[0].seq_id] = i % 8
            rids.append(rid)
        for _ in range(4):  # prefill, then decode steps from the graphs
            engine.step()

        # (1) a new slot, four rows routed to it, one step replayed vs the same step eager
        _wait(slots.load(8, _random_adapter(slots, "r16-new", 16, 100)))
        seqs = [engine._requests[r].group.seqs[0] for r in rids]
        for s in seqs[:4]:
            seq_slot[s.seq_id] = 8
        out = engine.scheduler.schedule()
        lora_slots = {s.seq.seq_id: seq_slot[s.seq.seq_id] for s in out.scheduled}
        graphs = runner.decode_graphs
        assert graphs.can_run(out)
        with torch.inference_mode():
            replays = graphs.num_steps
            logits_g = runner.model.compute_logits(graphs.run(out, lora_slots)).float()
            inputs = runner.prepare(out)

            def eager(slot_map):
                runner._set_lora_tokens(out, slot_map)
                hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_caches)
                return runner.model.compute_logits(hidden[inputs.sample_rows]).float()

            base_rows = {k: (v if k not in {s.seq_id for s in seqs[:4]} else -1) for k, v in lora_slots.items()}
            logits_base = eager(base_rows)
            logits_e = eager(lora_slots)  # last: the KV this step wrote is the adapter's again
            runner.lora.set_token_slots(None)
        err = rel_error(logits_g, logits_e)
        moved = rel_error(logits_e[:4], logits_base[:4])
        res["replay_after_load"] = dict(rel_err_graph_vs_eager=err, new_slot_changes_rows=moved,
                                        replayed=graphs.num_steps - replays)
        ok_replay = err <= TOL_GRAPH and moved > 1e-2 and graphs.num_steps == replays + 1
        # the step ran three times, writing its KV slots each time (the adapter's values last): account for it once
        engine.scheduler.update(out, {s.seq.seq_id: int(t) for s, t in zip(out.scheduled,
                                                                            logits_g.argmax(-1).tolist())})

        # (2) decode step times: no load / a side-stream load / a synchronous load
        def step_ms() -> float:
            sync()
            t = time.perf_counter()
            engine.step()
            sync()
            return (time.perf_counter() - t) * 1e3

        base = [step_ms() for _ in range(args.steps)]
        w_async = _random_adapter(slots, "r32-async", 32, 200, pinned=True)
        w_sync = _random_adapter(slots, "r32-sync", 32, 201, pinned=True)
        sync()
        t_load = time.perf_counter()
        handle = slots.load(9, w_async)
        during, to_ready = [], None
        for _ in range(args.steps):
            during.append(step_ms())
            if to_ready is None and handle.done():
                to_ready = (time.perf_counter() - t_load) * 1e3
        _wait(handle)
        slots.copier, side = DeviceCopier(runner.device, asynchronous=False), slots.copier
        sync()
        t = time.perf_counter()
        slots.load(10, w_sync)
        engine.step()
        sync()
        sync_step = (time.perf_counter() - t) * 1e3
        slots.copier = side
        res["load_overlap"] = dict(
            step_ms_p50=round(statistics.median(base), 3), step_ms_max=round(max(base), 3),
            during_copy_step_ms=[round(v, 3) for v in during[:6]], during_copy_max=round(max(during), 3),
            copy_ms=round(handle.seconds * 1e3, 2) if handle.seconds is not None else None,
            to_ready_ms=round(to_ready, 2) if to_ready is not None else None,
            sync_load_step_ms=round(sync_step, 3), steps=len(during))
        for rid in rids:
            engine.abort(rid)
        res["ok"] = bool(ok_replay)
        return res


# ---- driver -----------------------------------------------------------------------------------------------------
def print_summary(results: list[dict]) -> None:
    print("\n==== adapter pool check ====")
    for r in results:
        if r["stage"] == "kernels" and "lines" in r:
            for ln in r["lines"]:
                print("  " + ln)
            print("  device time per call, M = 16, 8 adapters (us; cold L2, CUDA-graph replay)")
            layouts = ["stacked r32", "own r32", "mixed 8/16/32"]
            print(f"  {'op':<28}" + "".join(f"{c:>15}" for c in layouts) + f"{'earlier kernels':>17}")
            for op, row in r["timing_us"].items():
                prev = r["previous_us"].get(op)
                print(f"  {op:<28}" + "".join(f"{row.get(c, '-'):>15}" for c in layouts)
                      + f"{prev if prev is not None else '-':>17}")
        elif r["stage"] == "engine" and "load_overlap" in r:
            rp, lo = r["replay_after_load"], r["load_overlap"]
            print(f"  engine: start {r['start_s']} s, graphs {r['buckets']} in {r['capture_s']} s, r32 adapter "
                  f"{r['adapter_mib']['r32']} MiB")
            print(f"  replay after a load into a new slot: rel err vs eager {rp['rel_err_graph_vs_eager']:.2e}, "
                  f"the new adapter moves its rows by {rp['new_slot_changes_rows']:.2e}")
            print(f"  decode step (batch 16, 8 adapters): {lo['step_ms_p50']} ms p50 without a load; during a "
                  f"side-stream r32 copy {lo['during_copy_step_ms']} (max {lo['during_copy_max']}) ms; copy "
                  f"{lo['copy_ms']} ms, ready after {lo['to_ready_ms']} ms; a synchronous copy + step "
                  f"{lo['sync_load_step_ms']} ms")
        else:
            print(f"  {r['stage']}: ERROR {r.get('error')}")
    for r in results:
        print(f"{'PASS' if r.get('ok') else 'FAIL'} {r['stage']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default="kernels,engine")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per variant (engine stage)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (with --scale tiny)")
    p.add_argument("--scale", default="full", choices=("full", "tiny"), help="GPT-OSS-20B or toy shapes")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if args.worker:
        try:
            result = {"kernels": stage_kernels, "engine": stage_engine}[args.worker](args)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            result = dict(stage=args.worker, ok=False, error=f"{type(e).__name__}: {e}")
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0
    results = []
    for stage in args.stages.split(","):
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", stage, "--steps", str(args.steps),
               "--prompt-len", str(args.prompt_len), "--device", args.device, "--scale", args.scale]
        print(f"---- stage {stage} (timeout {STAGE_TIMEOUT_S[stage]} s)", flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=STAGE_TIMEOUT_S[stage], cwd=ROOT)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
            result = json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else \
                dict(stage=stage, ok=False, error=f"exit {proc.returncode}, no result")
            for ln in (proc.stdout + proc.stderr).splitlines():
                if any(k in ln for k in ("Error", "Traceback", "File ", "WARNING", "CUDA graphs:", "adapter memory")):
                    print("   | " + ln[-300:])
        except subprocess.TimeoutExpired:
            result = dict(stage=stage, ok=False, error=f"timed out after {STAGE_TIMEOUT_S[stage]} s")
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(result)
    print_summary(results)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "check_adapter_pool_gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
