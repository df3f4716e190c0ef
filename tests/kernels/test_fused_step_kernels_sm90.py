"""The interpreter forgives what the GPU compiler does not (constexprs passed down to jit helpers, scalar branches
on program ids, loop-carried types): the fused rope + KV-cache write and the paired MoE alignment built for sm_90
on the CPU (and the plain rope, which shares its rotation), in a child process without the interpreter, at
GPT-OSS-20B's tiles."""
from __future__ import annotations

from tests.kernels.sm90_build import build_in_child

BUILD = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels.launch import jit_function
from loraplex.kernels import moe_align, rotary

def ptx(kernel, consts, types):
    names = jit_function(kernel).arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    constexprs = {(names.index(n),): v for n, v in consts.items()}
    src = ASTSource(fn=jit_function(kernel), signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]

out = {}
ints = {n: "*i32" for n in ("lora_ptr", "sorted_ptr", "expert_ids_ptr", "num_post_ptr", "counts_ptr", "offsets_ptr",
                            "lora_sorted_ptr", "lora_expert_ids_ptr", "lora_num_post_ptr", "lora_counts_ptr",
                            "lora_offsets_ptr")}
for bs, lbs in ((64, 16), (16, 16)):
    out[f"moe_align_pair {bs}/{lbs}"] = len(ptx(moe_align._moe_align_pair_kernel, dict(
        TOP_K=4, BLOCK_SIZE=bs, PAD_BLOCK=bs, LORA_BLOCK_SIZE=lbs, LORA_PAD_BLOCK=lbs, BLOCK_E=64, BLOCK=1024),
        {"ids_ptr": "*i64", **ints}))
out["moe_align"] = len(ptx(moe_align._moe_align_kernel, dict(TOP_K=4, HAS_LORA=True, BLOCK_SIZE=16, PAD_BLOCK=16,
                                                            BLOCK_E=64, BLOCK=1024), {"ids_ptr": "*i64", **ints}))
bf16 = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "kc_ptr", "vc_ptr")}
out["rotary_cache"] = len(ptx(rotary._rotary_cache_kernel, dict(ROW=512, HEAD_DIM=64, BLOCK_H=16, BLOCK_HALF=32,
                                                                 BLOCK_ROW=512),
                              {"pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i32", **bf16}))
out["rotary"] = len(ptx(rotary._rotary_kernel, dict(BLOCK_H=16, BLOCK_HALF=32),
                       {"pos_ptr": "*i64", "cs_ptr": "*fp32", "q_ptr": "*bf16", "k_ptr": "*bf16", "q_out_ptr": "*bf16",
                        "k_out_ptr": "*bf16"}))
print("RESULT " + json.dumps(out))
'''


def test_fused_step_kernels_build_for_sm90():
    sizes = build_in_child(BUILD, timeout=300)
    assert len(sizes) == 5 and all(n > 1000 for n in sizes.values()), sizes
