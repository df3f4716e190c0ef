import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels.paged_attention import paged_attention


def _case(ctx_lens, q_lens, *, num_q=4, num_kv=2, d=32, bs=4, dtype=torch.float32):
    """Caches filled with noise, each sequence's blocks scattered (holes, any order) across the pool."""
    max_blocks = max((c + bs - 1) // bs for c in ctx_lens) + 1
    nb = sum((c + bs - 1) // bs for c in ctx_lens) * 2 + 3
    perm = torch.randperm(nb)
    tables = torch.full((len(ctx_lens), max_blocks), nb + 5, dtype=torch.int32)  # garbage past the end
    used = 0
    for b, c in enumerate(ctx_lens):
        n = (c + bs - 1) // bs
        tables[b, :n] = perm[used:used + 2 * n:2].to(torch.int32)  # every other free block: holes
        used += 2 * n
    k_cache = torch.randn(nb, bs, num_kv, d).to(dtype)
    v_cache = torch.randn(nb, bs, num_kv, d).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(qsl[-1]), num_q, d).to(dtype)
    return q, k_cache, v_cache, tables.clamp(max=nb - 1), torch.tensor(ctx_lens, dtype=torch.int32), qsl


CASES = {
    "decode": ([1, 9, 33], [1, 1, 1]),
    "prefill": ([7], [7]),
    "mixed_chunks": ([33, 5, 20], [13, 5, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention_matches_reference(case, window, with_sinks):
    ctx_lens, q_lens = CASES[case]
    q, kc, vc, tables, seq_lens, qsl = _case(ctx_lens, q_lens)
    sinks = torch.randn(q.shape[1]) if with_sinks else None
    kw = dict(sliding_window=window, sinks=sinks)
    got = paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.2, block_q=2, block_n=8, **kw)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.2, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_paged_attention_odd_head_dim_and_default_tiles():
    q, kc, vc, tables, seq_lens, qsl = _case([10, 3], [4, 1], num_q=6, num_kv=2, d=20, bs=8)
    got = paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.3)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_paged_attention_rejects_bad_gqa():
    q, kc, vc, tables, seq_lens, qsl = _case([4], [1], num_q=3, num_kv=2)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.2)


def test_paged_attention_many_sequences_span_search_chunks():
    """More sequences than one search chunk (128): decode rows must still find their own sequence."""
    ctx = [1 + (i % 5) for i in range(150)]
    q, kc, vc, tables, seq_lens, qsl = _case(ctx, [1] * 150, num_q=2, num_kv=1, d=16, bs=4)
    got = paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.25)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---- split-KV decode path (flash-decoding): forced num_splits, awkward sizes, every feature


SPLIT_CASES = {  # (ctx_lens, q_lens, num_q, num_kv, block size)
    "one_seq_ctx1_gqa1": ([1], [1], 2, 2, 4),
    "three_seqs_gqa4_bs4": ([5, 17, 100], [1, 1, 1], 8, 2, 4),
    "seven_seqs_gqa8_bs16": ([33, 1, 100, 5, 17, 64, 2], [1] * 7, 8, 1, 16),
    "padded_rows_seq_len0": ([17, 0, 33, 0], [1, 1, 1, 1], 4, 1, 4),
    "two_rows_per_seq": ([5, 33, 100], [2, 1, 2], 4, 1, 16),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
@pytest.mark.parametrize("num_splits, window, with_sinks", [(1, 7, True), (2, None, False), (2, 20, True),
                                                            (5, 7, True), (5, None, True), (5, 20, False)])
def test_paged_attention_split_kv_matches_reference(case, num_splits, window, with_sinks):
    ctx_lens, q_lens, num_q, num_kv, bs = SPLIT_CASES[case]
    q, kc, vc, tables, seq_lens, qsl = _case(ctx_lens, q_lens, num_q=num_q, num_kv=num_kv, d=16, bs=bs)
    sinks = torch.randn(num_q) if with_sinks else None
    kw = dict(sliding_window=window, sinks=sinks)
    got = paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.3, block_n=8, num_splits=num_splits, **kw)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.3, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    pad = seq_lens == 0
    if pad.any():  # padded rows: zeros, never garbage
        assert torch.equal(got[qsl[:-1][pad].long()], torch.zeros_like(got[qsl[:-1][pad].long()]))


