"""Expert LoRA (fused_moe_lora) in Triton under the interpreter against the reference: adapters of ranks 8 / 16 / 32
in one batch, each read at its own rank through a LoRATable, an empty slot, tokens without an adapter, experts
without tokens; the stacked padded layout as input."""
import pytest
import torch

from loraplex.kernels import fused_moe_lora as fml
from loraplex.kernels import reference_lora as ref
from loraplex.kernels.fused_moe_lora import fused_moe_lora
from loraplex.kernels.lora_table import LoRATable
from tests.kernels.lora_inputs import expert_table, padded_rank_mask, token_adapters
from tests.utils.tuning_files import committed_configs, config_id

L, E, A, R = 4, 6, 2, 32  # slot 3 holds no weights
CONFIGS = [
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 1, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2, "GROUP_M": 1, "num_warps": 4, "num_stages": 1},
    # one kernel (shrink recomputed per column block); PDL asked for but off under the interpreter
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 1, "GROUP_M": 1, "num_warps": 4, "num_stages": 1,
     "FUSED": 1, "PDL": 1},
    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 4, "GROUP_M": 3, "num_warps": 4, "num_stages": 1,
     "FUSED": 1},  # SPLIT_K ignored by the fused kernel; grouped column order
    # expand programs over several column blocks: 3 of 16 leave a group with columns past N (N = 48, 40)
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 2, "GROUP_M": 1, "num_warps": 4, "num_stages": 1,
     "COLS": 3},
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 1, "GROUP_M": 2, "num_warps": 4, "num_stages": 1,
     "COLS": 2, "PDL": 1},
]


def _expert_lora(k, n):
    """(table, None, scaling): ranks 8 / 16 / 32 at their own size, slot 3 empty (the lora_b argument is None)."""
    return expert_table(L, E, k, n, empty=(3,)), None, torch.rand(L) + 0.5


def _stacked(k, n):
    mask = padded_rank_mask(L, R)  # ranks 8 / 16 / 32 padded to 32
    lora_a = torch.randn(L, E, R, k) * mask[:, None, :, None] / k ** 0.5
    lora_b = torch.randn(L, E, n, R) * mask[:, None, None, :]
    return lora_a, lora_b, torch.rand(L) + 0.5


def _routing(num_tokens):
    scores = torch.rand(num_tokens, E)
    scores[:, 0] = -1  # expert 0 receives no token
    weights, ids = torch.topk(scores.softmax(-1), A, dim=-1)
    return weights, ids


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("target", ["gate_up", "down"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "split_k", "fused_pdl", "fused_grouped", "cols3", "cols2"])
def test_fused_moe_lora_matches_reference(num_tokens, target, cfg):
    k, n = (40, 48) if target == "gate_up" else (24, 40)  # K not a multiple of BLOCK_K
    lora_a, lora_b, scaling = _expert_lora(k, n)
    weights, ids = _routing(num_tokens)
    idx = token_adapters(num_tokens, L)
    x = torch.randn(num_tokens if target == "gate_up" else num_tokens * A, k)
    y = torch.randn(num_tokens * A, n)
    want = y.clone()
    topk_weights = weights if target == "down" else None
    fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, topk_weights, config=cfg)
    ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling, topk_weights)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    untouched = torch.where((idx < 0) | (idx == 3))[0]  # no adapter, or the empty slot
    rows = torch.cat([untouched * A + a for a in range(A)])
    assert torch.equal(y[rows], want[rows])  # ... keep the base output


@pytest.mark.parametrize("partials_max_rows", [0, 1 << 20], ids=["atomics", "partials"])
def test_split_k_partials_and_atomics_agree_with_reference(monkeypatch, partials_max_rows):
    """Split-K either writes one partial buffer per split (expand sums them) or, past PARTIALS_MAX_ROWS pairs x
    splits, adds into one zeroed buffer with atomics; both give the reference. SPLIT_K=3 with K=40: the last
    split's K range is partly empty."""
    from loraplex.kernels import fused_moe_lora as fl

    monkeypatch.setattr(fl, "PARTIALS_MAX_ROWS", partials_max_rows)
    lora_a, lora_b, scaling = _expert_lora(40, 48)
    weights, ids = _routing(33)
    idx = token_adapters(33, L)
    x, y = torch.randn(33 * A, 40), torch.randn(33 * A, 48)
    want = y.clone()
    cfg = {**CONFIGS[1], "SPLIT_K": 3}
    fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, weights, config=cfg)
    ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling, weights)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_fused_moe_lora_rejects_bad_output():
    lora_a, lora_b, scaling = _expert_lora(16, 16)
    weights, ids = _routing(3)
    with pytest.raises(ValueError, match="y must be \\[T\\*A=6, N\\]"):
        fused_moe_lora(torch.randn(3, 16), torch.randn(3, 16), lora_a, lora_b, ids, token_adapters(3, L), scaling)
    with pytest.raises(ValueError, match="pass lora_b=None"):
        fused_moe_lora(torch.randn(6, 16), torch.randn(3, 16), lora_a, torch.zeros(1), ids, token_adapters(3, L),
                       scaling)


