"""The fused expert path with multi-LoRA (``ops.moe_experts_lora``) on the GPU, at the GPT-OSS-20B shape.

E=32 experts top-4, H=I=2880, clamped SwiGLU with expert biases, bf16, 8 adapter slots of rank 32 (ranks 8 / 16
/ 32 zero-padded), every fourth token without an adapter. For M = 1, 16, 64, 256 tokens and for bf16 and INT8
weights, prints one row:

    err        max|op - ref| / max|ref|, ref = the torch reference in float32 on the same (bf16 / int8) inputs
    graph_err  the same after capturing the op in a CUDA graph and replaying it on fresh routing, adapters and
               activations copied into the captured inputs (nothing data-dependent baked into the graph)
    us         CUDA-graph replay time of the op; base_us: the same for the base fused_moe (no LoRA) at that M;
               loop_us: the pre-graph eager path (per-expert torch GEMMs, one host sync per call) for comparison

PASS needs err and graph_err <= --tol (1e-2). Each stage runs under its own alarm; a failing stage prints its error
and the script goes on. Writes $OUT/moe_lora_gpu.json when OUT is set. About a minute on an H200.

    python3 benchmarks/engine/check_moe_lora_gpu.py [--ms 1,16,64,256] [--tol 1e-2]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

E, A, H, I, L, R = 32, 4, 2880, 2880, 8, 32
RANKS = (8, 16, 32)


class StageTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise StageTimeout("stage timed out")


def make_weights(dev, int8: bool, gen: torch.Generator) -> dict:
    from loraplex.kernels.reference_lora import quantize_int8_per_channel

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale)

    w13 = rnd(E, 2 * I, H, scale=H ** -0.5).to(torch.bfloat16)
    w2 = rnd(E, H, I, scale=I ** -0.5).to(torch.bfloat16)
    kw = dict(b13=rnd(E, 2 * I, scale=0.1).to(torch.bfloat16), b2=rnd(E, H, scale=0.1).to(torch.bfloat16))
    if int8:
        w13, kw["w13_scale"] = quantize_int8_per_channel(w13)
        w2, kw["w2_scale"] = quantize_int8_per_channel(w2)
    mask = (torch.arange(R, device=dev)[None, :] < torch.tensor([RANKS[i % 3] for i in range(L)], device=dev)[:, None])
    mask = mask.to(torch.float32)

    def lora(k, n):
        a = rnd(L, E, R, k, scale=k ** -0.5) * mask[:, None, :, None]
        b = rnd(L, E, n, R, scale=0.5 * R ** -0.5) * mask[:, None, None, :]
        return a.to(torch.bfloat16).contiguous(), b.to(torch.bfloat16).contiguous()

    return dict(w13=w13, w2=w2, kw=kw, w13_lora=lora(H, 2 * I), w2_lora=lora(I, H),
                scaling=torch.rand(L, generator=gen, device=dev) + 0.5)


def make_step(m: int, dev, gen: torch.Generator) -> dict:
    logits = torch.randn(m, E, generator=gen, device=dev)
    vals, ids = torch.topk(logits, A, dim=-1)
    idx = torch.randint(0, L, (m,), generator=gen, device=dev, dtype=torch.int32)
    idx[::4] = -1
    return dict(x=torch.randn(m, H, generator=gen, device=dev).to(torch.bfloat16),
                weights=torch.softmax(vals, -1), ids=ids, idx=idx)


def run_op(w: dict, s: dict) -> torch.Tensor:
    from loraplex.kernels import ops

    return ops.moe_experts_lora(s["x"], w["w13"], w["w2"], s["weights"], s["ids"], s["idx"], w["scaling"],
                                w13_lora=w["w13_lora"], w2_lora=w["w2_lora"], activation="swiglu_clamp",
                                alpha=1.702, limit=7.0, **w["kw"])


def run_base(w: dict, s: dict) -> torch.Tensor:
    from loraplex.kernels import ops

    kw = dict(activation="swiglu_clamp", alpha=1.702, limit=7.0, b13=w["kw"]["b13"], b2=w["kw"]["b2"])
    if "w13_scale" in w["kw"]:
        return ops.fused_moe_int8(s["x"], w["w13"], w["kw"]["w13_scale"], w["w2"], w["kw"]["w2_scale"],
                                  s["weights"], s["ids"], **kw)
    return ops.fused_moe(s["x"], w["w13"], w["w2"], s["weights"], s["ids"], **kw)


def run_loop(w: dict, s: dict) -> torch.Tensor:
    """The path this op replaces: per-expert torch GEMMs (bincount().tolist() host sync), Triton LoRA kernels."""
    from loraplex.kernels import ops
    from loraplex.kernels.reference_lora import _grouped_linear

    x, ids, top_k = s["x"], s["ids"], A
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    kw = w["kw"]
    inter = _grouped_linear(x, order // top_k, order, counts, w["w13"], kw["b13"], kw.get("w13_scale"))
    ops.fused_moe_lora(inter, x, *w["w13_lora"], ids, s["idx"], w["scaling"])
    h = ops.swiglu_clamp_and_mul(inter, 1.702, 7.0)
    out = _grouped_linear(h, order, order, counts, w["w2"], kw["b2"], kw.get("w2_scale"))
    ops.fused_moe_lora(out, h, *w["w2_lora"], ids, s["idx"], w["scaling"])
    return (out.view(-1, top_k, H) * s["weights"].unsqueeze(-1).to(out.dtype)).sum(1)


def reference(w: dict, s: dict) -> torch.Tensor:
    from loraplex.kernels import reference_lora

    f = lambda t: None if t is None else (t if t.dtype in (torch.int8, torch.float32) else t.float())  # noqa: E731
    kw = {k: f(v) for k, v in w["kw"].items()}
    return reference_lora.moe_experts_lora(
        s["x"].float(), f(w["w13"]), f(w["w2"]), s["weights"], s["ids"], s["idx"], w["scaling"],
        w13_lora=tuple(map(f, w["w13_lora"])), w2_lora=tuple(map(f, w["w2_lora"])), activation="swiglu_clamp",
        alpha=1.702, limit=7.0, **kw)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def graph_of(fn, w: dict, s: dict):
    """(graph, static output) of fn(w, s) captured after a warm-up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(w, s)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(w, s)
    return g, out


