"""moe_experts_lora with the expert-LoRA expands in the base GEMM epilogues (``moe_lora_epilogue``) against its
torch reference and against the other composition (separate expand kernels)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraplex.kernels import fused_moe, fused_moe_lora, moe_lora_epilogue
from loraplex.kernels import reference
from loraplex.kernels import reference_lora as ref
from loraplex.kernels.moe_align import moe_align
from loraplex.kernels.moe_experts_lora import moe_experts_lora
from tests.kernels.lora_inputs import padded_rank_mask, token_adapters

E, H, INTER, L, R = 8, 40, 24, 4, 32  # H, I not multiples of BLOCK_K / BLOCK_N; ranks 8 / 16 / 32 / 8 padded to 32
BASE_CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
LORA_CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 2, "GROUP_M": 1, "num_warps": 4,
            "num_stages": 1}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _epilogue_on(monkeypatch):
    monkeypatch.setenv(moe_lora_epilogue.EPILOGUE_ENV, "1")


@pytest.fixture
def no_expand_kernels(monkeypatch):
    """Fails a test in which the other composition's LoRA kernels or its activation kernel run."""
    from loraplex.kernels import moe_experts_lora as mel

    def refuse(*args, **kwargs):
        raise AssertionError("the separate-expand composition ran")

    for name in ("fused_moe_lora", "silu_and_mul", "swiglu_clamp_and_mul"):
        monkeypatch.setattr(mel if name != "fused_moe_lora" else mel.fml, name, refuse)


def _expert_lora(k, n, dtype=torch.float32):
    mask = padded_rank_mask(L, R)
    lora_a = torch.randn(L, E, R, k) * mask[:, None, :, None] / k ** 0.5
    lora_b = torch.randn(L, E, n, R) * mask[:, None, None, :] / R ** 0.5
    return lora_a.to(dtype), lora_b.to(dtype)


def _inputs(num_tokens, top_k=2, with_bias=True, int8=False, dtype=torch.float32):
    """(x, w13, w2, topk_weights, topk_ids, kwargs with biases / INT8 scales, both LoRA pairs)."""
    x = torch.randn(num_tokens, H).to(dtype)
    w13 = (torch.randn(E, 2 * INTER, H) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, INTER) / INTER ** 0.5).to(dtype)
    scores = torch.rand(num_tokens, E)
    scores[:, 1] = scores[:, 5] = -1  # experts 1 and 5 receive no token
    weights, ids = torch.topk(scores.softmax(-1), top_k, dim=-1)
    kw = dict(b13=torch.randn(E, 2 * INTER).to(dtype) if with_bias else None,
              b2=torch.randn(E, H).to(dtype) if with_bias else None)
    if int8:
        w13, kw["w13_scale"] = ref.quantize_int8_per_channel(w13)
        w2, kw["w2_scale"] = ref.quantize_int8_per_channel(w2)
    lora = dict(w13_lora=_expert_lora(H, 2 * INTER, dtype), w2_lora=_expert_lora(INTER, H, dtype))
    return x, w13, w2, weights, ids, kw, lora


def _op(*args, lora_cfg=LORA_CFG, **kw):
    return moe_experts_lora(*args, config=BASE_CFG, lora_config_override=lora_cfg, **kw)


@pytest.mark.usefixtures("no_expand_kernels")
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("activation,with_bias,int8", [("silu", False, False), ("swiglu_clamp", True, False),
                                                       ("swiglu_clamp", True, True)], ids=["silu", "swiglu", "int8"])
def test_matches_reference(num_tokens, top_k, activation, with_bias, int8):
    x, w13, w2, weights, ids, kw, lora = _inputs(num_tokens, top_k, with_bias, int8)
    idx = token_adapters(num_tokens, L)
    scaling = torch.rand(L) + 0.5
    got = _op(x, w13, w2, weights, ids, idx, scaling, activation=activation, alpha=1.702, limit=7.0, **lora, **kw)
    want = ref.moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, activation=activation, **lora, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # tokens without an adapter get the base result; the others a delta that is not small
    base = ref.moe_experts_lora(x, w13, w2, weights, ids, None, scaling, activation=activation, **kw)
    no_lora = idx < 0
    torch.testing.assert_close(got[no_lora], base[no_lora], rtol=1e-4, atol=1e-4)
    if (~no_lora).any():
        assert (got[~no_lora] - base[~no_lora]).abs().max() > 0.05


