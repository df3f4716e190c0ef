"""MXFP4 expert GEMM on one GPU: every variant checked against the torch reference at GPT-OSS-20B shapes, a short
config sweep through the tuner, timing next to the bf16 and INT8 fused MoE, one table against the copy roofline.

    PYTHONPATH=$PWD OUT=/tmp/out python3 benchmarks/kernels/mxfp4_gemm_gpu.py              # H200: <= 5 minutes
    PYTHONPATH=$PWD python3 benchmarks/kernels/mxfp4_gemm_gpu.py --sweep-s 0               # committed configs only
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/kernels/mxfp4_gemm_gpu.py --tiny  # CPU smoke run (~2 min)

Writes into $OUT (default .), flat: ``mxfp4_gemm.json`` (every figure; rewritten after each row, so a crash or the
time budget loses nothing), ``mxfp4_gemm.md`` (the table) and ``fused_moe_mxfp4.json`` (the best variant per swept
M, in the tuning-file format: copy it to ``tuning_configs/<device>/fused_moe_mxfp4.json``). The tuner's working
folder is a temporary directory (a copy of the committed configs, the sweep's winners on top).

Phases, each wrapped (a failure is a row or a line, and the next phase runs):
1. copy roofline: a 1 GiB device-to-device copy, 2 GiB moved / median time of 5.
2. compile warm-up (``--compile-workers``, at most ``--warm-s``; CUDA only): worker processes launch every sweep
   candidate and every variant below once at M = 1 so that the Triton cache holds their binaries.
3. sweep: ``loraplex tune``'s ``tune_case`` over ``tuning_cases.mxfp4_moe_space(m)`` at ``--sweep-m`` within
   ``--sweep-s`` seconds; the winners go into the tuner's folder and are read back for what follows.
4. per M (``--m``, most telling first; stops at ``--budget-s``): correctness then time of each variant:
      kernel layout             fused_moe_mxfp4 on ``mxfp4.prepare_for_kernel``'s layout, tuned config
      kernel layout, <knob>     the tuned config with one knob changed (``RELATIVE_VARIANTS``: the scale multiply
                                in plain Triton, split-K on both GEMMs, register prefetch, gate/up in one product,
                                PDL launches, one pair per block without moe_align at M <= 4)
      <family>                  fixed configs of each kernel family (``DECODE_FAMILIES`` at M <= 64,
                                ``PREFILL_FAMILIES`` above), the first being the previous best ("run-1 ...")
      checkpoint layout         fused_moe's W_MXFP4 kernels on the checkpoint's bytes
      bf16, int8                fused_moe and fused_moe_int8 at their tuned configs
      lora kernel / lora checkpoint: moe_experts_lora with --max-loras adapters of --rank on both expert targets
                                (at ``--lora-m``), on each MXFP4 layout; "lora kernel layout, L2 prefetch": the
                                tuned config with LORA_L2 (the epilogues' B tiles asked of L2 before the K loop)
   plus, at ``--gemm-m``, each GEMM alone for the tuned config and each decode family ("gate_up, X" with its
   split-K finish, "down, X" with the top-k sum, "align, BLOCK_M b" the moe_align launch), and one CUDA-graph
   replay of the kernel layout at new inputs (the engine replays decode steps).
5. the table and the winners' file.

Correctness: rel. error ||got - want|| / ||want|| against ``reference_lora`` (bf16 activations), bound 1e-2 as
``check_gpu.py``. Timing: ``tuning_cases.bench_time_ms`` (CUDA-graph replay, each call after an L2 flush whose
own time is subtracted). Bytes (``nbytes``, the least a call must move; % roofline = bytes / time / copy rate):
per expert that the routing touches (distinct ids of topk_ids) the weights of w13 [2I, H] and w2 [H, I]:
MXFP4 codes N*K/2 plus E8M0 scales N*K/32 bytes (4.25 bits a weight; the layout's padding to K = 64k not
counted), bf16 2 bytes a weight, int8 1 byte a weight plus 4 per row; plus activations in bf16: x read and the
output written (2 * M * H), the intermediate written and read (2 * M * A * I). A GEMM alone: its own weights, its
input read and its output written. The LoRA rows add A and B of each distinct (adapter, expert) pair routed to,
R * (H + 2I) + R * (I + H) elements, and the pre-activation [M * A, 2I] written by gate_up, read and written by the
LoRA add and read by the activation (4 * M * A * 2I).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

TOLERANCE = 1e-2
MS = "16,1,64,4,256,2048,8,2,32,1024"  # most telling first: the budget may stop the run
SWEEP_MS = "1,16,64,256,1024,2048"
LORA_MS = "16,1,64,256"
GEMM_MS = "16,1,64"
_F = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "GU_SPLIT_K", "GU_FUSED", "PREFETCH", "num_warps",
      "num_stages")
# fixed configs of each family (not relative to the tuned one), the previous best first: the A/B of every change
DECODE_FAMILIES = {
    "run-1 best: wgmma 16x64x64, 6 stages": dict(zip(_F, (16, 64, 64, 1, 1, 1, 0, 0, 4, 6))),
    "mma.sync 8x64x256, 4 warps": dict(zip(_F, (8, 64, 256, 1, 1, 1, 0, 0, 4, 3))),
    "mma.sync 8x128x128, 4 warps": dict(zip(_F, (8, 128, 128, 1, 1, 1, 0, 0, 4, 3))),
    "mma.sync 16x64x128, 2 warps": dict(zip(_F, (16, 64, 128, 1, 1, 1, 0, 0, 2, 3))),
    "wgmma 16x64x128, 4 stages": dict(zip(_F, (16, 64, 128, 1, 1, 1, 0, 0, 4, 4))),
    "wgmma 16x64x128, register prefetch": dict(zip(_F, (16, 64, 128, 1, 1, 1, 0, 1, 4, 1))),
}
PREFILL_FAMILIES = {  # gate and up in one product only with 4 warps (``fused_moe_mxfp4.FUSED_MAX_WARPS``)
    "run-1 best: wgmma 128x128x64, 8 warps": dict(zip(_F, (128, 128, 64, 4, 1, 1, 0, 0, 8, 4))),
    "wgmma fused gate/up 128x128x64, 4 warps": dict(zip(_F, (128, 128, 64, 4, 1, 1, 1, 0, 4, 4))),
    "wgmma fused gate/up 256x64x64, 4 warps": dict(zip(_F, (256, 64, 64, 4, 1, 1, 1, 0, 4, 3))),
}
RELATIVE_VARIANTS = {  # the tuned config with one knob changed (split-K / direct only where they apply)
    "kernel layout, bits": {"DECODE": "bits"},
    "kernel layout, split-K 2+2": {"SPLIT_K": 2, "GU_SPLIT_K": 2},
    "kernel layout, split-K 4+4": {"SPLIT_K": 4, "GU_SPLIT_K": 4},
    "kernel layout, prefetch": {"PREFETCH": 1, "num_stages": 1},
    "kernel layout, fused gate/up": {"GU_FUSED": 1},
    "kernel layout, PDL": {"PDL": 1},
    "kernel layout, direct": {"DIRECT": 1},
}
SPLIT_VARIANT_MAX_M = 64  # the split-K rows only up to this M
DIRECT_MAX_M = 4  # the "direct" rows (one pair per block: experts shared by pairs are read again)
VARIANT_ORDER = ("kernel layout", *DECODE_FAMILIES, *PREFILL_FAMILIES, "checkpoint layout", "bf16", "int8",
                 *RELATIVE_VARIANTS, "lora kernel layout", "lora kernel layout, L2 prefetch",
                 "lora checkpoint layout", "kernel layout, graph replay")


def families(m: int) -> dict[str, dict]:
    return DECODE_FAMILIES if m <= 64 else PREFILL_FAMILIES


def relative_variants(m: int, tuned: dict) -> dict[str, dict]:
    """The knob rows that apply at M tokens to the tuned config (identical configs dropped)."""
    from loraplex.kernels.fused_moe_mxfp4 import FUSED_MAX_WARPS

    out = {}
    for name, extra in RELATIVE_VARIANTS.items():
        if ("SPLIT_K" in extra and m > SPLIT_VARIANT_MAX_M) or ("DIRECT" in extra and m > DIRECT_MAX_M):
            continue
        if "GU_FUSED" in extra and (int(tuned["BLOCK_N"]) % 32 or int(tuned["num_warps"]) > FUSED_MAX_WARPS):
            continue  # the launcher would run it unfused: the tuned config under another name
        cfg = {**tuned, **extra}
        if cfg != tuned:
            out[name] = cfg
    return out


# ------------------------------------------------------------------------------------------- byte model


def expert_weight_bytes(hidden: int, inter: int, fmt: str) -> int:
    """Bytes of one expert's w13 [2I, H] and w2 [H, I] in ``fmt`` ("mxfp4", "bf16", "int8")."""
    weights = 2 * inter * hidden + hidden * inter
    rows = 2 * inter + hidden
    if fmt == "mxfp4":
        return weights // 2 + weights // 32
    if fmt == "bf16":
        return 2 * weights
    if fmt == "int8":
        return weights + 4 * rows
    raise ValueError(f"unknown format {fmt!r}")


