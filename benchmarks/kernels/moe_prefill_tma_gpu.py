"""A probe of the bf16 expert GEMMs with the expert weights read through TMA: the kernels below are
``fused_moe``'s gate_up (bias, gated activation) and down (bias, routing weight) with each weight tile loaded by a
host ``TensorDescriptor`` over the experts' rows ([E * rows, K], one box per tile; a box past an expert's last row
reads the next expert's rows, which the store masks) instead of pointer loads; x / h rows are still gathered by
pointer. Each config's outputs are compared with ``fused_moe``'s (default config, same K order) and timed by
CUDA-graph replay after an L2 flush; on the CPU (no CUDA) it runs one small float32 case, for ``TRITON_INTERPRET=1``.
Not used by the engine: the measured lead for its prefill tiles (docs/performance.md, "bf16 expert GEMMs at an
arrival's size"). Env: MS (default 1727,2048), OUT.

    MS=1727 PYTHONPATH=$PWD python3 benchmarks/kernels/moe_prefill_tma_gpu.py       # H200: ~50 s
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/kernels/moe_prefill_tma_gpu.py
"""
import json, os
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from loraplex.kernels import fused_moe as fm
from loraplex.kernels.fused_moe import _grouped_pid
from loraplex.kernels.activation import gated_act
from loraplex.kernels.moe_align import moe_align


