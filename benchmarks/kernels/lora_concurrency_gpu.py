"""Adapters at high concurrency on one GPU: tune the LoRA ops at large M, then probe a decode step's LoRA work.

1. ``loraplex tune`` of fused_moe_lora (gate_up and down), lora_shrink, lora_expand and lora_shrink_expand (qkv
   and o) at ``--m`` with the serving mix (``tuning_cases.serving_mix``: 32 adapters Zipf through a table as wide
   as the decode graph of M rows), written to ``$OUT/tuning/<device>/<op>.json`` (only the new M entries).
2. At ``--probe-m`` tokens with that mix, per call (CUDA-graph replay, cold L2; ``tuning_cases.bench_time_ms``):
   the expert layer with expert LoRA minus the layer without (``moe_experts_lora`` - ``fused_moe``), each
   fused_moe_lora target (its alignment included), moe_align_lora over the graph's table and over the used slots
   only, and the attention LoRA as the engine runs it (lora_shrink + lora_expand given the step's segments, qkv
   and o; qkv again through a table of only the 32 adapters: the cost of the graph table's idle slots; the same
   shrink and expand calls with "COMPACT" 1, 2, 4 beside them, checked against the reference first). Each
   under three tuning folders: "default" (no LoRA tuning files), "committed" (tuning_configs/) and "tuned"
   (tuning_configs/ with step 1's entries merged in). Byte floor: the LoRA factors the batch reads (the
   distinct (adapter, expert) pairs' R x (K + N), the used adapters' attention factors) at ``--peak-tbps``.

    python3 benchmarks/kernels/lora_concurrency_gpu.py --out "$OUT"                    # H200: about 170 s
    TRITON_INTERPRET=1 python3 benchmarks/kernels/lora_concurrency_gpu.py --device cpu --out /tmp/lc  # dry run

Prints the tuner's lines, then one verdict table (µs per call and floor / time), last; writes
``$OUT/lora_concurrency.json`` beside the tuning files.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from loraplex.kernels import tuning  # noqa: E402
from loraplex.kernels.tuning_cases import (PRESETS, ModelShapes, adapter_indices, bench_time_ms,  # noqa: E402
                                           dense_lora_cases, rel_error, serving_mix, tunable_cases, widen_table)

LORA_OPS = ("fused_moe_lora", "lora_shrink", "lora_expand", "lora_shrink_expand")
COMPACT_VALUES = (1, 2, 4)  # lora_shrink / lora_expand "COMPACT" rows beside the plain grid
CHECK_TOL = 2e-2  # relative error of a bf16 LoRA op against the fp32-accumulating reference
# the dry run's model: tiny dims, GPT-OSS's activation and expert bias
TINY = ModelShapes("tiny", hidden=64, num_experts=4, top_k=2, moe_intermediate=32, num_heads=4, num_kv_heads=2,
                   head_dim=16, activation="swiglu_clamp", expert_bias=True, router_scoring="topk_softmax")


def tune(args, shapes: ModelShapes, ms: list[int], out: Path, device_name: str) -> None:
    """Step 1: ``loraplex tune`` in this process (its compiles stay cached for the probe). The CPU dry run writes
    each case's first candidate through the same naming function instead (no timing without a GPU)."""
    if args.device == "cuda":
        from loraplex.cli import main as cli

        rc = cli(["tune", "--model", args.model, "--ops", ",".join(LORA_OPS), "--m", ",".join(map(str, ms)),
                  "--rank", str(args.rank), "--time-budget", str(args.tune_budget), "--out", str(out)])
        if rc:
            raise SystemExit(f"loraplex tune exited with {rc}")
        return
    results: dict[str, dict[str, dict[int, dict]]] = {}
    for m in ms:
        for case in tunable_cases(shapes, m, serving_mix(m), args.rank, torch.float32, "cpu", ops=set(LORA_OPS)):
            case.run(case.space[0])
            results.setdefault(case.op, {}).setdefault(tuning.shape_key(case.shape), {})[m] = dict(case.space[0])
            print(f"  {case.label:28s} M={m:<4d} (dry run) {case.space[0]}")
    for op, configs in results.items():
        print(f"wrote {tuning.write_configs(op, configs, device_name=device_name, root=out)}")


