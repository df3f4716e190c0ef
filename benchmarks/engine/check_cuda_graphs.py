"""CUDA-graph decode steps on the GPU: correctness on the tiny families, then decode step time at GPT-OSS-20B shape.

Stage "tiny-<family>" (float32, tf32 off): one engine with graphs (the default) and one with ``enforce_eager``, each
``enable_lora=True`` with two PEFT adapters (ranks 4 and 8) mixed with base requests (block_size 4, batch up to 8,
so buckets 1/2/4/8 and block boundaries are crossed; the arrivals' steps, prompts beside decodes, replay the
mixed-step graph); transformers + PEFT score each request's tokens by one teacher-forced forward. PASS: decode
and mixed-step graphs were captured and replayed, graph tokens == eager tokens == HF/PEFT greedy,
and the worst step's relative logits error (max|d| / max|ref|) against HF/PEFT <= --tol. A third engine runs with
overlapped (async) scheduling (no logits hook: a hook keeps steps synchronous): its tokens must equal the graph
run's and HF/PEFT greedy, with overlapped steps replayed from the graphs and arrivals' eager steps launched before
the decode step in flight was read back (half the requests arrive 3 steps apart while the others decode).

Stage "perf": a GPT-OSS-20B-shape bf16 model (``--quantization int8|mxfp4``: those experts) with dummy weights, 8
random rank-32 adapters resident; decode step time (``LLMEngine.step``, synchronised) with graphs and eager (same
engine, graphs switched off) at batch 1 and 16, without adapters (every request on the base) and with 8 (requests
spread over the slots); then with graphs and overlapped scheduling (``async_ms``: step n+1 launched before step
n's tokens are read, so host work hides behind the GPU). PASS: graphs captured and no slower than eager at batch 1
(async_ms is reported, not gated).

Every stage runs in its own subprocess under its own timeout: a crash or a hang costs that stage only.

    python3 benchmarks/engine/check_cuda_graphs.py                 # all stages, < 3 min on an H200
    python3 benchmarks/engine/check_cuda_graphs.py --stages perf   # one stage
Writes $OUT/check_cuda_graphs.json (when OUT is set) with every stage's result.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(ROOT)

FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3")
STAGE_TIMEOUT_S = {"tiny": 90, "perf": 360}
RESULT_PREFIX = "RESULT_JSON "


# ---- tiny families: graphs vs eager vs HF/PEFT ----------------------------------------------------------------
def make_adapter(base: str, out: str, r: int, seed: int) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    moe = model.config.model_type in ("gpt_oss", "qwen3_moe", "mixtral")
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else ["gate_proj", "up_proj", "down_proj"])
    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else None
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=modules, target_parameters=params,
                     init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


ARRIVAL_GAP = 3  # steps between the later requests' arrivals


def run_tiny_engine(base: str, folders: dict, requests: list, tmp: str, *, eager: bool, device: str,
                    dtype: str = "float32", overlap: bool = False):
    """Final tokens, logits rows per request (none with ``overlap``: a logits hook would keep steps synchronous)
    and graph counters of one engine run."""
    import torch

    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.lora.ref import AdapterRef

    engine = LLMEngine.from_pretrained(base, device=device, dtype=dtype, block_size=4, max_num_seqs=8,
                                       max_num_batched_tokens=64, num_kv_blocks=512, progress=False,
                                       enable_lora=True, max_lora_rank=8, enforce_eager=eager,
                                       async_scheduling=overlap,
                                       adapter_cache_dir=os.path.join(tmp, f"cache-{int(eager)}{int(overlap)}-{dtype}"))
    logits = defaultdict(list)
    if not overlap:
        engine.runner.logits_hook = lambda seqs, lg: [logits[s.request_id].append(lg[j].float().cpu())
                                                      for j, s in enumerate(seqs)]
    def add(rid, name, prompt, n):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                           adapter=AdapterRef(f"t/{name}/1", f"file://{folders[name]}") if name else None)

    # the first half at once, the rest arriving ARRIVAL_GAP steps apart while those decode (with overlap, each
    # arrival's step is launched before the decode step in flight is read back)
    first, later = requests[:(len(requests) + 1) // 2], requests[(len(requests) + 1) // 2:]
    for r in first:
        add(*r)
    final, step = {}, 0
    while engine.has_unfinished_requests() or later:
        if later and step and step % ARRIVAL_GAP == 0:
            add(*later.pop(0))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.output_token_ids
        step += 1
    g, mixed = engine.runner.decode_graphs, engine.runner.mixed_graphs
    info = dict(num_graphs=engine.runner.num_cuda_graphs, buckets=engine.runner.cuda_graph_buckets,
                replays=g.num_steps if g is not None else 0, mixed_graphs=engine.runner.num_mixed_cuda_graphs,
                mixed_replays=mixed.num_steps if mixed is not None else 0,
                capture_s=round(g.capture_seconds, 2) if g is not None else None,
                graph_mib=round(g.graph_memory_bytes / 2**20, 1) if g is not None else None,
                overlapped_steps=engine.num_overlapped_steps, early_launched_steps=engine.num_early_launched_steps)
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return final, logits, info


def stage_tiny(family: str, args) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        base = make_tiny_checkpoint(family, os.path.join(tmp, family))
        folders = {"a4": make_adapter(base, os.path.join(tmp, "a4"), 4, 1),
                   "a8": make_adapter(base, os.path.join(tmp, "a8"), 8, 2)}
        gen = torch.Generator().manual_seed(0)
        names = ["a4", None, "a8", "a4", None, "a8", None]
        lens = [args.new_tokens, args.new_tokens - 3, args.new_tokens - 7, 5, args.new_tokens, 9, 3]
        requests = [(f"r{i}", name, torch.randint(3, 300, (int(torch.randint(3, 20, (1,), generator=gen)),),
                                                    generator=gen).tolist(), n)
                    for i, (name, n) in enumerate(zip(names, lens))]
        got, got_logits, info = run_tiny_engine(base, folders, requests, tmp, eager=False, device=args.device)
        want, want_logits, _ = run_tiny_engine(base, folders, requests, tmp, eager=True, device=args.device)
        overlapped, _, async_info = run_tiny_engine(base, folders, requests, tmp, eager=False, device=args.device,
                                                    overlap=True)
        models, hf_agree, async_hf_agree, worst_hf, worst_eager = {}, 0, 0, 0.0, 0.0
        for rid, name, prompt, _ in requests:
            if name not in models:
                m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
                models[name] = (PeftModel.from_pretrained(m, folders[name]) if name else m).to(args.device).eval()
            tokens = got[rid]
            ids = torch.tensor([prompt + tokens[:-1]], device=args.device)
            with torch.no_grad():
                ref = models[name](input_ids=ids).logits[0, len(prompt) - 1:].float().cpu()
                a_ids = torch.tensor([prompt + overlapped[rid][:-1]], device=args.device)
                a_ref = models[name](input_ids=a_ids).logits[0, len(prompt) - 1:].float().cpu()
            hf_agree += ref.argmax(-1).tolist() == tokens
            async_hf_agree += a_ref.argmax(-1).tolist() == overlapped[rid]
            g = torch.stack(got_logits[rid])
            worst_hf = max(worst_hf, ((g - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item())
            if len(want_logits[rid]) == len(got_logits[rid]):
                e = torch.stack(want_logits[rid])
                worst_eager = max(worst_eager, ((g - e).abs().amax(-1) / e.abs().amax(-1)).max().item())
            else:
                worst_eager = float("inf")
    same_as_eager = sum(got[r] == want[r] for r in got)
    async_same = sum(overlapped.get(r) == got[r] for r in got)
    async_ok = (async_info["overlapped_steps"] > 0 and async_info["early_launched_steps"] > 0
                and async_info["replays"] > 0 and async_info["mixed_replays"] > 0 and async_same == len(requests)
                and async_hf_agree == len(requests))
    ok = (info["num_graphs"] > 0 and info["replays"] > 0 and info["mixed_replays"] > 0
          and same_as_eager == len(requests)
          and hf_agree == len(requests) and worst_hf <= args.tol and async_ok)
    return dict(stage=f"tiny-{family}", ok=ok, requests=len(requests), same_tokens_as_eager=same_as_eager,
                hf_greedy_agree=hf_agree, worst_rel_err_vs_hf=worst_hf, worst_rel_err_vs_eager=worst_eager,
                async_same_tokens_as_graphs=async_same, async_hf_greedy_agree=async_hf_agree,
                async_overlapped_steps=async_info["overlapped_steps"],
                async_early_launched_steps=async_info["early_launched_steps"], async_replays=async_info["replays"],
                async_mixed_replays=async_info["mixed_replays"],
                **info)


# ---- perf: GPT-OSS-20B shape, bf16, dummy weights -------------------------------------------------------------
def fill_random_slots(slots, num: int, seed: int = 0, rank: int = 32) -> None:
    """Random adapters of ``rank`` on every target in resident slots 0..num-1 (drawn on the device)."""
    from loraplex.engine.testing.adapters import random_adapter

    for slot in range(num):
        handle = slots.load(slot, random_adapter(slots, f"random/{slot}", rank=rank, seed=seed + slot, scale=0.1,
                                                 device=slots.device))
        while not handle.done():
            time.sleep(0.001)


def add_decode_requests(engine, seq_slot: dict, batch: int, adapters: int, max_tokens: int, prompt_len: int,
                        tag: str) -> list[str]:
    """``batch`` greedy requests (ids ``<tag>-<i>``) of random ``prompt_len``-token prompts, request i on adapter
    slot i % ``adapters`` (every one on the base with 0): ``seq_slot``, cleared first, maps their sequences to slots
    for the runner patched in ``stage_perf``. Returns the ids."""
    import torch

    from loraplex.engine import SamplingParams

    seq_slot.clear()
    gen = torch.Generator().manual_seed(batch * 10 + adapters)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = []
    for i in range(batch):
        rid = f"{tag}-{i}"
        engine.add_request(rid, torch.randint(10, engine.model_config.vocab_size, (prompt_len,), generator=gen).tolist(),
                           params)
        if adapters:
            seq_slot[engine._requests[rid].group.seqs[0].seq_id] = i % adapters
        rids.append(rid)
    return rids


def time_decode(engine, seq_slot: dict, batch: int, adapters: int, steps: int, mode: str, prompt_len: int) -> float:
    """Mean ms of ``engine.step()`` once ``batch`` requests are all decoding; ``mode``: "eager" (graphs off),
    "graphs" or "async" (graphs and overlapped scheduling) for the warm-up and timed steps; the requests are then
    aborted."""
    import torch

    runner = engine.runner
    graphs = runner.decode_graphs
    rids = add_decode_requests(engine, seq_slot, batch, adapters, steps + 8, prompt_len, f"b{batch}-a{adapters}-{mode}")
    engine.step()  # the prefill (one step at these sizes)
    runner.decode_graphs = graphs if mode != "eager" else None
    engine.async_scheduling = mode == "async"
    try:
        for _ in range(3):
            engine.step()
        sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        ms = (time.perf_counter() - t0) / steps * 1e3
    finally:
        runner.decode_graphs = graphs
    for rid in rids:  # the step still in flight (async) is resolved by the steps below
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.async_scheduling = False
    return ms


def stage_perf(args) -> dict:
    import torch

    from loraplex.bench.workload import SCALES, write_model_config
    from loraplex.engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model_config(os.path.join(tmp, f"gpt-oss-{args.scale}"), SCALES[args.scale])
        t0 = time.perf_counter()
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        engine = LLMEngine.from_pretrained(folder, device=args.device, dtype=dtype, load_format="dummy",
                                           progress=False, max_model_len=512, max_num_seqs=16,
                                           max_num_batched_tokens=2048, num_kv_blocks=16 * 32 + 64,
                                           enable_prefix_caching=False, swap_space_bytes=0, enable_lora=True,
                                           max_lora_rank=32, cuda_graph_max_batch_size=16,
                                           async_scheduling=False,  # time_decode switches it per mode
                                           **({"quantization": args.quantization} if args.quantization else {}),
                                           adapter_cache_dir=os.path.join(tmp, "cache"))
        start_s = time.perf_counter() - t0
        runner = engine.runner
        if args.device == "cpu":
            runner.init_decode_graphs(capture=False)  # smoke run: the padded path stands in for the graphs
        fill_random_slots(runner.lora, 8)
        seq_slot: dict[int, int] = {}
        execute = runner.execute
        runner.execute = lambda out, sampling, lora_slots=None: execute(out, sampling, lora_slots=dict(seq_slot))
        launch = runner.launch_decode
        runner.launch_decode = lambda out, sampling, lora_slots=None, prev=None: launch(
            out, sampling, dict(seq_slot), prev)
        g = runner.decode_graphs
        res = dict(stage="perf", quantization=args.quantization, start_s=round(start_s, 1),
                   num_graphs=runner.num_cuda_graphs,
                   buckets=runner.cuda_graph_buckets, kv_blocks=runner.num_blocks,
                   kv_gib=round(runner.kv_cache_bytes / 2**30, 3),
                   capture_s=round(g.capture_seconds, 2) if g is not None else None,
                   graph_mib=round(g.graph_memory_bytes / 2**20, 1) if g is not None else None, rows=[])
        if not runner.num_cuda_graphs and args.device == "cuda":
            res.update(ok=False, error="no CUDA graphs captured (see the warning above)")
            return res
        for batch in (1, 16):
            for adapters in (0, 8):
                row = dict(batch=batch, adapters=adapters)
                for mode in ("eager", "graphs", "async"):
                    try:
                        ms = time_decode(engine, seq_slot, batch, adapters, args.steps, mode, args.prompt_len)
                        row[f"{mode}_ms"] = round(ms, 3)
                    except Exception as e:  # noqa: BLE001 - report and go on with the other rows
                        row[f"{mode}_error"] = f"{type(e).__name__}: {e}"
                if "eager_ms" in row and "graphs_ms" in row:
                    row["speedup"] = round(row["eager_ms"] / row["graphs_ms"], 2)
                if "graphs_ms" in row and "async_ms" in row:
                    row["async_speedup"] = round(row["graphs_ms"] / row["async_ms"], 2)
                res["rows"].append(row)
                print(f"  batch {batch:>2} adapters {adapters}: {row}", flush=True)
        b1 = [r for r in res["rows"] if r["batch"] == 1 and "speedup" in r]
        res["ok"] = bool(b1) and all(r["speedup"] >= 1.0 for r in b1) and all("speedup" in r for r in res["rows"])
        return res


# ---- driver ---------------------------------------------------------------------------------------------------
def run_stage(stage: str, args) -> dict:
    if stage == "perf":
        return stage_perf(args)
    if stage.startswith("tiny-"):
        return stage_tiny(stage[len("tiny-"):], args)
    raise ValueError(f"unknown stage {stage!r}")


def print_summary(results: list[dict]) -> None:
    print("\n==== CUDA graphs check ====")
    for r in results:
        if r["stage"].startswith("tiny-") and "error" not in r:
            print(f"{r['stage']:<16} graphs={r['num_graphs']} replays={r['replays']} capture={r['capture_s']}s "
                  f"({r['graph_mib']} MiB) mixed-step graphs={r['mixed_graphs']} replays={r['mixed_replays']}/"
                  f"{r['async_mixed_replays']} (async)  tokens==eager {r['same_tokens_as_eager']}/{r['requests']}  "
                  f"HF/PEFT greedy {r['hf_greedy_agree']}/{r['requests']}  rel err vs HF {r['worst_rel_err_vs_hf']:.2e}"
                  f"  vs eager {r['worst_rel_err_vs_eager']:.2e}  async: tokens==graphs "
                  f"{r['async_same_tokens_as_graphs']}/{r['requests']} HF/PEFT {r['async_hf_greedy_agree']}/"
                  f"{r['requests']} overlapped steps {r['async_overlapped_steps']} "
                  f"early-launched arrivals {r['async_early_launched_steps']}")
        elif r["stage"] == "perf" and "error" not in r:
            print(f"perf: start {r['start_s']}s, {r['num_graphs']} graphs {r['buckets']} captured in {r['capture_s']}s "
                  f"({r['graph_mib']} MiB), KV {r['kv_blocks']} blocks ({r['kv_gib']} GiB)")
            print(f"  {'batch':>5} {'adapters':>8} {'eager ms':>9} {'graphs ms':>9} {'speedup':>7} {'async ms':>9} "
                  f"{'vs graphs':>9}")
            for row in r["rows"]:
                print(f"  {row['batch']:>5} {row['adapters']:>8} {row.get('eager_ms', 'ERR'):>9} "
                      f"{row.get('graphs_ms', 'ERR'):>9} {row.get('speedup', '-'):>7} {row.get('async_ms', 'ERR'):>9} "
                      f"{row.get('async_speedup', '-'):>9}"
                      + "".join(f"  {k}={v}" for k, v in row.items() if k.endswith("_error")))
        else:
            print(f"{r['stage']:<16} ERROR {r.get('error')}")
    for r in results:
        print(f"{'PASS' if r.get('ok') else 'FAIL'} {r['stage']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default=",".join([f"tiny-{f}" for f in FAMILIES] + ["perf"]))
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--tol", type=float, default=1e-4, help="relative logits error vs HF/PEFT (tiny stages)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per perf row")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no graphs: FAIL lines)")
    p.add_argument("--scale", default="full", choices=("full", "tiny"), help="perf model: GPT-OSS-20B or toy")
    p.add_argument("--quantization", default=None, choices=("int8", "mxfp4"), help="perf model's experts")
    p.add_argument("--budget-s", type=float, default=560, help="all stages together (a stage gets what is left)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # run one stage in this process
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.worker:
        try:
            result = run_stage(args.worker, args)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            result = dict(stage=args.worker, ok=False, error=f"{type(e).__name__}: {e}")
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0
    results = []
    begin = time.perf_counter()
    for stage in args.stages.split(","):
        left = args.budget_s - (time.perf_counter() - begin)
        timeout = int(min(STAGE_TIMEOUT_S["perf" if stage == "perf" else "tiny"], left))
        if timeout < 20:
            results.append(dict(stage=stage, ok=False, error="skipped: time budget spent"))
            continue
        t0 = time.perf_counter()
        print(f"---- stage {stage} (timeout {timeout}s)", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", stage, "--new-tokens", str(args.new_tokens),
               "--tol", str(args.tol), "--steps", str(args.steps), "--prompt-len", str(args.prompt_len),
               "--device", args.device, "--scale", args.scale] + (
                   ["--quantization", args.quantization] if args.quantization else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            out = proc.stdout + proc.stderr
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
            result = json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else \
                dict(stage=stage, ok=False, error=f"exit {proc.returncode}, no result")
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            result = dict(stage=stage, ok=False, error=f"timed out after {timeout}s")
        # the stage's log lines that matter: graph capture, KV pool, warnings, tracebacks
        for ln in out.splitlines():
            if any(k in ln for k in ("CUDA graph", "KV cache", "WARNING", "Error", "Traceback", "batch ", "File ")):
                print("   | " + ln[-300:])
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"     {'PASS' if result.get('ok') else 'FAIL'} {stage} ({result['wall_s']}s)", flush=True)
        results.append(result)
    print_summary(results)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "check_cuda_graphs.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