@triton.jit
def _gate_up_tma(x_ptr, w_desc, bias_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                 num_pairs, num_m, N, K, alpha, limit, stride_xt, stride_be, stride_ot,
                 TOP_K: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_N: tl.constexpr, STAGES: tl.constexpr):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_m, NUM_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    tok = (pairs // TOP_K).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + k[None, :]
    g_row = expert * 2 * N + pid_n * BLOCK_N
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        xt = tl.load(x_ptrs + k0, mask=row_ok[:, None], other=0.0)
        wg = w_desc.load([g_row, k0])
        wu = w_desc.load([g_row + N, k0])
        acc_g = tl.dot(xt, wg.T, acc_g)
        acc_u = tl.dot(xt, wu.T, acc_u)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc_g += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc_u += tl.load(bias_ptr + expert * stride_be + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    h = gated_act(acc_g, acc_u, ACT, alpha, limit)
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + cols[None, :], h.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_tma(h_ptr, w_desc, bias_ptr, weights_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
              num_pairs, num_m, N, K, stride_ht, stride_be, stride_ot,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
              NUM_N: tl.constexpr, STAGES: tl.constexpr):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_m, NUM_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    pairs64 = pairs.to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs64[:, None] * stride_ht + k[None, :]
    w_row = expert * N + pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        ht = tl.load(h_ptrs + k0, mask=row_ok[:, None] & (k0 + k < K)[None, :], other=0.0)
        wt = w_desc.load([w_row, k0])
        acc = tl.dot(ht, wt.T, acc)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pairs64, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs64[:, None] * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def gate_up_tma(x, w13, b13, align, cfg, top_k, act=1, alpha=1.702, limit=7.0):
    bm, bn, bk, gm = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["GROUP_M"]
    sorted_ids, expert_ids, num_post = align
    E, two_n, K = w13.shape
    N = two_n // 2
    if K % bk:  # x's K tail is not masked: the probe's shapes (H = 2880) are whole steps
        raise ValueError(f"hidden {K} is not a multiple of BLOCK_K {bk}")
    desc = TensorDescriptor.from_tensor(w13.view(E * two_n, K), [bn, bk])
    out = torch.empty(x.shape[0] * top_k, N, dtype=x.dtype, device=x.device)
    num_m, num_n = expert_ids.shape[0], triton.cdiv(N, bn)
    _gate_up_tma[(num_m * num_n,)](x, desc, b13, out, sorted_ids, expert_ids, num_post, x.shape[0] * top_k, num_m,
                                  N, K, alpha, limit, x.stride(0), b13.stride(0), out.stride(0), TOP_K=top_k,
                                  ACT=act, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, NUM_N=num_n,
                                  STAGES=cfg["num_stages"], num_warps=cfg["num_warps"])
    return out


def down_tma(h, w2, b2, tw, align, cfg):
    bm, bn, bk, gm = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["GROUP_M"]
    sorted_ids, expert_ids, num_post = align
    E, N, K = w2.shape
    desc = TensorDescriptor.from_tensor(w2.view(E * N, K), [bn, bk])
    out = torch.empty(h.shape[0], N, dtype=h.dtype, device=h.device)
    num_m, num_n = expert_ids.shape[0], triton.cdiv(N, bn)
    _down_tma[(num_m * num_n,)](h, desc, b2, tw.reshape(-1).contiguous(), out, sorted_ids, expert_ids, num_post,
                               h.shape[0], num_m, N, K, h.stride(0), b2.stride(0), out.stride(0), BLOCK_M=bm,
                               BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, NUM_N=num_n, STAGES=cfg["num_stages"],
                               num_warps=cfg["num_warps"])
    return out


def main():
    from loraplex.kernels.tuning_cases import rel_error, _routing
    cpu = not torch.cuda.is_available()
    dev = "cpu" if cpu else "cuda"
    E, A, H, I = (8, 2, 96, 80) if cpu else (32, 4, 2880, 2880)
    ms = [37] if cpu else [int(v) for v in os.environ.get("MS", "1727,2048").split(",")]
    dt = torch.float32 if cpu else torch.bfloat16
    torch.manual_seed(1)
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).to(dt)
    w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).to(dt)
    b13 = torch.randn(E, 2 * I, device=dev, dtype=dt) * 0.1
    b2 = torch.randn(E, H, device=dev, dtype=dt) * 0.1
    cfgs = ([dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)] if cpu else
            [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=st)
             for bm, bn, bk, w, st in [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3),
                                       (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
                                       (64, 256, 64, 8, 3), (128, 128, 128, 8, 3), (128, 64, 128, 4, 3)]])
    rows = []
    for m in ms:
        x = torch.randn(m, H, device=dev, dtype=dt)
        tw, ids = _routing(m, E, A, dev)
        pairs = m * A
        fl_gu, fl_dn = 2 * pairs * H * 2 * I, 2 * pairs * I * H
        ref_align = moe_align(ids, E, 16)
        ref_cfg = dict(fm.DEFAULT_CONFIG)
        h_ref = fm.gate_up(x, w13, ref_align, ref_cfg, top_k=A, activation="swiglu_clamp", b13=b13)
        d_ref = fm.down(h_ref, w2, tw, ref_align, ref_cfg, b2=b2)
        for cfg in cfgs:
            try:
                align = moe_align(ids, E, cfg["BLOCK_M"])
                h = gate_up_tma(x, w13, b13, align, cfg, A)
                d = down_tma(h_ref, w2, b2, tw, align, cfg)
                r = dict(m=m, cfg=cfg, err_gu=rel_error(h, h_ref), err_dn=rel_error(d, d_ref))
                if not cpu:
                    from loraplex.kernels.tuning_cases import bench_time_ms
                    r["gate_up_us"] = bench_time_ms(lambda: gate_up_tma(x, w13, b13, align, cfg, A)) * 1e3
                    r["down_us"] = bench_time_ms(lambda: down_tma(h_ref, w2, b2, tw, align, cfg)) * 1e3
                    r["gate_up_tflops"] = fl_gu / r["gate_up_us"] / 1e6
                    r["down_tflops"] = fl_dn / r["down_us"] / 1e6
            except Exception as ex:  # noqa: BLE001
                r = dict(m=m, cfg=cfg, error=f"{type(ex).__name__}: {str(ex)[:300]}")
            rows.append(r)
            print(json.dumps(r), flush=True)
    if not cpu:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows},
                  open(os.path.join(os.environ.get("OUT", "/tmp"), "moe_tma.json"), "w"), indent=1)
    return rows


if __name__ == "__main__":
    main()
