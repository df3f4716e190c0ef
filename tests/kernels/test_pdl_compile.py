"""The PDL variants compile for sm_90 and carry the grid-dependency instructions; without PDL the same kernels
carry none. No GPU needed: Triton's NVIDIA backend builds PTX on the CPU (in a child process, since this
session's kernels are interpreted). On the CPU and under the interpreter the launchers never ask for PDL
(``pdl_enabled``), so this is where its code is built before a GPU run."""

import torch

from loraplex.kernels.slot_blocks import pdl_enabled
from tests.kernels.sm90_build import build_in_child

BUILD = r'''
import json, triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels.launch import jit_function
from loraplex.kernels import fused_moe_lora as fl, lora_expand as ex

FP32, BF16, I64 = {"buf_ptr", "weights_ptr", "scaling_ptr"}, {"x_ptr", "y_ptr"}, {"entries_ptr"}
W = tl.bfloat16  # the LoRA factors' dtype (read through the LoRATable's addresses)
CASES = {
    "moe_lora_shrink": (fl._moe_lora_shrink_kernel, dict(ROW_DIV=4, W_DTYPE=W, BLOCK_M=16, BLOCK_R=32, BLOCK_K=64,
                                                       SPLIT_K=2, EVEN_K=True, BLOCK_L=8, PARTIALS=True)),
    "moe_lora_expand": (fl._moe_lora_expand_kernel, dict(W_DTYPE=W, HAS_WEIGHTS=True, BLOCK_M=16, BLOCK_N=64,
                                                       BLOCK_R=32, GROUP_M=1, NUM_G=2, COLS=2, BLOCK_L=8,
                                                       NUM_PARTS=2)),
    "moe_lora_fused": (fl._moe_lora_fused_kernel, dict(W_DTYPE=W, ROW_DIV=4, HAS_WEIGHTS=False, BLOCK_M=16,
                                                     BLOCK_N=64, BLOCK_R=32, BLOCK_K=64, EVEN_K=False, GROUP_M=1,
                                                     NUM_N=4, BLOCK_L=8)),
    "lora_expand": (ex._lora_expand_kernel, dict(W_DTYPE=W, BLOCK_M=16, BLOCK_N=64, BLOCK_R=32, GROUP_M=1, NUM_N=4,
                                                 BLOCK_L=8)),
}

def ptx(kernel, consts):
    sig = {n: "constexpr" if n in consts else ("*fp32" if n in FP32 else "*bf16" if n in BF16 else
                                               "*i64" if n in I64 else "*i32")
           if n.endswith("_ptr") or n in consts else "i32" for n in kernel.arg_names}
    src = ASTSource(fn=jit_function(kernel), signature=sig, constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

out = {}
for name, (kernel, consts) in CASES.items():
    on, off = ptx(kernel, {**consts, "USE_PDL": True}), ptx(kernel, {**consts, "USE_PDL": False})
    out[name] = [on.count("griddepcontrol.wait"), on.count("griddepcontrol.launch_dependents"),
                 off.count("griddepcontrol")]
print("RESULT " + json.dumps(out))
'''


def test_pdl_kernels_build_for_sm90_with_grid_dependency_control():
    counts = build_in_child(BUILD, timeout=300)
    assert set(counts) == {"moe_lora_shrink", "moe_lora_expand", "moe_lora_fused", "lora_expand"}
    for name, (waits, triggers, without) in counts.items():
        assert waits >= 1 and triggers >= 1, (name, counts[name])
        assert without == 0, (name, counts[name])


def test_pdl_is_off_on_cpu_and_under_the_interpreter():
    assert not pdl_enabled(torch.device("cpu"))