def test_paged_attention_split_kv_default_choice_and_tokens_past_sequences():
    """Decode batches split by default (shapes only); a trailing token owned by no sequence comes out zero."""
    from loraplex.kernels.paged_attention import default_num_splits

    assert default_num_splits(16, 16, 8) == 5 and default_num_splits(1, 1, 8) == 16
    assert default_num_splits(256, 256, 8) == 1 and default_num_splits(64, 3, 8) == 1  # full GPU / prefill
    assert default_num_splits(16, 16, 8, sliding_window=128) == 1  # GPT-OSS window layers: 3 tiles, one pass
    assert default_num_splits(16, 16, 8, sliding_window=1024) == 4
    q, kc, vc, tables, seq_lens, qsl = _case([9, 40, 3], [1, 1, 1], num_q=6, num_kv=2, d=20, bs=8)
    q = torch.cat([q, torch.randn(1, 6, 20)])  # one padding token past query_start_loc[-1]
    got = paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.3)
    want = reference.paged_attention(q[:3], kc, vc, tables, seq_lens, qsl, 0.3)
    torch.testing.assert_close(got[:3], want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[3], torch.zeros_like(got[3]))


def test_paged_attention_split_kv_half_precision():
    """float16 (the interpreter's bfloat16 dot is broken, for the one-pass path alike): fp32 partials, 16-bit out."""
    q, kc, vc, tables, seq_lens, qsl = _case([70, 13], [1, 1], num_q=8, num_kv=2, d=32, bs=16, dtype=torch.float16)
    sinks = torch.randn(8)
    got = paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.2, sinks=sinks, num_splits=3)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.2, sinks=sinks)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_paged_attention_rejects_bad_num_splits():
    q, kc, vc, tables, seq_lens, qsl = _case([4], [1])
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.2, num_splits=0)


BUILD_SM90 = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels.launch import jit_function
from loraplex.kernels import paged_attention as pa

def ptx(kernel, consts, ptrs):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "*fp32") if n.endswith("_ptr") else
           "fp32" if n == "scale_log2" else "i32" for n in kernel.arg_names}
    src = ASTSource(fn=jit_function(kernel), signature=sig, constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]

bf16 = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
ints = {n: "*i32" for n in ("bt_ptr", "seq_lens_ptr", "qsl_ptr")}
base = dict(HEAD_DIM=64, BLOCK_D=64, GROUP=8, BLOCK_Q=2, BLOCK_M=16, BLOCK_N=64, KV_BLOCK_SIZE=16, SEARCH_BLOCK=128)
out = {}
for split in (False, True):
    for window in (False, True):
        out[f"main split={split} window={window}"] = len(ptx(pa._paged_attention_kernel, {
            **base, "USE_WINDOW": window, "SINK_IN_LOOP": not split, "SPLIT": split}, {**bf16, **ints}))
for sinks in (False, True):
    out[f"merge sinks={sinks}"] = len(ptx(pa._merge_splits_kernel, dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_S=16,
                                                                        USE_SINKS=sinks), {"out_ptr": "*bf16",
                                                                                           "qsl_ptr": "*i32"}))
print("RESULT " + json.dumps(out))
'''


def test_paged_attention_kernels_build_for_sm90():
    """The interpreter forgives what the GPU compiler does not (loop-carried types, constexpr branches): build both
    paths and the merge for sm_90 (bf16, GPT-OSS tiles) on the CPU, in a child process without the interpreter."""
    from tests.kernels.sm90_build import build_in_child

    sizes = build_in_child(BUILD_SM90, timeout=300)
    assert len(sizes) == 6 and all(n > 1000 for n in sizes.values()), sizes


@pytest.mark.parametrize("tokens,decode", [(1, True), (7, True), (1, False), (9, False), (17, False)])
@pytest.mark.parametrize("window", [None, 6])
def test_eager_warmup_dummy_steps_run_the_triton_kernels(tokens, decode, window):
    """The start-up warm-up's dummy steps (engine/eager_warmup.py: slot -1, every table entry block 0, zeroed;
    prefill-like sequences of at most max_model_len tokens or decode rows) through the Triton reshape_and_cache and
    paged attention: nothing is written to the cache and the output matches the reference (zeros read, sinks
    applied), with default tiles and key splits, so the kernels compile for that shape without faulting."""
    from loraplex.engine.eager_warmup import Shape, dummy_inputs
    from loraplex.kernels.reshape_and_cache import reshape_and_cache

    _, positions, attn = dummy_inputs(Shape(tokens, decode), block_size=4, max_model_len=8, device="cpu")
    assert attn.query_start_loc[-1] == tokens == positions.shape[0] and int(attn.seq_lens.max()) <= 8
    k_cache, v_cache = torch.randn(6, 4, 2, 32), torch.randn(6, 4, 2, 32)
    k_cache[0] = v_cache[0] = 0
    before = (k_cache.clone(), v_cache.clone())
    reshape_and_cache(torch.randn(tokens, 2, 32), torch.randn(tokens, 2, 32), k_cache, v_cache, attn.slot_mapping)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    q, sinks = torch.randn(tokens, 4, 32), torch.randn(4)
    args = (q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, 0.2)
    got = paged_attention(*args, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got, reference.paged_attention(*args, sliding_window=window, sinks=sinks),
                               rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got).all()
