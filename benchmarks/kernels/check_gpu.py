"""GPU correctness at real shapes: every Triton op against its torch reference in bf16 (rel. error <= 1e-2; the
quantised MoE ops, fused_moe_int8 and fused_moe_mxfp4, against the float path on their dequantised weights),
each LoRA op also in its named variants (fused_moe_lora's one kernel and PDL launches, lora_expand with PDL),
rotary_embedding and moe_route captured in one CUDA graph and replayed on new positions / logits, expert LoRA on
MXFP4 base weights (eager and in a CUDA graph), plus the compile-once check (changing the token count reuses
the compiled kernel).

    python3 benchmarks/kernels/check_gpu.py --model gpt-oss-20b --m 1,33,256
Exit status 1 if any op misses the tolerance.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from loraplex.kernels.tuning_cases import PRESETS, misc_cases, shared_metadata_cases, tunable_cases  # noqa: E402

TOLERANCE = 1e-2


def compiled_variants(kernel) -> int | None:
    """How many binaries a @triton.jit function holds (None if this Triton hides its cache)."""
    try:
        return sum(len(entry[0]) for entry in kernel.device_caches.values())
    except Exception:  # noqa: BLE001
        return None


def compile_once_check() -> list[str]:
    """Run each op at several token counts with one fixed config; each kernel must compile once."""
    from loraplex.kernels import fused_moe_lora as fl
    from loraplex.kernels import lora_expand as ex
    from loraplex.kernels import lora_shrink as sh
    from loraplex.kernels import paged_attention as pa
    from loraplex.kernels.moe_route import _moe_route_kernel
    from loraplex.kernels.rotary import _rotary_kernel
    from loraplex.kernels.tuning_cases import moe_lora_cases, dense_lora_cases, misc_cases as mc
    from loraplex.kernels.tuning_cases import routing_and_rope_cases

    s = PRESETS["gpt-oss-20b"]
    kernels = {"lora_shrink": sh._lora_shrink_kernel, "lora_expand": ex._lora_expand_kernel,
               "moe_lora_shrink": fl._moe_lora_shrink_kernel, "moe_lora_expand": fl._moe_lora_expand_kernel,
               "moe_lora_fused": fl._moe_lora_fused_kernel,
               "paged_attention": pa._paged_attention_kernel, "paged_attention_merge": pa._merge_splits_kernel,
               "rotary_embedding": _rotary_kernel, "moe_route": _moe_route_kernel}
    before = {k: compiled_variants(v) for k, v in kernels.items()}
    for m in (3, 17, 45, 100):  # same tile choice for paged attention (decode), fixed configs elsewhere
        for case in dense_lora_cases(s, m, 8, 32, torch.bfloat16, "cuda") + moe_lora_cases(s, m, 8, 32,
                                                                                            torch.bfloat16, "cuda"):
            case.run(case.default)
            if "fused" in case.variants:  # the one-kernel path, one fixed config
                case.run(case.variants["fused"])
        [c for c in mc(s, m, torch.bfloat16, "cuda", context=64) if c.label.startswith("paged")][0].run(None)
        for case in routing_and_rope_cases(s, m, torch.bfloat16, "cuda"):
            case.run(None)
    torch.cuda.synchronize()
    lines = []
    for name, kernel in kernels.items():
        after = compiled_variants(kernel)
        if after is None or before[name] is None:
            lines.append(f"compile-once {name}: cache not inspectable on this Triton")
            continue
        new = after - before[name]
        lines.append(f"compile-once {name}: {new} new binaries over M=3,17,45,100 ({'OK' if new <= 2 else 'FAIL'})")
    return lines


def split_kv_check() -> list[str]:
    """paged_attention's split-KV decode path at GPT-OSS shapes (64/8 heads of 64, block 16, bf16, sinks):
    forced num_splits 1 / 3 / 16 with window 128 or none, against the reference, with padded seq_len-0 rows; then
    one CUDA graph captured at some seq_lens and replayed at others (the grid must not depend on their values)."""
    from loraplex.kernels import reference
    from loraplex.kernels.paged_attention import paged_attention

    torch.manual_seed(7)
    ctx = [1, 17, 1000, 3000, 0, 129, 0]  # 0: padded rows
    b, bs, per = len(ctx), 16, 3000 // 16 + 1
    kc = torch.randn(b * per + 1, bs, 8, 64, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(b * per, device="cuda")[:b * per].view(b, per).to(torch.int32)
    seq_lens = torch.tensor(ctx, device="cuda", dtype=torch.int32)
    qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    q = torch.randn(b, 64, 64, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(64, device="cuda")
    lines = []

    def rel(got, want):
        return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)).item()
    for window in (None, 128):
        want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, sliding_window=window, sinks=sinks)
        for ns in (1, 3, 16):
            got = paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, sliding_window=window, sinks=sinks,
                                  num_splits=ns)
            err, pad_zero = rel(got, want), bool((got[[4, 6]] == 0).all())
            ok = err <= TOLERANCE and pad_zero
            lines.append(f"{'ok  ' if ok else 'FAIL'} paged_attention split-KV window={window} num_splits={ns:<2d}"
                         f"      rel_err={err:.2e} padded rows zero={pad_zero}")
    out = torch.empty_like(q)
    paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, sinks=sinks)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, sinks=sinks))
    seq_lens.copy_(torch.tensor([2999, 0, 5, 1, 64, 3000, 700], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    err = rel(out, reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, sinks=sinks))
    lines.append(f"{'ok  ' if err <= TOLERANCE else 'FAIL'} paged_attention split-KV CUDA graph replayed at new "
                 f"seq_lens rel_err={err:.2e}")
    return lines


def rope_and_route_graph_check() -> list[str]:
    """rotary_embedding (strided q / k views of a fused qkv buffer) and moe_route (GPT-OSS and softmax scorings)
    captured in one CUDA graph, then replayed after new positions, qkv and logits were copied into the captured
    inputs: the outputs must follow (nothing read on the host at capture) and match the references."""
    from loraplex.kernels import reference
    from loraplex.kernels.moe_route import moe_route
    from loraplex.kernels.rotary import rotary_embedding
    from loraplex.kernels.tuning_cases import distinct_logits, rel_error

    torch.manual_seed(11)
    t, qh, kvh, d, e, a = 16, 64, 8, 64, 32, 4
    qkv = torch.randn(t, (qh + 2 * kvh) * d, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, :qh * d].view(t, qh, d), qkv[:, qh * d:(qh + kvh) * d].view(t, kvh, d)
    cache = torch.randn(4096, d, device="cuda")
    positions = torch.randint(0, 4096, (t,), device="cuda")
    logits = distinct_logits(t, e, torch.bfloat16, "cuda")
    scorings = (("topk_softmax", False), ("softmax", True))

    def step():
        return rotary_embedding(positions, q, k, cache), [moe_route(logits, a, scoring=sc, renormalize=rn)
                                                          for sc, rn in scorings]

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_out, routes = step()
    positions.copy_(torch.randint(0, 4096, (t,), device="cuda"))
    qkv.copy_(torch.randn_like(qkv))
    logits.copy_(distinct_logits(t, e, torch.bfloat16, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    err = max(rel_error(g, w) for g, w in zip(rope_out, reference.rotary_embedding(positions, q, k, cache)))
    lines = [f"{'ok  ' if err <= TOLERANCE else 'FAIL'} rotary_embedding CUDA graph replayed at new positions "
             f"rel_err={err:.2e}"]
    for (sc, rn), (w, ids) in zip(scorings, routes):
        want_w, want_ids = reference.moe_route(logits, a, scoring=sc, renormalize=rn)
        same, err = torch.equal(ids, want_ids), rel_error(w, want_w)
        lines.append(f"{'ok  ' if same and err <= TOLERANCE else 'FAIL'} moe_route[{sc}] CUDA graph replayed at new "
                     f"logits ids equal={same} rel_err={err:.2e}")
    return lines


def mxfp4_experts_lora_check() -> list[str]:
    """Expert LoRA on MXFP4 base weights (``moe_experts_lora`` with uint8 blocks + E8M0 scales, as
    ``LoRAFusedExperts`` runs it over ``Mxfp4FusedExperts``) at GPT-OSS shapes, 8 adapters of rank 32, some tokens
    without one: eager at M = 1 and 16, the kernel layout (``prepare_for_kernel``, the engine's on CUDA) from M = 1 to
    2048, then one CUDA graph replayed on new inputs, against the reference."""
    from loraplex.kernels import reference_lora
    from loraplex.kernels.moe_experts_lora import moe_experts_lora
    from loraplex.kernels.mxfp4 import prepare_for_kernel, quantize_mxfp4
    from loraplex.kernels.tuning_cases import rel_error

    torch.manual_seed(13)
    s = PRESETS["gpt-oss-20b"]
    e, h, i, a, num_loras, rank = s.num_experts, s.hidden, s.moe_intermediate, s.top_k, 8, 32
    dev, bf16 = "cuda", torch.bfloat16
    q13, s13 = quantize_mxfp4((torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).to(bf16))
    q2, s2 = quantize_mxfp4((torch.randn(e, h, i, device=dev) / i ** 0.5).to(bf16))
    kw = dict(w13_scale=s13, w2_scale=s2, activation=s.activation,
              b13=torch.randn(e, 2 * i, device=dev, dtype=bf16) * 0.1,
              b2=torch.randn(e, h, device=dev, dtype=bf16) * 0.1,
              w13_lora=(torch.randn(num_loras, e, rank, h, device=dev, dtype=bf16) / h ** 0.5,
                        torch.randn(num_loras, e, 2 * i, rank, device=dev, dtype=bf16) * 0.02),
              w2_lora=(torch.randn(num_loras, e, rank, i, device=dev, dtype=bf16) / i ** 0.5,
                       torch.randn(num_loras, e, h, rank, device=dev, dtype=bf16) * 0.02))
    scaling = torch.rand(num_loras, device=dev) + 0.5
    lines = []

    def inputs(m):
        x = torch.randn(m, h, device=dev, dtype=bf16)
        weights, ids = torch.topk(torch.randn(m, e, device=dev).softmax(-1), a, dim=-1)
        idx = (torch.arange(m, device=dev) % (num_loras + 1) - 1).to(torch.int32)  # -1: no adapter
        return x, q13, q2, weights, ids, idx, scaling

    for m in (1, 16):
        args = inputs(m)
        err = rel_error(moe_experts_lora(*args, **kw), reference_lora.moe_experts_lora(*args, **kw))
        lines.append(f"{'ok  ' if err <= TOLERANCE else 'FAIL'} moe_experts_lora[mxfp4 base] M={m:<3d} "
                     f"rel_err={err:.2e}")
    # the kernel layout, as the engine runs it on CUDA, at decode and at prefill sizes (the tuned tiles of each)
    k13, ks13 = prepare_for_kernel(q13, s13)
    k2, ks2 = prepare_for_kernel(q2, s2)
    kernel_kw = {**kw, "w13_scale": ks13, "w2_scale": ks2}
    for m in (1, 16, 64, 1727, 2048):
        x, _, _, weights, ids, idx, scl = inputs(m)
        got = moe_experts_lora(x, k13, k2, weights, ids, idx, scl, **kernel_kw)
        err = rel_error(got, reference_lora.moe_experts_lora(x, q13, q2, weights, ids, idx, scl, **kw))
        lines.append(f"{'ok  ' if err <= TOLERANCE else 'FAIL'} moe_experts_lora[mxfp4 kernel layout] M={m:<4d} "
                     f"rel_err={err:.2e}")
    args = inputs(16)
    out = moe_experts_lora(*args, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_lora(*args, **kw)
    for dst, src in zip(args, inputs(16)):  # new x, routing and adapters into the captured inputs
        if dst is not src:
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    err = rel_error(out, reference_lora.moe_experts_lora(*args, **kw))
    lines.append(f"{'ok  ' if err <= TOLERANCE else 'FAIL'} moe_experts_lora[mxfp4 base] CUDA graph replayed at new "
                 f"inputs rel_err={err:.2e}")
    return lines


def copy_blocks_and_dispatch_check() -> list[str]:
    """copy_blocks (not graph-capturable, so not in the cases) and that CUDA tensors dispatch to Triton."""
    from loraplex.kernels import dispatch, reference
    from loraplex.kernels.copy_blocks import copy_blocks

    ks = [torch.randn(64, 16, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    vs = [torch.randn(64, 16, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    mapping = torch.tensor([[3, 40], [7, 9], [63, 0]], device="cuda")
    want_k, want_v = [k.clone() for k in ks], [v.clone() for v in vs]
    copy_blocks(ks, vs, mapping)
    reference.copy_blocks(want_k, want_v, mapping)
    same = all(torch.equal(a, b) for a, b in zip(ks + vs, want_k + want_v))
    x = torch.randn(2, 8, device="cuda")
    picked = {name: dispatch.resolve(name, x).__module__ for name in dispatch.TRITON_LAUNCHERS}
    off = [n for n, mod in picked.items() if "reference" in mod]
    return [f"{'ok  ' if same else 'FAIL'} copy_blocks (4 layers, 3 copies, one launch) exact={same}",
            f"{'ok  ' if not off else 'FAIL'} dispatch on CUDA picks Triton for {len(picked) - len(off)}/{len(picked)}"
            f" ops{'; reference for ' + ', '.join(off) if off else ''}"]


def norm_router_check() -> list[str]:
    """rms_norm_router at the model's norm and router shapes in bf16, M = 1, 16, 64 (fused) and 65 (norm then
    GEMM), captured in a CUDA graph and replayed on new inputs: the new residual and the norm's output equal
    rms_norm's bit for bit, the logits are within one bf16 unit in the last place of the float32 product of the
    same bf16 values, and the top-4 experts of each row agree with F.linear's wherever its 4th and 5th logits
    are apart."""
    import torch.nn.functional as F

    from loraplex.kernels.rms_norm import rms_norm
    from loraplex.kernels.rms_norm_router import rms_norm_router

    torch.manual_seed(12)
    hidden, experts = 2880, 32
    w = torch.randn(hidden, device="cuda").bfloat16()
    rw = (torch.randn(experts, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    rb = torch.randn(experts, device="cuda").bfloat16()
    lines = []
    for m in (1, 16, 64, 65):
        x = torch.randn(m, hidden, device="cuda").bfloat16()
        res = torch.randn(m, hidden, device="cuda").bfloat16()
        rms_norm_router(x, w, 1e-5, res, rw, rb)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = rms_norm_router(x, w, 1e-5, res, rw, rb)
        x.copy_(torch.randn_like(x))
        res.copy_(torch.randn_like(res))
        graph.replay()
        torch.cuda.synchronize()
        out, res_out, logits = got
        want_out, want_res = rms_norm(x, w, 1e-5, res)
        exact = want_out.float() @ rw.float().T + rb.float()
        ulps = ((logits.float() - exact).abs() / (exact.abs().clamp_min(1e-3) * 2.0 ** -7)).max().item()
        ref_logits = F.linear(want_out, rw, rb)
        top = ref_logits.float().topk(5, dim=-1)
        clear = (top.values[:, 3] - top.values[:, 4]) > 2 * top.values[:, 3].abs() * 2.0 ** -7
        same_top = (logits.topk(4, dim=-1).indices.sort(-1).values == top.indices[:, :4].sort(-1).values).all(-1)
        ok = (torch.equal(res_out, want_res) and torch.equal(out, want_out) and ulps <= 1.0
              and bool(same_top[clear].all()))
        lines.append(f"{'ok  ' if ok else 'FAIL'} rms_norm_router M={m} (graph) norm equal={torch.equal(out, want_out)} "
                     f"logits within {ulps:.2f} ulp, top-4 equal on {int(same_top[clear].sum())}/{int(clear.sum())} "
                     f"clear rows")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="gpt-oss-20b", choices=sorted(PRESETS))
    p.add_argument("--m", default="1,33,256")
    p.add_argument("--only", default="", help="comma-separated label prefixes: run just those ops")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("check_gpu.py needs a CUDA GPU; torch sees none")
    shapes = PRESETS[args.model]
    worst, failed = 0.0, []
    print(f"# correctness on {torch.cuda.get_device_name()} at {shapes.name} shapes, bf16, tolerance {TOLERANCE}")
    for m in (int(v) for v in args.m.split(",")):
        torch.manual_seed(100 + m)
        cases = tunable_cases(shapes, m, 8, 32, torch.bfloat16, "cuda")
        cases += misc_cases(shapes, m, torch.bfloat16, "cuda", context=1024)
        cases += shared_metadata_cases(shapes, m, 8, 32, torch.bfloat16, "cuda")
        for case in cases:
            if args.only and not case.label.startswith(tuple(args.only.split(","))):
                continue
            runs = [("", None, False)] + [(name, cfg, False) for name, cfg in case.variants.items()]
            if case.op == "fused_moe_lora":  # PDL and the fused kernel inside a CUDA graph, as the engine runs them
                runs += [(f"{name}, graph", cfg, True) for name, cfg in case.variants.items()]
            for name, cfg, graph in runs:
                label = case.label + (f" ({name})" if name else "")
                try:
                    err = case.check(cfg, graph=True) if graph else case.check(cfg) if name else case.check()
                except Exception as e:  # noqa: BLE001  (a crash is a failure; go on with the other ops)
                    print(f"FAIL {label} M={m}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    failed.append(f"{label} M={m}")
                    continue
                worst = max(worst, err)
                ok = err <= TOLERANCE
                if not ok:
                    failed.append(f"{label} M={m}")
                print(f"{'ok  ' if ok else 'FAIL'} {label:48s} M={m:<4d} rel_err={err:.2e}", flush=True)
        del cases
        torch.cuda.empty_cache()
    for name, check in (("split-KV", split_kv_check), ("rope/route graph", rope_and_route_graph_check),
                        ("norm + router", norm_router_check),
                        ("MXFP4 expert-LoRA", mxfp4_experts_lora_check),
                        ("copy_blocks/dispatch", copy_blocks_and_dispatch_check)):
        _run_check(name, check, failed)
    try:
        for line in compile_once_check():
            print(line)
    except Exception as e:  # noqa: BLE001
        print(f"compile-once check crashed: {type(e).__name__}: {e}")
    print(f"worst rel. error {worst:.2e}; {'all within' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


def _run_check(name: str, check, failed: list[str]) -> None:
    """Print the lines of ``check()``; its FAIL lines, or a crash, go into ``failed``."""
    try:
        for line in check():
            print(line, flush=True)
            if line.startswith("FAIL"):
                failed.append(line)
    except Exception as e:  # noqa: BLE001  (a crash is a failure; go on with the other checks)
        print(f"FAIL {name} check crashed: {type(e).__name__}: {e}")
        failed.append(name)


if __name__ == "__main__":
    sys.exit(main())