def tuning_roots(tmp: Path, tuned: Path, device_name: str) -> dict[str, Path]:
    """The three folders the probe reads configs from (module docstring)."""
    folder = tuning.device_folder_name(device_name)
    committed = tuning._REPO_TUNING_DIR
    roots = {"default": tmp / "default", "committed": committed, "tuned": tmp / "tuned"}
    for name in ("default", "tuned"):
        dst = roots[name] / folder
        dst.mkdir(parents=True)
        for op, f in tuning.device_files(device_name, committed).items():  # same_as.json followed: real files
            if name == "tuned" or op not in LORA_OPS:
                shutil.copy(f, dst / f.name)
    for f in (tuned / folder).glob("*.json"):  # merge the new M entries
        new = json.loads(f.read_text())
        tuning.write_configs(f.stem, {k: {int(m): c for m, c in v.items()} for k, v in new.items()},
                             device_name=device_name, root=roots["tuned"])
    return roots


def expert_inputs(s: ModelShapes, m: int, rank: int, dtype, device) -> dict:
    """Base expert weights, routing, and expert LoRA tables of the serving mix at M, as the engine passes them."""
    from loraplex.kernels.lora_table import LoRATable

    mix = serving_mix(m)
    h, e, i = s.hidden, s.num_experts, s.moe_intermediate
    gen = torch.Generator(device="cpu").manual_seed(m)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device)  # noqa: E731
    logits = torch.randn(m, e, generator=gen).to(device)
    vals, ids = torch.topk(logits, s.top_k, dim=-1)
    idx = adapter_indices(m, mix, device)

    def table(k, n):
        a = (torch.randn(mix.num_adapters, e, rank, k, device=device) / k ** 0.5).to(dtype)
        b = (torch.randn(mix.num_adapters, e, n, rank, device=device) / rank ** 0.5).to(dtype)
        return widen_table(LoRATable.from_stacked(a, b, experts=True), mix.slots)

    pairs = int((idx.long()[:, None] * e + ids).unique().numel())
    return dict(mix=mix, x=rnd(m, h).to(dtype), ids=ids, weights=torch.softmax(vals, dim=-1), idx=idx,
                w13=(torch.randn(e, 2 * i, h, device=device) / h ** 0.5).to(dtype),
                w2=(torch.randn(e, h, i, device=device) / i ** 0.5).to(dtype),
                b13=(torch.randn(e, 2 * i, device=device) * 0.1).to(dtype),
                b2=(torch.randn(e, h, device=device) * 0.1).to(dtype),
                w13_lora=table(h, 2 * i), w2_lora=table(i, h), scaling=torch.full((mix.slots,), 2.0, device=device),
                pairs=pairs, used=int(idx.unique().numel()),
                floor_bytes=pairs * rank * ((h + 2 * i) + (i + h)) * torch.finfo(dtype).bits // 8)


def probe_calls(s: ModelShapes, m: int, rank: int, dtype, device) -> tuple[dict, dict]:
    """(label -> (call, floor bytes or 0)), facts) at M tokens. Calls look their configs up when called, so the
    tuning folder in force at timing decides."""
    from loraplex.kernels import fused_moe_lora as fl
    from loraplex.kernels.fused_moe import fused_moe
    from loraplex.kernels.moe_align import moe_align_lora
    from loraplex.kernels.moe_experts_lora import moe_experts_lora

    inp = expert_inputs(s, m, rank, dtype, device)
    kw = dict(activation=s.activation, b13=inp["b13"], b2=inp["b2"])
    x, ids, wts, idx, sc = inp["x"], inp["ids"], inp["weights"], inp["idx"], inp["scaling"]
    elem = torch.finfo(dtype).bits // 8
    h, i, e = s.hidden, s.moe_intermediate, s.num_experts
    calls = {
        "expert layer, no LoRA": (lambda: fused_moe(x, inp["w13"], inp["w2"], wts, ids, **kw), 0),
        "expert layer + LoRA": (lambda: moe_experts_lora(x, inp["w13"], inp["w2"], wts, ids, idx, sc,
                                                         w13_lora=inp["w13_lora"], w2_lora=inp["w2_lora"], **kw),
                                0),  # its floor is on the LoRA delta's row
    }
    pre = torch.randn(m * s.top_k, 2 * i, device=device, dtype=dtype)
    hid = torch.randn(m * s.top_k, i, device=device, dtype=dtype)
    out = torch.randn(m * s.top_k, h, device=device, dtype=dtype)
    calls["fused_moe_lora[gate_up]"] = (lambda: fl.fused_moe_lora(pre, x, inp["w13_lora"], None, ids, idx, sc),
                                        inp["pairs"] * rank * (h + 2 * i) * elem)
    calls["fused_moe_lora[down]"] = (lambda: fl.fused_moe_lora(out, hid, inp["w2_lora"], None, ids, idx, sc, wts),
                                     inp["pairs"] * rank * (i + h) * elem)
    slots, used = inp["mix"].slots, inp["used"]
    calls[f"moe_align_lora L={slots}"] = (lambda: moe_align_lora(ids, idx, e, slots, 16), 0)
    calls[f"moe_align_lora L={used} (used only)"] = (lambda: moe_align_lora(ids, idx, e, used, 16), 0)
    # the used adapters' factors: A [S, r, K] read by the shrink, B [N, r] by the expand
    factor_elems = {"qkv": (3 * h, sum(s.qkv_slices)), "o": (s.num_heads * s.head_dim, h)}
    attn_floor = 0
    for target in ("qkv", "o"):
        a_elems, b_elems = factor_elems[target]
        for case in dense_lora_cases(s, m, inp["mix"], rank, dtype, device, shared_metadata=True, target=target):
            weights = used * rank * (a_elems if case.label.startswith("lora_shrink") else b_elems) * elem
            calls[case.label] = (lambda case=case: case.run(None), weights)
            attn_floor += weights
    # the COMPACT variants of the same calls (configs looked up when called, COMPACT set), checked first
    compact_errors = {}
    for target in ("qkv", "o"):
        for case in dense_lora_cases(s, m, inp["mix"], rank, dtype, device, shared_metadata=True, target=target):
            op = case.label.split("[")[0]
            for c in COMPACT_VALUES:
                cfg = lambda case=case, op=op, c=c: {  # noqa: E731
                    **tuning.get_config(op, case.shape, m, case.default), "COMPACT": c}
                label = f"{case.label} COMPACT={c}"
                if op == "lora_shrink":  # against the plain grid, itself checked against the reference below
                    err = rel_error(case.run(cfg()), case.run(None))
                    compact_errors[f"{case.label} (plain grid vs reference)"] = case.check()
                else:
                    err = case.check(cfg())
                compact_errors[label] = err
                calls[label] = (lambda case=case, cfg=cfg: case.run(cfg()), 0)
    bad = {k: v for k, v in compact_errors.items() if not v <= CHECK_TOL}
    if bad:
        raise SystemExit(f"COMPACT variants disagree with the reference: {bad}")
    # the same tokens through a table of only the adapters (no idle slots): what the graph's width costs
    narrow = dataclasses.replace(inp["mix"], table_slots=0)
    for case in dense_lora_cases(s, m, narrow, rank, dtype, device, shared_metadata=True, target="qkv"):
        calls[f"{case.label}, table of {narrow.slots}"] = (lambda case=case: case.run(None), 0)
    facts = dict(m=m, mix=str(inp["mix"]), used_adapters=used, expert_pairs=inp["pairs"],
                 expert_floor_bytes=inp["floor_bytes"], attention_bytes=attn_floor, compact_rel_errors=compact_errors)
    return calls, facts


def timer(device: str):
    """bench_time_ms on CUDA; the wall time of one call on the CPU (dry run: the figures mean nothing)."""
    if device == "cuda":
        return lambda fn: bench_time_ms(fn) * 1e3

    def cpu_us(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return cpu_us


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--m", default="128,512", help="M values to tune")
    p.add_argument("--probe-m", type=int, default=128)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--tune-budget", type=float, default=90.0, help="loraplex tune --time-budget (seconds)")
    p.add_argument("--layers", type=int, default=24, help="decoder layers, for the per-step estimate")
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth of the byte floor (H200: 4.8)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu (TRITON_INTERPRET=1) for a dry run")
    shapes = TINY if cpu else PRESETS[args.model]
    dtype = torch.float32 if cpu else torch.bfloat16
    device_name = "cpu" if cpu else torch.cuda.get_device_name()
    ms = sorted({int(v) for v in args.m.split(",")})
    t0 = time.monotonic()
    tuned_dir = out / "tuning"
    tune(args, shapes, ms, tuned_dir, device_name)
    print(f"# tuning done in {time.monotonic() - t0:.0f} s", flush=True)

    calls, facts = probe_calls(shapes, args.probe_m, args.rank, dtype, args.device)
    measure = timer(args.device)
    saved_env = os.environ.get(tuning.TUNING_DIR_ENV)
    times: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        roots = tuning_roots(Path(tmp), tuned_dir, device_name)
        for name, root in roots.items():
            os.environ[tuning.TUNING_DIR_ENV] = str(root)
            tuning.clear_cache()
            for label, (fn, _) in calls.items():
                times.setdefault(label, {})[name] = measure(fn)
    if saved_env is None:
        os.environ.pop(tuning.TUNING_DIR_ENV, None)
    else:
        os.environ[tuning.TUNING_DIR_ENV] = saved_env
    tuning.clear_cache()

    bw = args.peak_tbps * 1e12
    base = times.pop("expert layer, no LoRA")
    times["expert LoRA (layer + LoRA - layer)"] = {k: v - base[k] for k, v in times["expert layer + LoRA"].items()}
    floors = {label: f for label, (_, f) in calls.items()}
    floors["expert LoRA (layer + LoRA - layer)"] = facts["expert_floor_bytes"]
    attn = [label for label in times if label.startswith(("lora_shrink[", "lora_expand["))
            and "table of" not in label and "COMPACT" not in label]
    times["attention LoRA (qkv + o)"] = {k: sum(times[a][k] for a in attn) for k in base}
    floors["attention LoRA (qkv + o)"] = facts["attention_bytes"]
    for c in COMPACT_VALUES:
        label = f"attention LoRA (qkv + o), COMPACT={c}"
        times[label] = {k: sum(times[f"{a} COMPACT={c}"][k] for a in attn) for k in base}
        floors[label] = facts["attention_bytes"]
    step = {k: args.layers * (times["expert LoRA (layer + LoRA - layer)"][k] + times["attention LoRA (qkv + o)"][k])
            for k in base}
    floors_step = args.layers * (facts["expert_floor_bytes"] + facts["attention_bytes"])
    report = dict(facts, device=device_name, model=shapes.name, base_expert_layer_us=base, times_us=times,
                  floor_bytes={k: floors.get(k, 0) for k in times}, per_step_us=step,
                  per_step_floor_us=floors_step / bw * 1e6, peak_tbps=args.peak_tbps, layers=args.layers,
                  tuned_files=sorted(str(f.relative_to(out)) for f in tuned_dir.rglob("*.json")))
    (out / "lora_concurrency.json").write_text(json.dumps(report, indent=2) + "\n")

    print(f"\n# {shapes.name} on {device_name}, M={args.probe_m}, {facts['mix']}: {facts['used_adapters']} adapters "
          f"used, {facts['expert_pairs']} (adapter, expert) pairs; expert layer without LoRA "
          f"{base['committed']:.1f} us; floor at {args.peak_tbps} TB/s")
    print("| call | floor us | default us | committed us | tuned us | floor / tuned |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, t in times.items():
        f_us = floors.get(label, 0) / bw * 1e6
        share = f"{100 * f_us / t['tuned']:.0f}%" if f_us and t["tuned"] > 0 else "-"
        print(f"| {label} | {f_us:.1f} | {t['default']:.1f} | {t['committed']:.1f} | {t['tuned']:.1f} | {share} |")
    print(f"| per step: {args.layers} x (expert + attention LoRA) | {floors_step / bw * 1e6:.0f} | "
          f"{step['default']:.0f} | {step['committed']:.0f} | {step['tuned']:.0f} | "
          f"{100 * floors_step / bw * 1e6 / max(step['tuned'], 1e-9):.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
