"""Integer arguments that change from one serving step to the next are never specialised: Triton compiles a new
variant for an integer that is 1 or divisible by 16 where the last one was not, so a block table width, a batch
size or a step's slot count would compile mid-serving (a stall of every running request). Each such argument is
in its kernel's ``do_not_specialize``; the constexprs that vary by step are compiled at start
(``engine/eager_warmup.py``)."""
from __future__ import annotations

import pytest

from loraplex.kernels import fused_moe, fused_moe_lora, fused_moe_mxfp4, lora_expand, lora_shrink, lora_shrink_expand
from loraplex.kernels import moe_align, paged_attention

STEP_VARYING = [
    (paged_attention._paged_attention_kernel, ["num_seqs", "num_splits", "window", "stride_bt"]),  # bt: table width
    (paged_attention._merge_splits_kernel, ["num_seqs", "num_splits"]),
    (lora_shrink._lora_shrink_kernel, ["L"]),
    (lora_shrink._lora_shrink_compact_kernel, ["L"]),
    (lora_expand._lora_expand_kernel, ["num_flat", "L"]),
    (lora_expand._lora_expand_compact_kernel, ["L"]),
    (lora_shrink_expand._lora_shrink_expand_kernel, ["L"]),
    (fused_moe_lora._moe_lora_shrink_kernel, ["num_pairs", "capacity", "num_blocks", "L"]),
    (fused_moe_lora._moe_lora_expand_kernel, ["num_pairs", "capacity", "num_blocks", "num_flat", "L"]),
    (fused_moe_lora._moe_lora_fused_kernel, ["num_pairs", "capacity", "num_blocks", "num_flat", "L"]),
    (moe_align._moe_align_kernel, ["num_pairs", "capacity", "num_blocks"]),
    (fused_moe._moe_gate_up_kernel, ["num_pairs", "num_m"]),
    (fused_moe._moe_down_kernel, ["num_pairs", "num_m"]),
    (fused_moe_mxfp4._gate_up_kernel, ["num_pairs", "num_m"]),
    (fused_moe_mxfp4._down_kernel, ["num_pairs", "num_m"]),
]


def _names(kernel) -> list[str]:
    """Argument names (a JITFunction, or the InterpretedFunction of TRITON_INTERPRET=1)."""
    params = getattr(kernel, "params", None)
    return [p.name for p in params] if params is not None else list(kernel.arg_names)


def _unspecialised(kernel) -> set[str]:
    dns = kernel.do_not_specialize if hasattr(kernel, "do_not_specialize") else \
        kernel.kwargs.get("do_not_specialize") or []
    names = _names(kernel)
    return {names[i] if isinstance(i, int) else i for i in dns}


@pytest.mark.parametrize("kernel,args", STEP_VARYING, ids=[f"{k.fn.__module__.rsplit('.', 1)[-1]}.{k.fn.__name__}" for k, _ in STEP_VARYING])
def test_step_varying_integers_are_not_specialised(kernel, args):
    names = set(_names(kernel))
    assert set(args) <= names, f"{kernel.fn.__name__} has no argument {set(args) - names}"
    missing = set(args) - _unspecialised(kernel)
    assert not missing, f"{kernel.fn.__name__} specialises {missing}: a new value class would compile mid-serving"