def activation_bytes(m: int, hidden: int, inter: int, top_k: int, elem: int = 2) -> int:
    """x read and the output written, the intermediate written and read."""
    return elem * (2 * m * hidden + 2 * m * top_k * inter)


def moe_bytes(m: int, active: int, hidden: int, inter: int, top_k: int, fmt: str, elem: int = 2) -> int:
    """The fused MoE's byte model (``tuning_cases.moe_cases``): touched experts' weights plus activations of
    ``elem`` bytes."""
    return active * expert_weight_bytes(hidden, inter, fmt) + activation_bytes(m, hidden, inter, top_k, elem)


def lora_extra_bytes(m: int, pairs: int, hidden: int, inter: int, top_k: int, rank: int, elem: int = 2) -> int:
    """What expert LoRA adds on both targets: A and B of ``pairs`` distinct (adapter, expert) pairs and the
    pre-activation's extra passes, ``elem`` bytes an element."""
    return elem * (pairs * rank * ((hidden + 2 * inter) + (inter + hidden)) + 4 * m * top_k * 2 * inter)


# ------------------------------------------------------------------------------------------- the run


@dataclass
class Shapes:
    name: str
    hidden: int
    num_experts: int
    top_k: int
    inter: int


GPT_OSS_20B = Shapes("gpt-oss-20b", 2880, 32, 4, 2880)
TINY = Shapes("tiny", 96, 4, 2, 64)  # K = 64 + 32 for gate_up


class Run:
    """Rows, the output file (``name`` in ``out_dir``, rewritten as rows come) and the time budget."""

    def __init__(self, out_dir: str, budget_s: float, meta: dict, *, name: str = "mxfp4_gemm.json") -> None:
        self.out_dir, self.name, self.start, self.budget_s = out_dir, name, time.monotonic(), budget_s
        self.data = {**meta, "rows": [], "notes": []}
        os.makedirs(out_dir, exist_ok=True)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def note(self, line: str) -> None:
        print(line, flush=True)
        self.data["notes"].append(line)
        self.save()

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        print(format_row(row), flush=True)
        self.save()

    def save(self) -> None:
        path = os.path.join(self.out_dir, self.name)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(path + ".tmp", path)