def time_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def check(m: int, int8: bool, w: dict, gen, args) -> dict:
    dev = torch.device("cuda")
    row: dict = {"M": m, "weights": "int8" if int8 else "bf16"}
    s = make_step(m, dev, gen)
    row["err"] = rel_err(run_op(w, s), reference(w, s))
    g, out = graph_of(run_op, w, s)
    fresh = make_step(m, dev, gen)  # new routing, adapters and activations into the captured inputs
    for k in s:
        s[k].copy_(fresh[k])
    g.replay()
    torch.cuda.synchronize()
    row["graph_err"] = rel_err(out, reference(w, s))
    row["us"] = time_us(g.replay, args.iters)
    gb, _ = graph_of(run_base, w, s)
    row["base_us"] = time_us(gb.replay, args.iters)
    row["loop_us"] = time_us(lambda: run_loop(w, s), max(3, args.iters // 10))
    row["pass"] = row["err"] <= args.tol and row["graph_err"] <= args.tol
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", default="1,16,64,256")
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--stage-timeout", type=int, default=90, help="seconds per (weights, M) stage")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("check_moe_lora_gpu.py needs a CUDA GPU; torch sees none")
    torch.backends.cuda.matmul.allow_tf32 = False
    signal.signal(signal.SIGALRM, _alarm)
    print(f"device={torch.cuda.get_device_name()} kernels={os.environ.get('LORAPLEX_KERNELS', 'auto')} "
          f"E={E} A={A} H={H} I={I} L={L} R={R} bf16 swiglu_clamp+bias", flush=True)
    print(f"{'weights':<7} {'M':>4} {'err':>9} {'graph_err':>9} {'us':>8} {'base_us':>8} {'lora/base':>9} "
          f"{'loop_us':>9}  result", flush=True)
    rows, failed = [], False
    gen = torch.Generator(device="cuda").manual_seed(0)
    for int8 in (False, True):
        try:
            w = make_weights(torch.device("cuda"), int8, gen)
        except Exception:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            failed = True
            continue
        for m in (int(v) for v in args.ms.split(",")):
            t0 = time.perf_counter()
            signal.alarm(args.stage_timeout)
            try:
                r = check(m, int8, w, gen, args)
            except Exception as e:  # noqa: BLE001 - report and go on
                signal.alarm(0)
                failed = True
                print(f"{'int8' if int8 else 'bf16':<7} {m:>4} FAILED: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
                rows.append({"M": m, "weights": "int8" if int8 else "bf16", "error": f"{type(e).__name__}: {e}"})
                continue
            signal.alarm(0)
            failed |= not r["pass"]
            rows.append(r)
            print(f"{r['weights']:<7} {m:>4} {r['err']:>9.2e} {r['graph_err']:>9.2e} {r['us']:>8.1f} "
                  f"{r['base_us']:>8.1f} {r['us'] / r['base_us']:>9.2f} {r['loop_us']:>9.1f}  "
                  f"{'PASS' if r['pass'] else 'FAIL'}  ({time.perf_counter() - t0:.1f}s)", flush=True)
        del w
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_lora_gpu.json"), "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