def test_stacked_padded_layout_equals_the_adapters_at_their_own_ranks():
    """Stacked [L, E, R, K] / [L, E, N, R] (zero-padded to R) give the same result as a table holding each slot's
    leading r rank rows only, in the kernel and in the reference."""
    lora_a, lora_b, scaling = _stacked(40, 48)
    ranks = (8, 16, 32, 8)
    own = LoRATable.from_factors([[(lora_a[l, :, :ranks[l]].contiguous(), lora_b[l, :, :, :ranks[l]].contiguous())]
                                  for l in range(L)], in_features=40, out_features=(48,), max_rank=R, num_experts=E)
    weights, ids = _routing(11)
    idx = token_adapters(11, L)
    x, y = torch.randn(11, 40), torch.randn(11 * A, 48)
    got_stacked, got_own, want = y.clone(), y.clone(), y.clone()
    fused_moe_lora(got_stacked, x, lora_a, lora_b, ids, idx, scaling, config=CONFIGS[0])
    fused_moe_lora(got_own, x, own, None, ids, idx, scaling, config=CONFIGS[1])
    ref.fused_moe_lora(want, x, own, None, ids, idx, scaling)
    torch.testing.assert_close(got_stacked, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_own, want, rtol=1e-4, atol=1e-4)


def test_fused_moe_lora_reuses_alignment_and_rejects_mismatched_block():
    from loraplex.kernels.moe_align import moe_align_lora

    lora_a, lora_b, scaling = _expert_lora(16, 16)
    weights, ids = _routing(5)
    idx = token_adapters(5, L)
    x, y = torch.randn(5, 16), torch.randn(10, 16)
    want = y.clone()
    cfg = CONFIGS[0]
    fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, config=cfg, align=moe_align_lora(ids, idx, E, L, 16))
    ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="made with block size 32 but the config's BLOCK_M is 16"):
        fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, config=cfg, align=moe_align_lora(ids, idx, E, L, 32))


def test_fused_variant_reuses_alignment_and_gives_the_two_kernel_result():
    """FUSED=1 with a shared alignment (gate_up then down, as the engine runs them) equals the reference, and
    the two-kernel path on the same inputs (same fp32 h rounded to the weights' dtype before expand)."""
    from loraplex.kernels.moe_align import moe_align_lora

    weights, ids = _routing(9)
    idx = token_adapters(9, L)
    align = moe_align_lora(ids, idx, E, L, 16)
    for k, n, rows, tw in ((40, 48, 9, None), (24, 40, 9 * A, weights)):
        lora_a, lora_b, scaling = _expert_lora(k, n)
        x, y = torch.randn(rows, k), torch.randn(9 * A, n)
        want, two = y.clone(), y.clone()
        fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, tw, config={**CONFIGS[2], "PDL": 0}, align=align)
        fused_moe_lora(two, x, lora_a, lora_b, ids, idx, scaling, tw, config=CONFIGS[0], align=align)
        ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling, tw)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y, two, rtol=1e-5, atol=1e-5)


def test_plan_follows_config_and_pdl_is_off_without_a_hopper_gpu():
    """The launch plan takes FUSED and PDL from the config (absent in older tuning files: two plain launches), PDL
    only where the device has it; a config changed in place gets its own plan."""
    from loraplex.kernels.fused_moe_lora import DEFAULT_CONFIG, _plan
    from loraplex.kernels.slot_blocks import pdl_enabled

    shape = dict(num_tokens=9, top_k=A, x_rows=9, num_loras=L, num_experts=E, rank=R, k=40, n=48, num_blocks=12,
                 dtype=torch.float32, has_weights=False, pdl_ok=pdl_enabled(torch.device("cpu")))

    def flags(cfg):
        plan = _plan(cfg, **shape)
        return plan.fused, plan.expand_kw["USE_PDL"], plan.shrink_kw["USE_PDL"]

    legacy = {k: v for k, v in DEFAULT_CONFIG.items() if k not in ("FUSED", "PDL")}
    assert flags(DEFAULT_CONFIG) == flags(legacy) == (False, False, False)  # default: two plain launches
    cfg = {**DEFAULT_CONFIG, "FUSED": 1, "PDL": 1}
    assert flags(cfg) == (True, False, False)  # PDL needs sm_90 and no interpreter
    assert _plan(cfg, **{**shape, "pdl_ok": True}).fused_kw["USE_PDL"]
    cfg["FUSED"] = 0
    assert flags(cfg) == (False, False, False)