def format_row(r: dict) -> str:
    def num(key, fmt):
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    status = r.get("error") or ("ok" if r.get("ok") else "FAIL" if r.get("rel_err") is not None else "")
    return (f"| {r['m']} | {r['variant']} | {num('us', '.1f')} | {num('gbs', '.0f')} | {num('roofline_pct', '.1f')} | "
            f"{num('rel_err', '.1e')} | {status} | {r.get('config') or ''} |")


HEADER = "| M | variant | µs | GB/s | % roofline | rel err | check | config |\n|---:|---|---:|---:|---:|---:|---|---|"


def table(rows: list[dict]) -> str:
    order = {v: i for i, v in enumerate(VARIANT_ORDER)}
    rows = sorted(rows, key=lambda r: (r["m"], order.get(r["variant"], 99)))
    return "\n".join([HEADER] + [format_row(r) for r in rows])


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


def copy_bandwidth_tbs(device: str, nbytes: int) -> float:
    """Bytes read + written by a device-to-device copy of ``nbytes``, per second (median of 5), in TB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e12


def cpu_time_ms(fn, rep_ms: int = 20, **_) -> float:
    """Stand-in for ``bench_time_ms`` off CUDA (--tiny): wall time of one call."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


# ------------------------------------------------------------------------------------------- inputs


def moe_inputs(s: Shapes, m: int, device: str, gen_seed: int, dtype: torch.dtype = torch.bfloat16):
    """x, weights (float, both MXFP4 layouts, int8) and routing at M tokens, activations in ``dtype``."""
    from loraplex.kernels.mxfp4 import prepare_for_kernel, quantize_mxfp4
    from loraplex.kernels.reference_lora import quantize_int8_per_channel

    torch.manual_seed(gen_seed)
    h, e, i = s.hidden, s.num_experts, s.inter
    x = torch.randn(m, h, device=device).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, device=device) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=device) / i ** 0.5).to(dtype)
    b13 = (torch.randn(e, 2 * i, device=device) * 0.1).to(dtype)
    b2 = (torch.randn(e, h, device=device) * 0.1).to(dtype)
    values, ids = torch.topk(torch.randn(m, e, device=device), s.top_k, dim=-1)
    weights = torch.softmax(values, dim=-1)
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    plain = (q13, s13, q2, s2)
    kernel = (*prepare_for_kernel(q13, s13), *prepare_for_kernel(q2, s2))
    int8 = (*quantize_int8_per_channel(w13), *quantize_int8_per_channel(w2))
    return dict(x=x, w13=w13, w2=w2, b13=b13, b2=b2, ids=ids, weights=weights, plain=plain, kernel=kernel, int8=int8,
                active=int(ids.unique().numel()))


def lora_inputs(s: Shapes, m: int, ids: torch.Tensor, max_loras: int, rank: int, device: str, dtype: torch.dtype):
    from loraplex.kernels.reference_lora import as_expert_table

    h, e, i = s.hidden, s.num_experts, s.inter
    idx = (torch.arange(m, device=device) % max_loras).to(torch.int32)
    mk = lambda k, n: ((torch.randn(max_loras, e, rank, k, device=device) / k ** 0.5).to(dtype),  # noqa: E731
                       (torch.randn(max_loras, e, n, rank, device=device) / rank ** 0.5).to(dtype))
    pairs = int((idx.long()[:, None] * e + ids).unique().numel())
    # as the engine passes them: LoRATables built once (a stacked pair is copied into a table on every call)
    return dict(idx=idx, scaling=torch.full((max_loras,), 2.0, device=device), w13_lora=as_expert_table(mk(h, 2 * i)),
                w2_lora=as_expert_table(mk(i, h)), pairs=pairs)


# ------------------------------------------------------------------------------------------- phases


def winner_variants(winners: dict[int, dict], ms: list[int]) -> list[dict]:
    """The configs the rows will run that the first warm-up did not compile: the tuned config at each M of the run
    (the nearest swept M's) with each knob of ``relative_variants`` changed, and the tuned configs themselves."""
    from loraplex.kernels.fused_moe_mxfp4 import DEFAULT_CONFIG

    out: list[dict] = []
    for m in ms:
        if not winners:
            break
        near = min(winners, key=lambda w: (abs(w - m), w))
        tuned = {**DEFAULT_CONFIG, **winners[near]}
        for cfg in [tuned, *relative_variants(m, tuned).values()]:
            if cfg not in out:
                out.append(cfg)
    return out


def committed_run(out_dir: str, budget_s: float, args, ms: list[int], name: str):
    """What the MXFP4 sweeps start from: (``Run`` writing ``name`` into ``out_dir``, the 1 GiB copy's rate in TB/s,
    the GPT-OSS-20B tuning key's shape, the committed "fused_moe_mxfp4" config at each of ``ms``)."""
    from loraplex.kernels import fused_moe_mxfp4 as fm
    from loraplex.kernels import tuning

    s = GPT_OSS_20B
    run = Run(out_dir, budget_s, {"device": torch.cuda.get_device_name(), "shape": s.__dict__,
                                  "torch": torch.__version__, "args": vars(args)}, name=name)
    copy_tbs = copy_bandwidth_tbs("cuda", 1 << 30)
    run.note(f"copy roofline {copy_tbs:.2f} TB/s")
    shape = {"E": s.num_experts, "A": s.top_k, "H": s.hidden, "I": s.inter}  # fused_moe.shape_of's key
    committed = {m: {**fm.DEFAULT_CONFIG, **tuning.get_config("fused_moe_mxfp4", shape, m, fm.DEFAULT_CONFIG)}
                 for m in ms}
    return run, copy_tbs, shape, committed


