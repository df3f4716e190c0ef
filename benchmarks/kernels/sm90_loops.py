"""The hot kernels built for sm_90 on the CPU: each kernel's main loop in SASS, its registers and shared memory, under
the installed Triton. No GPU needed: Triton's NVIDIA backend compiles for a named target, and ``cuobjdump`` (in the
Triton wheel) prints the SASS.

    python3 benchmarks/kernels/sm90_loops.py                          # every case, a table
    python3 benchmarks/kernels/sm90_loops.py --cases mxfp4 --m 16,64 --json out.json
    PYTHONPATH=/tmp/triton-3.7.1 python3 benchmarks/kernels/sm90_loops.py   # another Triton release, installed with
        # pip install --no-deps --target /tmp/triton-3.7.1 triton==3.7.1

What it shows, per case (GPT-OSS-20B shapes, the H200's tuned configs at M tokens where the op has a tuning file):

    loop      SASS instructions of the main loop (the longest backward branch whose body holds the MMAs; empty for a
              kernel without a loop, whose other columns then count the whole kernel)
    mma       MMA instructions in it (HMMA: mma.sync; HGMMA: wgmma)
    sts ldsm bar   shared-memory stores, matrix loads, barriers in it: an operand that goes through shared memory
    shfl      lane shuffles in it: a register operand exchanged across lanes (e.g. a decoded tile in another order)
    ldg128    16-byte global loads in it
    regs smem registers per thread and static shared memory (occupancy)
    per word  MXFP4 GEMMs only: loop instructions per 32-bit word of 8 codes, per warp (the decode's issue cost)

These are compiler facts, not timings: they show a Triton release's layout choices (the MXFP4 decode GEMM's tile
went through shared memory under Triton 3.7 and 3.9 until its words were loaded as a 2-D tile) and what a kernel
change does to the instruction count before a GPU run times it. The kernels are built with the 16-divisibility the
JIT infers for aligned pointers, strides and sizes, as the engine's launches get them.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SHAPE = {"E": 32, "A": 4, "H": 2880, "I": 2880}  # GPT-OSS-20B experts
DEVICE = "NVIDIA H200"                           # whose tuning files give the configs
GROUPS = ("mxfp4", "moe", "attention", "lora")
DIV16 = ("N", "K", "H")


def build_sm90(kernel, consts: dict, types: dict, num_warps: int, num_stages: int):
    """``kernel`` compiled for sm_90: ``consts`` its constexprs, ``types`` pointer / scalar types by argument name
    (pointers default to ``types["*"]``, else bf16; other arguments i32); constexprs left out take their defaults.
    Pointers, strides and N / K / H carry the 16-divisibility the JIT infers for the engine's tensors."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from loraplex.kernels.launch import jit_function

    defaults = {p.name: p.default for p in jit_function(kernel).params
                if p.is_constexpr and p.default is not inspect.Parameter.empty}
    consts = {**defaults, **{k: v for k, v in consts.items() if k in kernel.arg_names}}
    sig = {n: "constexpr" if n in consts else types.get(n, types.get("*", "*bf16")) if n.endswith("_ptr")
           else types.get(n, "i32") for n in kernel.arg_names}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in kernel.arg_names
             if n not in consts and (n.endswith("_ptr") or n.startswith("stride") or n in DIV16)}
    src = ASTSource(fn=jit_function(kernel), signature=sig, constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                               num_stages=num_stages))


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _opcode(line: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", line).split()[0]


def loop_stats(compiled) -> dict:
    """The main loop of a compiled kernel's SASS (see the module docstring) and its resources."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,6})\*/\s+([^;]*);", sass)]
    body: list[str] = []
    for addr, text in code:
        jump = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if jump and int(jump.group(1), 16) < addr:
            span = [t for a, t in code if int(jump.group(1), 16) <= a <= addr]
            if (any("MMA" in t for t in span), len(span)) > (any("MMA" in t for t in body), len(body)):
                body = span
    looped = bool(body)
    body = body or [t for _, t in code]  # no loop (a single-step kernel): the whole kernel
    ops = collections.Counter(_opcode(t).split(".")[0] for t in body)
    regs = re.search(r"REG:(\d+)", usage)
    return {"loop": len(body) if looped else None, "mma": ops["HMMA"] + ops["HGMMA"], "sts": ops["STS"],
            "ldsm": ops["LDSM"], "bar": ops["BAR"], "shfl": ops["SHFL"],
            "ldg128": sum(_opcode(t).startswith("LDG.E.128") for t in body),
            "regs": int(regs.group(1)) if regs else None, "smem": int(compiled.metadata.shared),
            "instructions": len(code)}


# ---------------------------------------------------------------------------------------------------- cases
def _tuned(op: str, m: int, default: dict) -> dict:
    from loraplex.kernels import tuning

    return tuning.get_config(op, SHAPE, m, default, device_name=DEVICE)


_TABLES = {"sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "num_post_ptr": "*i32"}


def _mxfp4_cases(m: int) -> list[tuple]:
    from loraplex.kernels import fused_moe_mxfp4 as fm
    from loraplex.kernels.fused_moe import ACT_CODES

    cfg = _tuned("fused_moe_mxfp4", m, fm.DEFAULT_CONFIG)
    launch = fm._launch(cfg)[4]
    pdl = bool(int(cfg.get("PDL", 0)))  # on sm_90, as use_pdl answers there
    shape = dict(hidden=SHAPE["H"], inter=SHAPE["I"], has_bias=True, pdl=pdl)  # GPT-OSS's experts have biases
    gate_up = fm.gate_up_constexprs(cfg, top_k=SHAPE["A"], act=ACT_CODES["swiglu_clamp"], **shape)
    down = fm.down_constexprs(cfg, **shape)
    types = {**_TABLES, "w_ptr": "*i32", "s_ptr": "*u8", "weights_ptr": "*fp32", "alpha": "fp32", "limit": "fp32"}

    def words(c: dict, matrices: int) -> int:
        """Code words a K-loop iteration decodes per warp: rows x K / 8 codes a word, over 32 lanes."""
        return matrices * c["BLOCK_N"] * c["BLOCK_K"] // 8 // 32 // launch["num_warps"]

    return [(f"fused_moe_mxfp4 gate_up M={m}", fm._gate_up_kernel, gate_up, types, launch["num_warps"],
             launch["num_stages"], words(gate_up, 1 if gate_up["FUSED"] else 2)),
            (f"fused_moe_mxfp4 down M={m}", fm._down_kernel, down, types, launch["num_warps"], launch["num_stages"],
             words(down, 1))]


def _moe_cases(m: int) -> list[tuple]:
    from loraplex.kernels import fused_moe as fmo
    from loraplex.kernels.fused_moe import ACT_CODES

    out = []
    for op, int8 in (("fused_moe", False), ("fused_moe_int8", True)):
        cfg = _tuned(op, m, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
                             "num_stages": 4})
        bm, bn, bk = (int(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        types = {**_TABLES, "w_ptr": "*i8" if int8 else "*bf16", "scale_ptr": "*fp32", "weights_ptr": "*fp32",
                 "alpha": "fp32", "limit": "fp32"}
        common = dict(W_INT8=int8, W_MXFP4=False, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      GROUP_M=int(cfg["GROUP_M"]))
        out.append((f"{op} gate_up M={m}", fmo._moe_gate_up_kernel,
                    dict(common, TOP_K=SHAPE["A"], ACT=ACT_CODES["swiglu_clamp"], NUM_N=-(-SHAPE["I"] // bn),
                         EVEN_K=SHAPE["H"] % bk == 0), types, int(cfg["num_warps"]), int(cfg["num_stages"]), None))
        out.append((f"{op} down M={m}", fmo._moe_down_kernel,
                    dict(common, NUM_N=-(-SHAPE["H"] // bn), EVEN_K=SHAPE["I"] % bk == 0), types,
                    int(cfg["num_warps"]), int(cfg["num_stages"]), None))
    return out


def _attention_cases(m: int) -> list[tuple]:
    from loraplex.kernels import paged_attention as pa

    group, head_dim = 8, 64  # GPT-OSS-20B: 64 query heads over 8 KV heads of 64
    block_q, block_n = pa.default_blocks(m, m, group)
    types = {"*": "*i32", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
             "sinks_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
             "scale_log2": "fp32"}
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, GROUP=group, BLOCK_Q=block_q,
                  BLOCK_M=max(16, block_q * group), BLOCK_N=block_n, KV_BLOCK_SIZE=16, SEARCH_BLOCK=128,
                  USE_WINDOW=False, SINK_IN_LOOP=False, SPLIT=True)
    return [(f"paged_attention decode M={m}", pa._paged_attention_kernel, consts, types, 4, 2, None)]


def _lora_cases(m: int) -> list[tuple]:
    from loraplex.kernels import fused_moe_lora as fl
    from loraplex.kernels import lora_expand as ex
    from loraplex.kernels import lora_shrink as sh

    import triton.language as tl

    types = {"*": "*i32", "x_ptr": "*bf16", "y_ptr": "*bf16", "buf_ptr": "*fp32", "weights_ptr": "*fp32",
             "scaling_ptr": "*fp32", "entries_ptr": "*i64"}
    w = tl.bfloat16
    return [
        (f"fused_moe_lora shrink M={m}", fl._moe_lora_shrink_kernel,
         dict(ROW_DIV=SHAPE["A"], W_DTYPE=w, BLOCK_M=16, BLOCK_R=32, BLOCK_K=64, SPLIT_K=2, EVEN_K=True, BLOCK_L=8,
              PARTIALS=True, USE_PDL=False), types, 4, 2, None),
        (f"fused_moe_lora expand M={m}", fl._moe_lora_expand_kernel,
         dict(W_DTYPE=w, HAS_WEIGHTS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_R=32, GROUP_M=1, NUM_G=2, COLS=2,
              BLOCK_L=8, NUM_PARTS=2, USE_PDL=False), types, 4, 2, None),
        (f"lora_shrink M={m}", sh._lora_shrink_kernel,
         dict(W_DTYPE=w, BLOCK_M=16, BLOCK_R=32, BLOCK_K=64, SPLIT_K=4, EVEN_K=True, BLOCK_L=8, USE_PDL=False),
         types, 4, 2, None),
        (f"lora_expand M={m}", ex._lora_expand_kernel,
         dict(W_DTYPE=w, BLOCK_M=16, BLOCK_N=64, BLOCK_R=32, GROUP_M=1, NUM_N=4, BLOCK_L=8, USE_PDL=False),
         types, 4, 2, None),
    ]


CASES = {"mxfp4": _mxfp4_cases, "moe": _moe_cases, "attention": _attention_cases, "lora": _lora_cases}


def run(groups: list[str], ms: list[int]) -> list[dict]:
    import triton

    rows = []
    for group in groups:
        for m in ms:
            for name, kernel, consts, types, warps, stages, words in CASES[group](m):
                row = {"case": name, "triton": triton.__version__, "num_warps": warps, "num_stages": stages,
                       "constexprs": {k: v for k, v in consts.items() if isinstance(v, (bool, int, float))}}
                try:
                    row.update(loop_stats(build_sm90(kernel, consts, types, warps, stages)))
                except Exception as e:  # noqa: BLE001 - a case that does not build is reported, the rest go on
                    row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
                if words and row.get("loop"):
                    row["per_word"] = round(row["loop"] / words, 1)
                rows.append(row)
                print(_line(row), flush=True)
    return rows


_COLUMNS = ("loop", "mma", "sts", "ldsm", "bar", "shfl", "ldg128", "regs", "smem", "per_word")


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['case']:<34} {row['error']}"
    return f"{row['case']:<34}" + "".join(f"{'' if row.get(c) is None else row[c]:>9}" for c in _COLUMNS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", default=",".join(GROUPS), help=f"comma-separated groups of {', '.join(GROUPS)}")
    ap.add_argument("--m", default="16", help="token counts whose tuned configs are built (default 16)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    groups = [g for g in args.cases.split(",") if g]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        ap.error(f"unknown case group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled; unset it")
    import triton

    print(f"sm_90 builds with Triton {triton.__version__} ({os.path.dirname(triton.__file__)})")
    print(f"{'case':<34}" + "".join(f"{c:>9}" for c in _COLUMNS))
    rows = run(groups, [int(m) for m in args.m.split(",") if m])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "shape": SHAPE, "device_configs": DEVICE, "rows": rows}, f,
                      indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
