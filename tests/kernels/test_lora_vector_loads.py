"""The LoRA kernels read each adapter's factors through an address in a LoRATable; built for sm_90 (no GPU needed:
Triton's NVIDIA backend makes PTX on the CPU, in a child process since this session's kernels are interpreted),
they must still load the factors with 16-byte vector loads (``cp.async`` into shared memory for A, ``ld.global.v4``
for B), as they did from stacked buffers: the factors' alignment reaches the compiler (``tl.multiple_of`` on the
loaded address) and B is stored rank-major. Launches specialise integer arguments divisible by 16; the build marks
the same arguments (the model dims and strides of real shapes)."""
from tests.kernels.sm90_build import build_in_child

BUILD = r'''
import json, re, triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels.launch import jit_function
from loraplex.kernels import fused_moe_lora as fl, lora_expand as ex, lora_shrink as sh, lora_shrink_expand as se

DIV16 = ("K", "N", "R", "capacity", "num_blocks", "W0", "W1", "W2", "OFF1", "OFF2")

def ptx(kernel, consts, fp32):
    sig = {n: "constexpr" if n in consts else ("*fp32" if n in fp32 else "*i64" if n == "entries_ptr" else "*bf16"
                                               if n in ("x_ptr", "y_ptr") else "*i32") if n.endswith("_ptr")
           else "i32" for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n not in consts and (n.endswith("_ptr") or n.startswith("stride") or n in DIV16)}
    src = ASTSource(fn=jit_function(kernel), signature=sig, attrs=attrs,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

W = dict(W_DTYPE=tl.bfloat16)
CASES = {
    "lora_shrink": (sh._lora_shrink_kernel, dict(W, BLOCK_M=16, BLOCK_R=32, BLOCK_K=64, SPLIT_K=4, EVEN_K=True,
                                                 BLOCK_L=8, NUM_S=1, S_TILE=0), {"buf_ptr", "scaling_ptr"}),
    "lora_shrink fused slices": (sh._lora_shrink_kernel, dict(W, BLOCK_M=64, BLOCK_R=32, BLOCK_K=64, SPLIT_K=4,
                                                              EVEN_K=True, BLOCK_L=8, NUM_S=3, S_TILE=4),
                                 {"buf_ptr", "scaling_ptr"}),
    "lora_expand": (ex._lora_expand_kernel, dict(W, BLOCK_M=16, BLOCK_N=64, BLOCK_R=32, GROUP_M=1, NUM_N=4,
                                                 BLOCK_L=8, USE_PDL=False), {"buf_ptr"}),
    "lora_shrink_expand": (se._lora_shrink_expand_kernel, dict(W, BLOCK_M=16, BLOCK_N=64, BLOCK_R=32, BLOCK_K=64,
                                                               NUM_N=4, EVEN_K=True, BLOCK_L=8), {"scaling_ptr"}),
    "moe_lora_shrink": (fl._moe_lora_shrink_kernel, dict(W, ROW_DIV=4, BLOCK_M=16, BLOCK_R=32, BLOCK_K=64,
                                                         SPLIT_K=2, EVEN_K=True, BLOCK_L=8, PARTIALS=True,
                                                         USE_PDL=False), {"buf_ptr", "scaling_ptr"}),
    "moe_lora_expand": (fl._moe_lora_expand_kernel, dict(W, HAS_WEIGHTS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_R=32,
                                                         GROUP_M=1, NUM_G=2, COLS=2, BLOCK_L=8, NUM_PARTS=2,
                                                         USE_PDL=False),
                        {"buf_ptr", "weights_ptr"}),
    "moe_lora_fused": (fl._moe_lora_fused_kernel, dict(W, ROW_DIV=4, HAS_WEIGHTS=True, BLOCK_M=16, BLOCK_N=64,
                                                       BLOCK_R=32, BLOCK_K=64, EVEN_K=True, GROUP_M=1, NUM_N=4,
                                                       BLOCK_L=8, USE_PDL=False), {"scaling_ptr", "weights_ptr"}),
}
out = {}
for name, (kernel, consts, fp32) in CASES.items():
    p = ptx(kernel, consts, fp32)
    out[name] = {"cp_async": len(re.findall(r"cp\.async\.cg\.shared\.global", p)),
                 "v4": len(re.findall(r"ld\.global[\w.]*\.v4", p)), "b16": len(re.findall(r"ld\.global[\w.]*\.b16\b", p))}
print("RESULT " + json.dumps(out))
'''


def test_table_kernels_load_factors_with_vector_loads():
    counts = build_in_child(BUILD, timeout=300)
    for name, c in counts.items():
        assert c["b16"] == 0, (name, c)  # no element-by-element load of a bf16 operand
    for name in ("lora_shrink", "lora_shrink fused slices", "lora_shrink_expand", "moe_lora_shrink",
                 "moe_lora_fused"):  # A: into shared
        assert counts[name]["cp_async"] > 0, (name, counts[name])
    for name in ("lora_expand", "lora_shrink_expand", "moe_lora_expand", "moe_lora_fused"):  # B tiles (and y)
        assert counts[name]["v4"] > 0, (name, counts[name])