def time_op_rows(m: int, variants: list[tuple[str, dict]], run: Run, copy_tbs: float, seed: int):
    """The whole op at M tokens (GPT-OSS-20B, fresh random inputs from ``seed``) for each (name, config) of
    ``variants``, in order until ``run``'s budget: output checked against the torch reference (rel. error, bound
    TOLERANCE), then timed by CUDA-graph replay after an L2 flush and held against the copy roofline. Returns (rows,
    ``call(cfg)``: the op on the same inputs); each row is also added to ``run``."""
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4
    from loraplex.kernels.tuning_cases import bench_time_ms

    s = GPT_OSS_20B
    inp = moe_inputs(s, m, "cuda", seed)
    x, ids, wts = inp["x"], inp["ids"], inp["weights"]
    kw = dict(activation="swiglu_clamp", b13=inp["b13"], b2=inp["b2"])
    want = ref.fused_moe_mxfp4(x, *inp["plain"], wts, ids, **kw)
    nbytes = moe_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "mxfp4")
    call = lambda cfg: fused_moe_mxfp4(x, *inp["kernel"], wts, ids, config=cfg, **kw)  # noqa: E731
    rows = []
    for variant, cfg in variants:
        if run.left_s() < 0:
            run.note(f"M = {m}: stopped at {variant} (time budget)")
            break
        r = {"m": m, "variant": variant, "config": cfg, "nbytes": nbytes, "active_experts": inp["active"]}
        try:
            r["rel_err"] = rel_error(call(cfg), want)
            r["ok"] = r["rel_err"] <= TOLERANCE
            if r["ok"]:
                r["us"] = bench_time_ms(lambda cfg=cfg: call(cfg)) * 1e3
                r["roofline_pct"] = 100 * nbytes / (r["us"] * 1e-6) / (copy_tbs * 1e12)
        except Exception as e:  # noqa: BLE001  (a row, not a crash)
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.synchronize()
        run.add(r)
        rows.append(r)
    return rows, call


def sweep_main(argv: list[str] | None, *, doc: str, name: str, default_m: str, warm_s: float, budget_s: float,
               candidates, measure) -> int:
    """The command line of a sweep of op configs against the committed ones (``mxfp4_one_launch_gpu.py``,
    ``mxfp4_tma_gpu.py``): at each --m, the committed config plus ``candidates(m)`` over it compiled in parallel
    (--warm-s), then ``measure(m, committed, run, copy_tbs)`` (the winning config, or None where the committed one
    stayed fastest); writes ``<name>.json`` (rows as they come), ``<name>.md`` and ``fused_moe_mxfp4.json`` (the
    device's file with the winners) to --out. 2 without a GPU."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--m", default=default_m)
    p.add_argument("--warm-s", type=float, default=warm_s, help="parallel compile warm-up budget (0: none)")
    p.add_argument("--compile-workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    p.add_argument("--budget-s", type=float, default=budget_s)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    ms = [int(v) for v in args.m.split(",")]
    run, copy_tbs, shape, committed = committed_run(args.out, args.budget_s, args, ms, f"{name}.json")
    if args.warm_s > 0:
        cfgs = []
        for m in ms:
            cfgs += [c for c in [committed[m]] + [{**committed[m], **o} for o in candidates(m)] if c not in cfgs]
        warm_compiles(GPT_OSS_20B, cfgs, args.compile_workers, run, args.warm_s, name)
    winners = {m: measure(m, committed[m], run, copy_tbs) for m in ms}
    write_tuning_file(args.out, shape, winners)
    write_rows_md(os.path.join(args.out, f"{name}.md"), run.data["rows"])
    return 0


def sweep_outcome(rows: list[dict], prefix: str) -> tuple[dict | None, dict | None]:
    """(the config to write, the fastest row whose variant starts with ``prefix``) of ``time_op_rows``' rows: the
    overall fastest row's config when it is such a row, else None (the committed config stays); None, None when
    nothing was timed."""
    timed = [r for r in rows if r.get("us") is not None]
    ours = [r for r in timed if r["variant"].startswith(prefix)]
    fastest = min(ours, key=lambda r: r["us"]) if ours else None
    best = min(timed, key=lambda r: r["us"]) if timed else None
    return (dict(best["config"]) if best is not None and best is fastest else None), fastest


def write_rows_md(path: str, rows: list[dict]) -> None:
    """The rows of ``time_op_rows`` as one markdown table (M, row, µs, % roofline, rel. error, error)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("| M | row | µs | % roofline | rel err |\n|---:|---|---:|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['m']} | {r['variant']} | {r.get('us', float('nan')):.1f} | "
                    f"{r.get('roofline_pct', float('nan')):.1f} | {r.get('rel_err', float('nan')):.1e} |"
                    f"{' ' + r['error'] if r.get('error') else ''}\n")


def write_tuning_file(out_dir: str, shape: dict, winners: dict[int, dict | None]) -> None:
    """``fused_moe_mxfp4.json`` in ``out_dir``: the device's committed file (its own, else the alias's) with each M
    of ``winners`` that has a config set to it."""
    from loraplex.kernels import tuning

    path = tuning.read_path("fused_moe_mxfp4", torch.cuda.get_device_name())
    table = json.loads(path.read_text(encoding="utf-8")) if path is not None else {}
    for m, cfg in winners.items():
        if cfg is not None:
            table.setdefault(tuning.shape_key(shape), {})[str(m)] = cfg
    with open(os.path.join(out_dir, "fused_moe_mxfp4.json"), "w", encoding="utf-8") as f:
        json.dump(table, f, indent=2)


def warm_configs(ms: list[int]) -> list[dict]:
    """Every sweep candidate at ``ms`` and every family config, each once."""
    from loraplex.kernels.tuning_cases import mxfp4_moe_space

    cfgs: list[dict] = []
    for cfg in [c for m in ms for c in mxfp4_moe_space(m)] + list(DECODE_FAMILIES.values()) \
            + list(PREFILL_FAMILIES.values()):
        if cfg not in cfgs:
            cfgs.append(cfg)
    return cfgs