def test_tuned_file_picks_the_fused_kernel_per_m(tmp_path, monkeypatch):
    """A tuning file with FUSED=1 at M=1 and 0 at M=64 launches the one-kernel path for M=1..32 and the
    shrink + expand pair above (nearest M), without a config argument."""
    from loraplex.kernels import fused_moe_lora as fl
    from loraplex.kernels import tuning

    k, n = 40, 48
    lora_a, lora_b, scaling = _expert_lora(k, n)
    base = {key: v for key, v in CONFIGS[0].items() if key not in ("FUSED", "PDL")}
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path))
    tuning.clear_cache()
    launched = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("_moe_lora_fused_kernel", "_moe_lora_shrink_kernel", "_moe_lora_expand_kernel"):
        monkeypatch.setattr(fl, name, Spy(name, getattr(fl, name)))
    try:
        for m in (1, 7, 33):
            weights, ids = _routing(m)
            x, y = torch.randn(m, k), torch.randn(m * A, n)
            shape = fl.shape_of(y, x, lora_a, ids)
            tuning.write_configs("fused_moe_lora", {tuning.shape_key(shape): {1: {**base, "FUSED": 1},
                                                                              64: {**base, "FUSED": 0}}},
                                 device_name=tuning.current_device_name())
            idx = token_adapters(m, L)
            want = y.clone()
            launched.clear()
            fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling)
            ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling)
            torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
            expect = ["_moe_lora_fused_kernel"] if m <= 32 else ["_moe_lora_shrink_kernel", "_moe_lora_expand_kernel"]
            assert launched == expect, (m, launched)
    finally:
        tuning.clear_cache()


@pytest.mark.parametrize("cfg", committed_configs("fused_moe_lora"), ids=config_id)
def test_committed_tuned_configs_match_the_reference(cfg):
    """Each config a device's tuning file holds (tiles up to 256 wide, split-K up to 16, column groups, the one-kernel
    path) gives the reference at an awkward small shape, both targets (K and N not multiples of the tiles)."""
    weights, ids = _routing(19)
    idx = token_adapters(19, L)
    for target, k, n in (("gate_up", 40, 48), ("down", 24, 40)):
        lora_a, lora_b, scaling = _expert_lora(k, n)
        x = torch.randn(19 if target == "gate_up" else 19 * A, k)
        y = torch.randn(19 * A, n)
        want = y.clone()
        topk_weights = weights if target == "down" else None
        fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, topk_weights, config=dict(cfg))
        ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling, topk_weights)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_moe_lora_expand_after_shrink_equals_fused_moe_lora():
    """shrink then expand, called apart with the same config and alignment, add what fused_moe_lora adds (gate_up
    rows from tokens, down rows from pairs with routing weights); a wrong buffer or a FUSED config is refused."""
    torch.manual_seed(5)
    num_tokens, top_k, num_experts, k, n = 11, 2, 5, 48, 72
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k)
    idx = torch.arange(num_tokens, dtype=torch.int32) % 4 - 1
    scaling = torch.rand(3) + 0.5
    table = expert_table(3, num_experts, k, n, empty=(1,), max_rank=16, ranks=(8, 16))
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2, "GROUP_M": 1, "num_warps": 4, "num_stages": 1}
    for x, w in ((torch.randn(num_tokens, k), None), (torch.randn(num_tokens * top_k, k), weights)):
        y0 = torch.randn(num_tokens * top_k, n)
        want = y0.clone()
        fml.fused_moe_lora(want, x, table, None, ids, idx, scaling, w, config=cfg)
        buf = fml.moe_lora_shrink(x, table, ids, idx, scaling, out_features=n, config=cfg)
        got = y0.clone()
        fml.moe_lora_expand(got, x, buf, table, ids, idx, scaling, w, config=cfg)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - y0).abs().max() > 0.01
    with pytest.raises(ValueError, match="float32"):
        fml.moe_lora_expand(got, x, buf[:, :3], table, ids, idx, scaling, w, config=cfg)
    with pytest.raises(ValueError, match="FUSED"):
        fml.moe_lora_expand(got, x, buf, table, ids, idx, scaling, w, config={**cfg, "FUSED": 1})