@pytest.mark.parametrize("activation,with_bias", [("silu", True), ("swiglu_clamp", False)])
@pytest.mark.parametrize("lora_cfg", [
    LORA_CFG,
    {**LORA_CFG, "SPLIT_K": 1, "FUSED": 1, "PDL": 1},  # FUSED does not apply; PDL off under the interpreter
    {**LORA_CFG, "SPLIT_K": 3, "BLOCK_M": 32},  # K=40 / 24: the last split's K range partly empty
], ids=["split2", "nosplit", "split3_bm32"])
def test_agrees_with_the_separate_expand_composition(monkeypatch, activation, with_bias, lora_cfg):
    x, w13, w2, weights, ids, kw, lora = _inputs(19, 4, with_bias)
    idx = token_adapters(19, L)
    scaling = torch.rand(L) + 0.5
    args = (x, w13, w2, weights, ids, idx, scaling)
    got = _op(*args, activation=activation, lora_cfg=lora_cfg, **lora, **kw)
    monkeypatch.setenv(moe_lora_epilogue.EPILOGUE_ENV, "0")
    other = _op(*args, activation=activation, lora_cfg=lora_cfg, **lora, **kw)
    torch.testing.assert_close(got, other, rtol=1e-5, atol=1e-5)
    want = ref.moe_experts_lora(*args, activation=activation, **lora, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_split_k_atomics_buffer(monkeypatch):
    """Past PARTIALS_MAX_ROWS the shrink adds its splits into one zeroed buffer (one part in the epilogue)."""
    monkeypatch.setattr(fused_moe_lora, "PARTIALS_MAX_ROWS", 0)
    x, w13, w2, weights, ids, kw, lora = _inputs(11, 2)
    idx = token_adapters(11, L)
    scaling = torch.rand(L) + 0.5
    got = _op(x, w13, w2, weights, ids, idx, scaling, activation="swiglu_clamp", **lora, **kw)
    want = ref.moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, activation="swiglu_clamp", **lora, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("no_expand_kernels")
@pytest.mark.parametrize("target", ["gate_up", "down"])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_one_target_only(target, int8):
    x, w13, w2, weights, ids, kw, lora = _inputs(9, 4, True, int8)
    lora = {k: v for k, v in lora.items() if k == ("w13_lora" if target == "gate_up" else "w2_lora")}
    idx = token_adapters(9, L)
    scaling = torch.rand(L) + 0.5
    got = _op(x, w13, w2, weights, ids, idx, scaling, activation="swiglu_clamp", **lora, **kw)
    want = ref.moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, activation="swiglu_clamp", **lora, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("no_expand_kernels")
def test_always_on_state_zero_slots_and_no_adapter_tokens():
    """LoRAState.always_on: slot buffers of zeros, every token at -1, and the path still runs (no B loaded)."""
    x, w13, w2, weights, ids, kw, _ = _inputs(7, 2)
    zeros = dict(w13_lora=(torch.zeros(L, E, R, H), torch.zeros(L, E, 2 * INTER, R)),
                 w2_lora=(torch.zeros(L, E, R, INTER), torch.zeros(L, E, H, R)))
    idx = torch.full((7,), -1, dtype=torch.int32)
    got = _op(x, w13, w2, weights, ids, idx, torch.ones(L), activation="swiglu_clamp", **zeros, **kw)
    want = reference.fused_moe(x, w13, w2, weights, ids, activation="swiglu_clamp", **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("no_expand_kernels")
def test_every_token_in_one_slot():
    x, w13, w2, weights, ids, kw, lora = _inputs(6, 4, False)
    idx = torch.full((6,), 2, dtype=torch.int32)
    scaling = torch.rand(L) + 0.5
    got = _op(x, w13, w2, weights, ids, idx, scaling, **lora, **kw)
    want = ref.moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, **lora, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_half_precision(monkeypatch):
    """float16 inputs: close to the float32 reference on the same (rounded) values, and to the other composition
    (which rounds the pre-activation and each output once more). The interpreter's bfloat16 dots are wrong even
    for the base fused_moe; bf16 is checked on the GPU (benchmarks/engine/check_moe_lora_gpu.py)."""
    dtype = torch.float16
    x, w13, w2, weights, ids, kw, lora = _inputs(13, 4, True, dtype=dtype)
    idx = token_adapters(13, L)
    scaling = torch.rand(L) + 0.5
    args = (x, w13, w2, weights, ids, idx, scaling)
    got = _op(*args, activation="swiglu_clamp", **lora, **kw)
    assert got.dtype == dtype
    lora32 = {k: tuple(t.float() for t in pair) for k, pair in lora.items()}
    want = ref.moe_experts_lora(x.float(), w13.float(), w2.float(), weights, ids, idx, scaling,
                                activation="swiglu_clamp", **lora32, **{k: v.float() for k, v in kw.items()})
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-2, err
    monkeypatch.setenv(moe_lora_epilogue.EPILOGUE_ENV, "0")
    other = _op(*args, activation="swiglu_clamp", **lora, **kw)
    assert ((got.float() - other.float()).abs().max() / want.abs().max()).item() < 1e-2


def test_selection_by_env_var_and_config_key(monkeypatch):
    calls = []
    original = moe_lora_epilogue.experts_lora_epilogue
    monkeypatch.setattr(moe_lora_epilogue, "experts_lora_epilogue",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    x, w13, w2, weights, ids, kw, lora = _inputs(5, 2)
    args = (x, w13, w2, weights, ids, token_adapters(5, L), torch.rand(L) + 0.5)
    for env, key, taken in (("1", 0, True), ("0", 1, False), ("", 1, True), ("", 0, False), (None, None, False)):
        calls.clear()
        if env is None:
            monkeypatch.delenv(moe_lora_epilogue.EPILOGUE_ENV)
        else:
            monkeypatch.setenv(moe_lora_epilogue.EPILOGUE_ENV, env)
        cfg = LORA_CFG if key is None else {**LORA_CFG, "EPILOGUE": key}
        _op(*args, lora_cfg=cfg, **lora, **kw)
        assert calls == ([1] if taken else []), (env, key)
    # without an adapter map the op is the base fused_moe whatever the flag says
    monkeypatch.setenv(moe_lora_epilogue.EPILOGUE_ENV, "1")
    calls.clear()
    moe_experts_lora(x, w13, w2, weights, ids, None, torch.ones(L), config=BASE_CFG, **lora, **kw)
    assert calls == []


def test_bad_epilogue_input_is_refused():
    x, w13, w2, weights, ids, _, lora = _inputs(3, 2)
    align = moe_align(ids, E, BASE_CFG["BLOCK_M"])
    idx = token_adapters(3, L)
    lora_b = lora["w13_lora"][1]
    for bad in (fused_moe.LoraEpilogue(torch.zeros(1, 5, R), lora_b, idx),  # 5 rows, not T*A = 6
                fused_moe.LoraEpilogue(torch.zeros(1, 6, R), lora["w2_lora"][1], idx),  # down's B
                fused_moe.LoraEpilogue(torch.zeros(1, 6, R), lora_b, idx[:2])):
        with pytest.raises(ValueError, match="LoRA epilogue needs buf"):
            fused_moe.gate_up(x, w13, align, BASE_CFG, top_k=2, activation="silu", lora=bad)
    with pytest.raises(ValueError, match="must be contiguous"):
        _op(x, w13, w2, weights, ids, idx, torch.ones(L),
            w13_lora=(lora["w13_lora"][0].transpose(2, 3).contiguous().transpose(2, 3), lora_b))


BUILD = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels import fused_moe as fm

FP32 = {"scale_ptr", "s_ptr", "weights_ptr"}
I32 = {"sorted_ptr", "expert_ids_ptr", "num_post_ptr", "lora_idx_ptr"}
COMMON = dict(W_INT8=True, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, NUM_N=45, EVEN_K=False)

def ptx(kernel, consts):
    sig = {n: "constexpr" if n in consts else ("*fp32" if n in FP32 else "*i32" if n in I32 else "*bf16")
           if n.endswith("_ptr") else "fp32" if n in ("alpha", "limit") else "i32" for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    # which of the LoRA pointer arguments the code reads
    return [f"param_{kernel.arg_names.index(n)}]" in asm for n in ("lora_idx_ptr", "s_ptr", "lb_ptr")]

out = {}
for name, kernel, extra in (("gate_up", fm._moe_gate_up_kernel, dict(TOP_K=4, ACT=1)),
                            ("down", fm._moe_down_kernel, dict(TOP_K=4))):
    out[name] = [ptx(kernel, {**COMMON, **extra, "HAS_LORA": True, "BLOCK_R": 32, "NUM_PARTS": 4}),
                 ptx(kernel, {**COMMON, **extra, "HAS_LORA": False, "BLOCK_R": 16, "NUM_PARTS": 1})]
print("RESULT " + json.dumps(out))
'''


def test_epilogue_builds_for_sm90_and_is_compiled_out_without_lora():
    """The epilogue (a dot per distinct slot inside a data-dependent loop) compiles for sm_90 (the interpreter
    checks no layouts); without HAS_LORA the kernels never read the LoRA arguments."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", BUILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"sm_90 build failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    for name, (with_lora, without) in json.loads(lines[0][len("RESULT "):]).items():
        assert with_lora == [True, True, True], name
        assert without == [False, False, False], name