def warm_compiles(s: Shapes, cfgs: list[dict], workers: int, run: Run, timeout_s: float, what: str,
                  lora: list[dict] = ()) -> None:
    """Launch gate_up and down of every config in ``cfgs`` once at M = 1 in ``workers`` processes (those in
    ``lora`` also as moe_experts_lora calls them; a ``ONE_LAUNCH`` config the whole op, its one launch), filling the
    Triton cache the main process reads (at most ``timeout_s``)."""
    import multiprocessing as mp

    if not cfgs:
        return
    jobs = [(s.__dict__, cfg, cfg in lora) for cfg in cfgs]
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(workers)
    try:
        done = pool.map_async(_warm_one, jobs, chunksize=1).get(timeout=timeout_s)
        run.note(f"compile warm-up ({what}): {sum(done)}/{len(jobs)} configs in {time.monotonic() - t0:.0f} s "
                 f"({workers} workers)")
    except mp.TimeoutError:
        run.note(f"compile warm-up ({what}) stopped after {timeout_s:.0f} s ({len(jobs)} configs, {workers} "
                 f"workers); the rest compiles when first run")
    finally:
        pool.terminate()
        pool.join()


def _warm_one(job) -> bool:
    shapes, cfg, lora = job
    try:
        from loraplex.kernels import fused_moe_mxfp4 as fm

        s = Shapes(**shapes)
        dev = "cuda"
        h, e, i = s.hidden, s.num_experts, s.inter
        x = torch.randn(1, h, device=dev).to(torch.bfloat16)
        kp = lambda k: -(-k // 64) * 64  # noqa: E731
        w13 = torch.randint(-2 ** 31, 2 ** 31 - 1, (e, 2 * i, kp(h) // 8), dtype=torch.int32, device=dev)
        s13 = torch.full((e, 2 * i, kp(h) // 32), 120, dtype=torch.uint8, device=dev)
        w2 = torch.randint(-2 ** 31, 2 ** 31 - 1, (e, h, kp(i) // 8), dtype=torch.int32, device=dev)
        s2 = torch.full((e, h, kp(i) // 32), 120, dtype=torch.uint8, device=dev)
        b13 = torch.zeros(e, 2 * i, device=dev, dtype=torch.bfloat16)
        b2 = torch.zeros(e, h, device=dev, dtype=torch.bfloat16)
        ids = torch.arange(s.top_k, device=dev)[None, :]
        weights = torch.full((1, s.top_k), 1.0 / s.top_k, device=dev)
        full = {**fm.DEFAULT_CONFIG, **cfg}
        if int(full.get("ONE_LAUNCH", 0)):  # fused_moe_mxfp4_one_launch
            fm.fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, activation="swiglu_clamp", b13=b13, b2=b2,
                               config=full)
            torch.cuda.synchronize()
            return True
        align = fm.route_tables(ids, e, full)
        hmid = fm.gate_up(x, w13, s13, align, full, top_k=s.top_k, activation="swiglu_clamp", b13=b13)
        fm.sum_pairs(fm.down(hmid, w2, s2, weights, align, full, b2=b2), 1, s.top_k, x.dtype)
        if lora:  # moe_experts_lora's calls: the pre-activation, no down split
            fm.gate_up(x, w13, s13, align, full, top_k=s.top_k, activation=None, b13=b13)
            fm.down(hmid, w2, s2, weights, align, full, b2=b2, split_k=1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001  (the main process compiles it again and reports)
        return False


def sweep(s: Shapes, ms: list[int], budget_s: float, tuning_root: str, device_name: str, run: Run,
          max_candidates: int | None, dtype: torch.dtype) -> dict[int, dict]:
    """``tune.tune_case`` on the MXFP4 case at each M; the winners are written into ``tuning_root``."""
    from loraplex.commands import tune
    from loraplex.kernels import tuning
    from loraplex.kernels.tuning_cases import moe_cases

    ms_shapes = _model_shapes(s)
    winners: dict[int, dict] = {}
    start = time.monotonic()
    key = None
    for n, m in enumerate(ms, 1):
        deadline = tune.case_deadline(start, budget_s, n, len(ms))
        try:
            torch.manual_seed(1000 + m)
            (case,) = moe_cases(ms_shapes, m, dtype, run.data["device_kind"], weights="mxfp4")
            if max_candidates is not None:
                case.space = case.space[:max_candidates]
            best, best_ms, default_ms = tune.tune_case(case, deadline)
            key = tuning.shape_key(case.shape)
            winners[m] = best
            run.note(f"sweep M={m}: default {default_ms * 1e3:.1f} us, tuned {best_ms * 1e3:.1f} us {best}")
        except Exception as e:  # noqa: BLE001
            run.note(f"sweep M={m} FAILED: {type(e).__name__}: {str(e)[:300]}")
    if winners and key:
        write_winners(key, winners, tuning_root, device_name)
    return winners


def write_winners(key: str, winners: dict[int, dict], tuning_root: str, device_name: str) -> str:
    from loraplex.kernels import tuning

    path = tuning.write_configs("fused_moe_mxfp4", {key: winners}, device_name=device_name, root=tuning_root)
    tuning.clear_cache()
    return str(path)


def _model_shapes(s: Shapes):
    from loraplex.kernels.tuning_cases import ModelShapes

    return ModelShapes(s.name, hidden=s.hidden, num_experts=s.num_experts, top_k=s.top_k, moe_intermediate=s.inter,
                       num_heads=4, num_kv_heads=1, head_dim=64, activation="swiglu_clamp", expert_bias=True,
                       router_scoring="topk_softmax")


def time_rows(s: Shapes, m: int, args, run: Run, timer, copy_tbs: float) -> list[dict]:
    """Correctness and time of every variant at M tokens (rows added to ``run`` as they come)."""
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.fused_moe import DEFAULT_CONFIG as CHECKPOINT_DEFAULT
    from loraplex.kernels.fused_moe import fused_moe, shape_of
    from loraplex.kernels.fused_moe_int8 import fused_moe_int8
    from loraplex.kernels.fused_moe_mxfp4 import DEFAULT_CONFIG, fused_moe_mxfp4
    from loraplex.kernels import tuning

    dev = run.data["device_kind"]
    inp = moe_inputs(s, m, dev, 2000 + m, args.dtype)
    x, ids, wts = inp["x"], inp["ids"], inp["weights"]
    kw = dict(activation="swiglu_clamp", b13=inp["b13"], b2=inp["b2"])
    want = ref.fused_moe_mxfp4(x, *inp["plain"], wts, ids, **kw)
    tuned = {**DEFAULT_CONFIG, **tuning.get_config("fused_moe_mxfp4", shape_of(x, inp["kernel"][0], ids), m,
                                                   DEFAULT_CONFIG)}
    elem = x.element_size()
    mx_bytes = moe_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "mxfp4", elem)
    rows = []

    def row(variant: str, fn, nbytes: int, check=None, config=None) -> None:
        """One row: ``check()`` (rel. error) if given, then the time of ``fn`` if given."""
        if run.left_s() < 0:
            r = {"m": m, "variant": variant, "error": "skipped: time budget"}
            run.add(r)
            rows.append(r)
            return
        r = {"m": m, "variant": variant, "config": config, "nbytes": nbytes, "active_experts": inp["active"]}
        try:
            if check is not None:
                r["rel_err"] = check()
                r["ok"] = r["rel_err"] <= TOLERANCE
            if fn is not None:
                ms = timer(fn)
                r["us"] = ms * 1e3
                r["gbs"] = nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")
                r["roofline_pct"] = 100 * r["gbs"] / (copy_tbs * 1e3) if ms > 0 else float("nan")
        except Exception as e:  # noqa: BLE001  (a row, not a crash)
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc(limit=3)
            if dev == "cuda":
                torch.cuda.synchronize()
        run.add(r)
        rows.append(r)

    def mx_row(variant: str, cfg: dict) -> None:
        row(variant, lambda: fused_moe_mxfp4(x, *inp["kernel"], wts, ids, config=cfg, **kw), mx_bytes,
            lambda: rel_error(fused_moe_mxfp4(x, *inp["kernel"], wts, ids, config=cfg, **kw), want), cfg)

    mx_row("kernel layout", tuned)
    cp = dict(CHECKPOINT_DEFAULT)
    row("checkpoint layout", lambda: fused_moe_mxfp4(x, *inp["plain"], wts, ids, config=cp, **kw), mx_bytes,
        lambda: rel_error(fused_moe_mxfp4(x, *inp["plain"], wts, ids, config=cp, **kw), want), cp)
    w13, w2 = inp["w13"], inp["w2"]
    row("bf16", lambda: fused_moe(x, w13, w2, wts, ids, **kw),
        moe_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "bf16", elem))
    q13, sc13, q2, sc2 = inp["int8"]
    row("int8", lambda: fused_moe_int8(x, q13, sc13, q2, sc2, wts, ids, **kw),
        moe_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "int8", elem))
    for variant, cfg in families(m).items():
        mx_row(variant, {**DEFAULT_CONFIG, **cfg})
    if m <= args.variant_max_m:
        for variant, cfg in relative_variants(m, tuned).items():
            mx_row(variant, cfg)
    if m in args.gemm_m:
        gemm_rows(s, m, inp, row, elem, {"kernel layout": tuned,
                                         **{k: {**DEFAULT_CONFIG, **v} for k, v in DECODE_FAMILIES.items()}})
    if m in args.lora_m:
        lora_rows(s, m, inp, args, row, mx_bytes)
    if m == args.graph_m and dev == "cuda":
        graph_row(s, m, inp, kw, row, mx_bytes, tuned)
    del inp
    return rows


def gemm_bytes(m: int, active: int, hidden: int, inter: int, top_k: int, which: str, elem: int = 2) -> int:
    """One GEMM alone: the touched experts' MXFP4 weights of it, its input read and its output written."""
    if which == "gate_up":
        return active * (2 * inter * hidden * 17 // 32) + elem * (m * hidden + m * top_k * inter)
    return active * (hidden * inter * 17 // 32) + elem * (m * top_k * inter + m * hidden)


def gemm_rows(s: Shapes, m: int, inp: dict, row, elem: int, cfgs: dict[str, dict]) -> None:
    """Each GEMM of ``cfgs`` alone (the alignment tables made outside the timed call), and the alignment launch of
    each BLOCK_M; time only (the whole op's rows check the same kernels)."""
    from loraplex.kernels import fused_moe_mxfp4 as fm

    x, ids, wts = inp["x"], inp["ids"], inp["weights"]
    w13, s13, w2, s2 = inp["kernel"]
    num_experts = s.num_experts
    aligned = set()
    for name, cfg in cfgs.items():
        align = fm.route_tables(ids, num_experts, cfg)
        key = ("direct" if int(cfg.get("DIRECT", 0)) else int(cfg["BLOCK_M"]))
        if key not in aligned and key != "direct":
            aligned.add(key)
            row(f"align, BLOCK_M {key}", lambda cfg=cfg: fm.route_tables(ids, num_experts, cfg), 0)
        hmid = fm.gate_up(x, w13, s13, align, cfg, top_k=s.top_k, activation="swiglu_clamp", b13=inp["b13"])
        row(f"gate_up, {name}", lambda cfg=cfg, align=align: fm.gate_up(
            x, w13, s13, align, cfg, top_k=s.top_k, activation="swiglu_clamp", b13=inp["b13"]),
            gemm_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "gate_up", elem), config=cfg)
        row(f"down, {name}", lambda cfg=cfg, align=align, hmid=hmid: fm.sum_pairs(
            fm.down(hmid, w2, s2, wts, align, cfg, b2=inp["b2"]), m, s.top_k, x.dtype),
            gemm_bytes(m, inp["active"], s.hidden, s.inter, s.top_k, "down", elem), config=cfg)


def lora_rows(s: Shapes, m: int, inp: dict, args, row, mx_bytes: int) -> None:
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.fused_moe_mxfp4 import kernel_config
    from loraplex.kernels.moe_experts_lora import moe_experts_lora

    lo = lora_inputs(s, m, inp["ids"], args.max_loras, args.rank, inp["x"].device.type, inp["x"].dtype)
    kw = dict(w13_lora=lo["w13_lora"], w2_lora=lo["w2_lora"], activation="swiglu_clamp", b13=inp["b13"],
              b2=inp["b2"])
    from loraplex.kernels.fused_moe import DEFAULT_CONFIG as CHECKPOINT_DEFAULT

    x, ids, wts = inp["x"], inp["ids"], inp["weights"]
    q13, s13, q2, s2 = inp["plain"]
    want = ref.moe_experts_lora(x, q13, q2, wts, ids, lo["idx"], lo["scaling"], w13_scale=s13, w2_scale=s2, **kw)
    nbytes = mx_bytes + lora_extra_bytes(m, lo["pairs"], s.hidden, s.inter, s.top_k, args.rank, x.element_size())
    hinted = {**kernel_config(x, inp["kernel"][0], ids), "LORA_L2": 1}  # the tuned config, B tiles prefetched to L2
    for variant, weights, cfg in (("lora kernel layout", inp["kernel"], None),
                                  ("lora kernel layout, L2 prefetch", inp["kernel"], hinted),
                                  ("lora checkpoint layout", inp["plain"], dict(CHECKPOINT_DEFAULT))):
        w13, sc13, w2, sc2 = weights
        fn = (lambda w13=w13, sc13=sc13, w2=w2, sc2=sc2, cfg=cfg: moe_experts_lora(
            x, w13, w2, wts, ids, lo["idx"], lo["scaling"], w13_scale=sc13, w2_scale=sc2, config=cfg, **kw))
        row(variant, fn, nbytes, lambda fn=fn: rel_error(fn(), want), cfg)


def graph_row(s: Shapes, m: int, inp: dict, kw: dict, row, mx_bytes: int, tuned: dict) -> None:
    """Capture the kernel layout's call once, replay it on new x and routing copied into the captured buffers."""
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4

    x, ids, wts = inp["x"].clone(), inp["ids"].clone(), inp["weights"].clone()
    holder = {}

    def capture_and_check() -> float:
        fused_moe_mxfp4(x, *inp["kernel"], wts, ids, **kw)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            holder["out"] = fused_moe_mxfp4(x, *inp["kernel"], wts, ids, **kw)
        x.copy_(torch.randn_like(x))
        values, new_ids = torch.topk(torch.randn(m, s.num_experts, device=x.device), s.top_k, dim=-1)
        ids.copy_(new_ids)
        wts.copy_(torch.softmax(values, dim=-1))
        g.replay()
        torch.cuda.synchronize()
        holder["graph"] = g
        return rel_error(holder["out"], ref.fused_moe_mxfp4(x, *inp["plain"], wts, ids, **kw))

    row("kernel layout, graph replay", None, mx_bytes, capture_and_check, tuned)  # correctness only


WHOLE_OP_VARIANTS = ("kernel layout", *DECODE_FAMILIES, *PREFILL_FAMILIES, *RELATIVE_VARIANTS)


def final_winners(rows: list[dict], sweep_ms: list[int], base: dict[int, dict]) -> dict[int, dict]:
    """Per swept M, the fastest correct whole-op kernel-layout variant's config (the sweep's winner unless a variant
    beat it by more than 1%)."""
    out = {}
    for m in sweep_ms:
        cands = [r for r in rows if r["m"] == m and r["variant"] in WHOLE_OP_VARIANTS and r.get("ok") and r.get("us")]
        if not cands:
            if m in base:
                out[m] = base[m]
            continue
        tuned = next((r for r in cands if r["variant"] == "kernel layout"), None)
        best = min(cands, key=lambda r: r["us"])
        if tuned is not None and best["us"] > 0.99 * tuned["us"]:
            best = tuned
        out[m] = {k: v for k, v in best["config"].items()}
    return out


# ------------------------------------------------------------------------------------------- main


def parse_ms(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--m", default=MS, help="token counts, in the order they run")
    p.add_argument("--sweep-m", default=SWEEP_MS)
    p.add_argument("--sweep-s", type=float, default=75.0, help="sweep time budget (0: no sweep)")
    p.add_argument("--sweep-candidates", type=int, default=None, help="at most this many candidates per M")
    p.add_argument("--lora-m", default=LORA_MS)
    p.add_argument("--variant-max-m", type=int, default=2048, help="knob rows (RELATIVE_VARIANTS) only up to this M")
    p.add_argument("--gemm-m", default=GEMM_MS, help="token counts with each GEMM timed alone")
    p.add_argument("--graph-m", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--budget-s", type=float, default=250.0, help="stop adding rows after this many seconds")
    p.add_argument("--compile-workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                   help="processes for the compile warm-up (0: none)")
    p.add_argument("--warm-s", type=float, default=50.0, help="compile warm-up time limit (sweep candidates)")
    p.add_argument("--warm-variants-s", type=float, default=25.0,
                   help="compile warm-up time limit (the winners' variants and LoRA calls)")
    p.add_argument("--rep-ms", type=int, default=10, help="graph length per timing (bench_time_ms rep_ms)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes; with TRITON_INTERPRET=1 on the CPU")
    args = p.parse_args(argv)
    args.lora_m = set(parse_ms(args.lora_m))
    args.gemm_m = set(parse_ms(args.gemm_m))
    from loraplex.kernels import tuning, tuning_cases

    cuda = torch.cuda.is_available() and not args.tiny
    s = TINY if args.tiny else GPT_OSS_20B
    args.dtype = torch.float32 if args.tiny else torch.bfloat16  # the interpreter's bf16 dots are wrong
    if args.tiny:
        args.m, args.sweep_m, args.graph_m = "1,3", "1,3", -1
        args.lora_m, args.max_loras, args.rank, args.gemm_m = {3}, 2, 8, {3}
        args.sweep_candidates = 2 if args.sweep_candidates is None else args.sweep_candidates
        tuning_cases.bench_time_ms = cpu_time_ms  # the tuner's timer, off CUDA (the flow, not the figures)
    if not cuda and not args.tiny:
        raise SystemExit("mxfp4_gemm_gpu needs a CUDA GPU (or --tiny with TRITON_INTERPRET=1)")
    device = "cuda" if cuda else "cpu"
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    import triton

    run = Run(args.out, args.budget_s, {
        "shapes": s.__dict__, "dtype": str(args.dtype), "device": device_name, "device_kind": device,
        "torch": torch.__version__,
        "triton": triton.__version__, "tolerance": TOLERANCE, "byte_model": __doc__.split("Bytes")[1].strip()})
    timer = (lambda fn: tuning_cases.bench_time_ms(fn, args.rep_ms)) if cuda else cpu_time_ms
    tuning_root = tempfile.mkdtemp(prefix="mxfp4_tuning_")  # the tuner's folder; the winners go to $OUT, flat
    rows: list[dict] = []
    winners: dict[int, dict] = {}
    try:
        try:
            copy_tbs = copy_bandwidth_tbs(device, (1 << 30) if cuda else (1 << 24))
        except Exception as e:  # noqa: BLE001
            copy_tbs = 4.2 if cuda else 1.0
            run.note(f"copy roofline FAILED ({type(e).__name__}: {e}); assuming {copy_tbs} TB/s")
        run.data["copy_tbs"] = copy_tbs
        run.note(f"# {s.name} on {device_name}: copy roofline {copy_tbs:.3g} TB/s, torch {torch.__version__}, "
                 f"triton {triton.__version__}")
        # the committed configs, then the sweep's winners on top, for every op of this run
        # (the files a read uses, same_as.json followed, copied as real files)
        folder = tuning.device_folder_name(device_name)
        os.makedirs(os.path.join(tuning_root, folder), exist_ok=True)
        for op, f in tuning.device_files(device_name).items():
            if op != "fused_moe_mxfp4" or args.sweep_s <= 0:
                shutil.copy(f, os.path.join(tuning_root, folder, f.name))
        os.environ[tuning.TUNING_DIR_ENV] = tuning_root
        tuning.clear_cache()
        sweep_ms = parse_ms(args.sweep_m)
        run_ms = parse_ms(args.m)
        warm = cuda and args.compile_workers > 0
        if args.sweep_s > 0:
            if warm:
                try:
                    warm_compiles(s, warm_configs(sweep_ms), args.compile_workers, run, args.warm_s, "candidates")
                except Exception as e:  # noqa: BLE001
                    run.note(f"compile warm-up FAILED: {type(e).__name__}: {e}")
            winners = sweep(s, sweep_ms, args.sweep_s, tuning_root, device_name, run, args.sweep_candidates,
                            args.dtype)
        if warm:
            try:
                from loraplex.kernels.fused_moe_mxfp4 import DEFAULT_CONFIG

                lora = [{**DEFAULT_CONFIG, **w} for w in winners.values()]
                warm_compiles(s, winner_variants(winners, run_ms), args.compile_workers, run, args.warm_variants_s,
                              "the winners' variants", lora=lora)
            except Exception as e:  # noqa: BLE001
                run.note(f"compile warm-up FAILED: {type(e).__name__}: {e}")
        for m in run_ms:
            if run.left_s() < 0:
                run.note(f"time budget spent: M={m} and later skipped")
                break
            try:
                rows += time_rows(s, m, args, run, timer, copy_tbs)
            except Exception as e:  # noqa: BLE001
                run.note(f"M={m} FAILED: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=4)
            if cuda:
                torch.cuda.empty_cache()
        if args.sweep_s > 0 and winners:
            final = final_winners(rows, sweep_ms, winners)
            key = tuning.shape_key({"E": s.num_experts, "A": s.top_k, "H": s.hidden, "I": s.inter})
            path = write_winners(key, final, tuning_root, device_name)
            flat = os.path.join(args.out, "fused_moe_mxfp4.json")
            shutil.copy(path, flat)
            run.data["winners"] = {str(k): v for k, v in final.items()}
            run.note(f"tuned configs (best variant per swept M): {flat}")
    finally:
        text = table(run.data["rows"])
        bad = [r for r in run.data["rows"] if r.get("error") or r.get("ok") is False]
        summary = (f"copy roofline {run.data.get('copy_tbs', float('nan')):.3g} TB/s; "
                   f"{len(run.data['rows'])} rows, {len(bad)} failed or skipped; "
                   f"{time.monotonic() - run.start:.0f} s")
        print("\n" + text + "\n" + summary, flush=True)
        with open(os.path.join(args.out, "mxfp4_gemm.md"), "w", encoding="utf-8") as f:
            f.write(text + "\n\n" + summary + "\n")
        run.data["summary"] = summary
        run.save()
        shutil.rmtree(tuning_root, ignore_errors=True)
    return 1 if any(r.get("ok") is False for r in run.data["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
