"""Problems at a model's real shapes, shared by ``loraplex tune``, the kernel benchmark and the GPU check.

A :class:`Case` is one op at one M (tokens): inputs built on the device, a ``run(config)`` that launches the
Triton op (``config=None``: tuned file or default), the reference for correctness, the bytes the op must move
at least (for achieved bandwidth), for tunable ops the config search space, and named ``variants`` (configs the
benchmark and the GPU check also run: the one-kernel and PDL paths of the LoRA ops).
Shape legend: M tokens, H hidden, E experts, A top-k, I expert intermediate, L adapter slots, R rank.

Adapters: the LoRA cases' tokens use the adapters of an :class:`AdapterMix` (an int n stands for n adapters round
robin). ``serving_mix(m)``, what ``loraplex tune`` uses by default, follows a multi-tenant replica: 32 adapters
Zipf-distributed over the tokens from M = 64, read through a table as wide as the engine's decode graph of M rows;
8 adapters round robin below; from M = 1024 an eager mixed step: one request's prompt chunk (one adapter) beside
M / 16 decode tokens of 32 adapters Zipf.

Byte model (``nbytes``, the least an op must move; bandwidth = nbytes / CUDA-graph replay time):
- expert GEMMs: the weights (and int8 / MXFP4 scales) of the experts the batch activates, x read, the intermediate
  written and read, the output written (MXFP4: codes and E8M0 scales at 4.25 bits a weight, whatever the layout);
- LoRA: A and B of the adapters the batch uses (dense) or of the distinct (adapter, expert) pairs it routes to
  (expert LoRA: R x (K + N) elements per pair), x read, y read and written (the fused add), and for the dense
  ops the fp32 rank-R buffer between shrink and expand. Re-reads served by L2 (the one-kernel path's A per
  column block, split-K partials), expert LoRA's small buffer and the metadata tables are not counted;
- attention: the K and V of every context token, q read and the output written.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class ModelShapes:
    """The dims the hot-path kernels see for one model."""

    name: str
    hidden: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    activation: str = "silu"
    expert_bias: bool = False
    router_scoring: str = "softmax"  # see reference.moe_route


    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} heads not a multiple of {self.num_kv_heads} kv heads")

    @property
    def qkv_slices(self) -> tuple[int, int, int]:
        return (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)

    @classmethod
    def from_model_config(cls, cfg: Any) -> "ModelShapes":
        """From ``loraplex.engine.config.ModelConfig``."""
        if not cfg.is_moe:
            raise ValueError(f"{cfg.family} is not a MoE model; the kernel tuner needs expert shapes")
        gpt_oss = cfg.family == "gpt_oss"
        return cls(name=cfg.name_or_path or cfg.family, hidden=cfg.hidden_size, num_experts=cfg.num_experts,
                   top_k=cfg.num_experts_per_tok, moe_intermediate=cfg.moe_intermediate_size,
                   num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   activation="swiglu_clamp" if gpt_oss else "silu", expert_bias=cfg.expert_bias,
                   router_scoring="topk_softmax" if gpt_oss else "softmax")


PRESETS = {
    "gpt-oss-20b": ModelShapes("gpt-oss-20b", hidden=2880, num_experts=32, top_k=4, moe_intermediate=2880,
                               num_heads=64, num_kv_heads=8, head_dim=64, activation="swiglu_clamp",
                               expert_bias=True, router_scoring="topk_softmax"),
    "qwen3-30b-a3b": ModelShapes("qwen3-30b-a3b", hidden=2048, num_experts=128, top_k=8, moe_intermediate=768,
                                 num_heads=32, num_kv_heads=4, head_dim=128),
}


MAX_STEP_SLOTS = 256  # the engine's default max_num_seqs: a decode graph of b rows holds min(b, this) step slots
SERVING_MIN_M = 64  # serving_mix: from this M on, the high-concurrency mix
PREFILL_MIN_M = 1024  # serving_mix: from this M on, a mixed prefill + decode step


@dataclass(frozen=True)
class AdapterMix:
    """The adapters of a LoRA case's M tokens (step slots 0..k-1 of the k distinct adapters drawn).

    ``dist`` "even": token t uses adapter t mod n (all n once M >= n); "zipf": each token draws adapter j with
    P(j) proportional to 1 / (j + 1), as ``loraplex bench serve --mix zipf`` assigns requests (a seeded draw per M);
    "prefill": an eager mixed step, the first M - M // 16 tokens one request's prompt chunk (adapter 0), the last
    M // 16 decode tokens drawn as "zipf".
    The kernels read a LoRA table of ``slots`` step slots: ``table_slots`` (0: n); slots no token uses have rank 0,
    as in the engine's decode graphs, whose table holds min(batch bucket, max_step_slots) slots whatever the step
    uses (the LoRA alignment and the slot search of every LoRA program run over all of them).
    """

    num_adapters: int
    dist: str = "even"
    table_slots: int = 0

    def __post_init__(self) -> None:
        if self.num_adapters < 1 or self.dist not in ("even", "zipf", "prefill"):
            raise ValueError(f"AdapterMix needs num_adapters >= 1 and dist 'even', 'zipf' or 'prefill', got "
                             f"{self.num_adapters} and {self.dist!r}")
        if self.table_slots and self.table_slots < self.num_adapters:
            raise ValueError(f"table_slots {self.table_slots} < num_adapters {self.num_adapters}")

    @property
    def slots(self) -> int:
        return max(self.table_slots, self.num_adapters)

    def __str__(self) -> str:
        return f"{self.num_adapters} adapters {self.dist}, table of {self.slots} slots"


def as_mix(adapters: "int | AdapterMix") -> AdapterMix:
    """An AdapterMix as is; an int n: n adapters round robin (every slot used once M >= n)."""
    return adapters if isinstance(adapters, AdapterMix) else AdapterMix(int(adapters))


def serving_mix(m: int, max_step_slots: int = MAX_STEP_SLOTS) -> AdapterMix:
    """The mix of a multi-tenant batch of M tokens: from SERVING_MIN_M, 32 adapters Zipf through a table of
    min(M, max_step_slots) slots (the engine's decode graph of M rows; at least 32); below, 8 adapters round robin
    in a table of 8 (small batches of a few tenants); from PREFILL_MIN_M, a mixed step (eager: its table holds the
    adapters it uses): one prompt chunk beside M / 16 decodes of 32 adapters Zipf."""
    if m >= PREFILL_MIN_M:
        return AdapterMix(32, "prefill")
    if m >= SERVING_MIN_M:
        return AdapterMix(32, "zipf", max(32, min(m, max_step_slots)))
    return AdapterMix(8)


@dataclass
class Case:
    op: str  # tuning-file op name ("" for ops without tuned configs)
    label: str
    m: int
    shape: dict[str, int]
    run: Callable[[dict | None], Any]
    check: Callable[..., float] | None  # relative error vs the reference; check(cfg) with a config (None: tuned)
    nbytes: int
    default: dict | None = None
    space: list[dict] = field(default_factory=list)
    variants: dict[str, dict] = field(default_factory=dict)  # label suffix -> config (benchmark, GPU check)
    reference: Callable[[], Any] | None = None  # the torch reference's call, timed beside the op by the benchmark
    # candidates built on the search's winner, tried after the space (``loraplex tune``): keys a path of its own reads
    # beside the winner's, which other callers of the same entry keep reading (``mxfp4_one_launch_space``)
    refine: Callable[[dict], list[dict]] | None = None


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp32."""
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


def _cfgs(keys: tuple[str, ...], rows: list[tuple]) -> list[dict]:
    return [dict(zip(keys, r)) for r in rows]


MOE_SPACE = _cfgs(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"), [
    (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3), (16, 64, 256, 1, 4, 3), (16, 128, 256, 1, 8, 3),
    (16, 32, 256, 1, 4, 4), (16, 64, 64, 1, 4, 5), (32, 64, 128, 1, 4, 4), (32, 128, 128, 4, 8, 3),
    (64, 64, 64, 4, 4, 4), (64, 128, 64, 4, 8, 4), (64, 128, 128, 4, 8, 3), (32, 64, 256, 1, 4, 3),
    # prefill sizes (M in the thousands: compute-bound tiles)
    (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4), (128, 256, 64, 8, 8, 3), (64, 256, 64, 8, 8, 3),
    (128, 64, 64, 8, 4, 4)])
# bf16 / fp16 experts also try their prefill tiles with the weights read through TMA (``fused_moe_tma``; a box row
# of at most 128 bytes: BLOCK_K 64)
MOE_FLOAT_SPACE = MOE_SPACE + [{**cfg, "TMA": 1} for cfg in _cfgs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"),
    [(128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 256, 64, 8, 8, 3), (128, 64, 64, 8, 4, 4)])]
# fused_moe_mxfp4 on the kernel layout (``fused_moe_mxfp4``): weight rows on the MMA's M (BLOCK_N), pairs on its N
# (BLOCK_M), BLOCK_K a multiple of 64. The MMA follows from the shape: wgmma (Triton's MMAv3) where BLOCK_M >= 16,
# the product's rows are a multiple of 64 and num_warps of 4, else mma.sync (MMAv2; BLOCK_M 8, or 1 / 2 warps),
# which issues about a third fewer instructions per weight at decode (no warpgroup fences, n8 tiles at BLOCK_M 8).
# SPLIT_K / GU_SPLIT_K split the down / gate_up K (SM fill when a few experts are touched), GU_FUSED puts gate and
# up rows in one product (one accumulator per warpgroup: fewer registers, two CTAs per SM at prefill tiles; with 4
# warps at most, ``fused_moe_mxfp4.FUSED_MAX_WARPS``, so no candidate sets it with 8),
# PREFETCH loads the next K step into registers instead of Triton's cp.async pipeline (num_stages 1), PDL launches
# the op's kernels with programmatic dependent launch (a launch overlaps the previous kernel's tail; a decode step
# of one token runs three or four). The tuner stops at its time budget, so best bets come first.
_MXFP4_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "GU_SPLIT_K", "GU_FUSED", "PREFETCH",
               "num_warps", "num_stages")
MXFP4_DECODE_SPACE = _cfgs(_MXFP4_KEYS, [  # M <= 16: a few pairs per touched expert
    (8, 64, 256, 1, 1, 1, 0, 0, 4, 3), (8, 128, 128, 1, 1, 1, 0, 0, 4, 3), (8, 64, 128, 1, 1, 1, 0, 0, 4, 4),
    (8, 64, 128, 1, 1, 1, 0, 0, 2, 3), (8, 64, 256, 1, 1, 1, 0, 0, 2, 2), (8, 128, 256, 1, 1, 1, 0, 0, 4, 2),
    (8, 32, 256, 1, 1, 1, 0, 0, 1, 3), (16, 64, 128, 1, 1, 1, 0, 0, 2, 3), (8, 64, 128, 1, 1, 1, 0, 1, 4, 1),
    (16, 64, 128, 1, 1, 1, 0, 1, 4, 1), (16, 64, 64, 1, 1, 1, 0, 0, 4, 6), (16, 64, 128, 1, 1, 1, 0, 0, 4, 4),
    (16, 128, 128, 1, 1, 1, 1, 0, 4, 3), (8, 128, 128, 1, 1, 1, 0, 0, 4, 4), (8, 64, 256, 1, 1, 1, 0, 0, 4, 4),
    (8, 256, 128, 1, 1, 1, 0, 0, 8, 2), (8, 32, 128, 1, 1, 1, 0, 0, 1, 4), (8, 128, 128, 1, 1, 1, 0, 0, 2, 2),
    (8, 64, 256, 1, 1, 1, 0, 0, 4, 2), (8, 128, 128, 1, 1, 1, 0, 0, 4, 2)])
MXFP4_SPLITS = ((2, 2), (4, 4), (4, 2), (8, 4))  # (SPLIT_K, GU_SPLIT_K) tried on the first decode tiles
MXFP4_BLOCK16_SPACE = _cfgs(_MXFP4_KEYS, [  # M = 32 .. 64: up to ~16 pairs per expert
    (16, 64, 128, 1, 1, 1, 0, 0, 2, 3), (16, 64, 128, 1, 1, 1, 0, 0, 4, 4), (16, 128, 128, 1, 1, 1, 0, 0, 4, 3),
    (16, 128, 128, 1, 1, 1, 1, 0, 4, 3), (16, 64, 128, 1, 1, 1, 0, 1, 4, 1), (16, 64, 64, 1, 1, 1, 0, 0, 4, 6),
    (32, 64, 128, 1, 1, 1, 0, 0, 4, 3), (32, 128, 64, 1, 1, 1, 0, 0, 4, 4), (16, 128, 128, 1, 1, 1, 0, 0, 2, 2),
    (16, 256, 128, 1, 1, 1, 0, 0, 8, 3)])
_OWN_DOWN_KEYS = ("DOWN_BLOCK_N", "DOWN_BLOCK_K", "DOWN_PREFETCH", "DOWN_num_warps", "DOWN_num_stages")


def _own_tile(gate_up: tuple, down: tuple, **extra) -> dict:
    """A config with each GEMM on its own tile: ``_MXFP4_KEYS`` from ``gate_up``, the ``DOWN_`` keys from ``down``."""
    return {**dict(zip(_MXFP4_KEYS, gate_up)), **dict(zip(_OWN_DOWN_KEYS, down)), **extra}


MXFP4_MID_SPACE = [  # M = 128 .. 512: tens of pairs per expert; first each GEMM on its own tile
    _own_tile((64, 128, 64, 4, 1, 1, 1, 0, 4, 4), (64, 64, 0, 4, 4))] + _cfgs(_MXFP4_KEYS, [
    (64, 128, 64, 4, 1, 1, 0, 0, 4, 4), (64, 128, 64, 4, 1, 1, 0, 0, 8, 4), (32, 128, 128, 4, 1, 1, 0, 0, 4, 3),
    (64, 64, 128, 4, 1, 1, 0, 0, 4, 4), (64, 256, 64, 4, 1, 1, 0, 0, 8, 3), (32, 128, 128, 4, 1, 1, 1, 0, 4, 3),
    (128, 128, 64, 4, 1, 1, 0, 0, 8, 4)])
MXFP4_PREFILL_SPACE = [  # M >= 1024: hundreds of pairs per expert, compute-bound; first each GEMM on its own tile
    _own_tile((128, 128, 64, 8, 1, 1, 0, 0, 8, 3), (128, 64, 0, 8, 4))] + _cfgs(_MXFP4_KEYS, [
    (128, 128, 64, 8, 1, 1, 0, 0, 8, 3), (128, 128, 64, 4, 1, 1, 0, 0, 8, 4), (256, 128, 64, 4, 1, 1, 0, 0, 8, 3),
    (128, 256, 64, 4, 1, 1, 0, 0, 8, 3), (256, 64, 64, 4, 1, 1, 1, 0, 4, 3), (128, 64, 64, 8, 1, 1, 0, 0, 4, 4),
    (128, 128, 128, 4, 1, 1, 0, 0, 8, 3), (64, 128, 64, 8, 1, 1, 0, 0, 8, 4)])
MXFP4_OWN_TILE_SPACE = [  # M <= 32: each GEMM on its own tile (DOWN_ keys), the H200's winners first
    _own_tile(gu, dn, PDL=1) for gu, dn in [
        ((8, 128, 128, 1, 2, 1, 0, 0, 4, 3), (128, 128, 0, 4, 3)),
        ((8, 128, 128, 1, 2, 2, 1, 0, 4, 3), (64, 128, 0, 4, 3)),
        ((8, 128, 128, 1, 2, 2, 1, 0, 4, 3), (128, 128, 0, 4, 3)),
        ((8, 128, 128, 1, 2, 2, 1, 1, 4, 1), (64, 128, 0, 4, 3)),
        ((8, 128, 128, 1, 2, 1, 1, 0, 4, 3), (128, 128, 0, 4, 3)),
        ((8, 64, 128, 1, 2, 2, 0, 0, 4, 3), (128, 128, 0, 4, 3))]]
# M <= 64: both GEMMs' weights through TMA (``fused_moe_mxfp4``'s TMA / DOWN_TMA keys, one 64-K atom a copy). The
# copies hold no registers, so these run deeper pipelines than the pointer tiles (4-6 stages) and leave room for more
# programs an SM; tried after the own-tile configs
_TMA = {"TMA": 1, "DOWN_TMA": 1, "PDL": 1}
MXFP4_TMA_SPACE = [
    _own_tile((8, 128, 128, 1, 2, 2, 1, 0, 4, 6), (64, 128, 0, 4, 6), **_TMA),
    _own_tile((8, 64, 128, 1, 4, 4, 0, 0, 4, 4), (64, 128, 0, 4, 4), **_TMA),
    _own_tile((8, 128, 256, 1, 2, 2, 1, 0, 4, 4), (128, 256, 0, 4, 4), **_TMA),
    {**dict(zip(_MXFP4_KEYS, (16, 128, 128, 1, 1, 1, 1, 0, 4, 4))), **_TMA}]  # one tile for both (M = 32 .. 64)
MXFP4_MID_MIN_M = 128
MXFP4_PREFILL_MIN_M = 1024
MXFP4_SPLIT_MAX_M = 16  # split-K candidates: only while the touched experts leave SMs idle
MXFP4_DIRECT_MAX_M = 2  # one pair per block (no moe_align launch) pays while tokens rarely share an expert


# both MXFP4 GEMMs in one launch (``fused_moe_mxfp4_one_launch``), as ``ONE_`` keys over a two-launch winner at M up to
# ONE_LAUNCH_MAX_M: the H100's winners at M = 2 and 4 first, then their neighbours, last two with gate_up's weights
# through TMA (``ONE_TMA``)
ONE_LAUNCH_MAX_M = 4
_ONE_BASE = {"ONE_LAUNCH": 1, "ONE_BLOCK_M": 8, "ONE_BLOCK_K": 128, "ONE_GU_FUSED": 0, "ONE_PREFETCH": 0,
             "ONE_num_stages": 3, "ONE_num_warps": 4, "ONE_PDL": 1}
ONE_LAUNCH_SPACE = [{**_ONE_BASE, "ONE_BLOCK_I": bi, "ONE_BLOCK_H": bh, "ONE_DIRECT": direct, **extra}
                    for bi, bh, direct, extra in [
                        (64, 512, 1, {}), (128, 256, 0, {}), (64, 256, 1, {}), (128, 256, 0, {"ONE_GU_FUSED": 1}),
                        (128, 512, 0, {}), (64, 512, 1, {"ONE_GU_FUSED": 1}), (64, 512, 0, {}),
                        (128, 256, 0, {"ONE_num_stages": 2}),
                        (64, 512, 1, {"ONE_TMA": 1, "ONE_num_stages": 4}),
                        (128, 256, 0, {"ONE_TMA": 1, "ONE_GU_FUSED": 1, "ONE_num_stages": 6})]]


def mxfp4_one_launch_space(m: int, best: dict) -> list[dict]:
    """The one-launch candidates at M tokens over ``best`` (the two-launch winner, whose keys the expert LoRA path
    keeps reading from the same entry): none above ONE_LAUNCH_MAX_M, one pair a block (``ONE_DIRECT``) only at M <= 2
    (an expert two pairs share is read twice), none over a checkpoint-layout winner."""
    if m > ONE_LAUNCH_MAX_M or best.get("LAYOUT") == "checkpoint":
        return []
    return [{**best, **c} for c in ONE_LAUNCH_SPACE if m <= 2 or not c["ONE_DIRECT"]]


def mxfp4_moe_space(m: int) -> list[dict]:
    """Search space of ``fused_moe_mxfp4`` (kernel layout) at M tokens, best bets first: at M <= 16 the tiles with
    the down GEMM on its own tile (``MXFP4_OWN_TILE_SPACE``; the first three of them up to M = 32), the TMA tiles
    (``MXFP4_TMA_SPACE``; the 16-row one up to M = 64), then the decode tiles with the split-K pairs of
    ``MXFP4_SPLITS`` on the first three (first at M <= 4), PDL launches of the first three candidates up to M = 64,
    at M <= 2 also DIRECT."""
    if m >= MXFP4_PREFILL_MIN_M:
        return list(MXFP4_PREFILL_SPACE) + MXFP4_MID_SPACE[:2]
    if m >= MXFP4_MID_MIN_M:
        return list(MXFP4_MID_SPACE) + MXFP4_PREFILL_SPACE[:2] + MXFP4_BLOCK16_SPACE[:2]
    if m > MXFP4_SPLIT_MAX_M:
        own = MXFP4_OWN_TILE_SPACE[:3] if m <= 2 * MXFP4_SPLIT_MAX_M else []
        return MXFP4_BLOCK16_SPACE[:2] + [{**c, "PDL": 1} for c in MXFP4_BLOCK16_SPACE[:2]] + own \
            + MXFP4_TMA_SPACE[3:] + MXFP4_BLOCK16_SPACE[2:] + MXFP4_DECODE_SPACE[:4]
    splits = [{**c, "SPLIT_K": s, "GU_SPLIT_K": g} for c in MXFP4_DECODE_SPACE[:3] for s, g in MXFP4_SPLITS]
    space = splits[:4] + MXFP4_DECODE_SPACE + splits[4:] if m <= 4 else MXFP4_DECODE_SPACE[:6] + splits \
        + MXFP4_DECODE_SPACE[6:]
    space = space[:3] + [{**c, "PDL": 1} for c in space[:3]] + space[3:]
    if m <= MXFP4_DIRECT_MAX_M:
        space = space[:2] + [{**c, "DIRECT": 1} for c in (space[0], space[1], MXFP4_DECODE_SPACE[0])] + space[2:]
    return MXFP4_OWN_TILE_SPACE + MXFP4_TMA_SPACE + space + MXFP4_BLOCK16_SPACE[:2]


def mxfp4_variants(cfg: dict) -> dict[str, dict]:
    """The benchmark's and GPU check's extra ``fused_moe_mxfp4`` runs next to ``cfg`` (the tuned config): the scale
    multiply in plain Triton instead of inline PTX, split-K 2 on both GEMMs, one pair per block without moe_align
    (DIRECT), both GEMMs' weights through TMA on the same tiles (two launches, 4 stages at least), and the checkpoint
    layout (``fused_moe``'s W_MXFP4 kernels at their default config)."""
    from loraplex.kernels.fused_moe import DEFAULT_CONFIG

    stages = max(4, int(cfg.get("num_stages", 1)))
    return {"decode bits": {**cfg, "DECODE": "bits"},
            "split-K 2": {**cfg, "SPLIT_K": 2, "GU_SPLIT_K": 2},
            "direct": {**cfg, "DIRECT": 1},
            "tma": {**cfg, "TMA": 1, "DOWN_TMA": 1, "PREFETCH": 0, "DOWN_PREFETCH": 0, "ONE_LAUNCH": 0,
                    "num_stages": stages, "DOWN_num_stages": max(4, int(cfg.get("DOWN_num_stages", stages)))},
            "checkpoint layout": {**DEFAULT_CONFIG, "LAYOUT": "checkpoint"}}
SHRINK_SPACE = _cfgs(("BLOCK_M", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"), [
    (16, 64, 16, 2, 3), (16, 64, 8, 2, 3), (16, 32, 16, 2, 3), (16, 64, 16, 4, 2), (16, 128, 8, 4, 3),
    (16, 32, 32, 2, 2), (16, 64, 1, 4, 2), (16, 128, 1, 4, 3), (16, 256, 1, 4, 3), (16, 128, 4, 4, 3),
    (16, 256, 4, 4, 3), (32, 128, 4, 4, 3), (64, 128, 2, 4, 3), (64, 64, 1, 4, 3), (16, 256, 8, 8, 3),
    (32, 256, 2, 8, 3), (16, 64, 32, 1, 2)])
# prefill-sized batches (M >= SHRINK_LARGE_MIN_M): larger token blocks with less split-K, and for a multi-slice
# target (qkv) every slice in one program (``lora_shrink``'s FUSE_SLICES: x read once instead of once per slice)
SHRINK_LARGE_MIN_M = 256
_SHRINK_KEYS = ("BLOCK_M", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
SHRINK_LARGE_SPACE = _cfgs(_SHRINK_KEYS, [
    (64, 128, 2, 4, 3), (64, 64, 1, 4, 3), (64, 128, 1, 8, 3), (128, 64, 1, 8, 3), (32, 128, 1, 4, 3),
    (64, 64, 2, 4, 3), (128, 128, 1, 8, 2), (32, 64, 2, 4, 3)])
# FUSE_SLICES has S times fewer programs than the plain grid, so it splits K further to fill the GPU
SHRINK_FUSED_SPACE = _cfgs(_SHRINK_KEYS, [
    (64, 128, 4, 4, 3), (32, 128, 4, 4, 3), (64, 64, 8, 4, 3), (32, 64, 8, 4, 3), (64, 128, 8, 8, 3),
    (128, 64, 4, 8, 3), (64, 128, 2, 4, 3), (16, 128, 8, 4, 3)])


def shrink_space(m: int, num_slices: int) -> list[dict]:
    """Search space of ``lora_shrink`` at M tokens of a target with ``num_slices`` slices: SHRINK_SPACE, and at
    prefill sizes first SHRINK_LARGE_SPACE and, where there are several slices, SHRINK_FUSED_SPACE with
    FUSE_SLICES."""
    if m < SHRINK_LARGE_MIN_M:
        return list(SHRINK_SPACE)
    fused = [{**c, "FUSE_SLICES": 1} for c in SHRINK_FUSED_SPACE] if num_slices > 1 else []
    return fused + SHRINK_LARGE_SPACE + [c for c in SHRINK_SPACE if c not in SHRINK_LARGE_SPACE]


EXPAND_SPACE = _cfgs(("BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages", "PDL"), [
    (16, 128, 1, 4, 2, 1), (16, 128, 4, 4, 2, 1), (16, 256, 1, 4, 2, 1), (16, 64, 1, 4, 2, 1),
    (16, 64, 1, 4, 2, 0), (16, 128, 1, 4, 2, 0), (16, 256, 1, 4, 2, 0), (16, 128, 4, 4, 2, 0), (32, 128, 4, 4, 2, 0),
    (64, 128, 4, 4, 2, 0), (16, 32, 1, 2, 2, 0), (32, 256, 4, 8, 2, 0), (64, 64, 8, 4, 2, 0), (16, 512, 1, 8, 2, 0),
    (16, 64, 1, 2, 1, 0), (16, 128, 1, 8, 1, 0), (16, 256, 1, 8, 1, 0), (16, 512, 1, 8, 2, 1), (16, 32, 1, 2, 2, 1),
    (32, 128, 4, 4, 2, 1)])
FUSED_LORA_SPACE = _cfgs(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), [
    (16, 128, 128, 4, 3), (16, 64, 128, 4, 3), (16, 256, 128, 4, 3), (16, 128, 256, 4, 3), (16, 64, 256, 4, 2),
    (32, 128, 128, 4, 3), (16, 256, 256, 8, 3), (32, 256, 128, 8, 3), (64, 128, 64, 4, 3), (16, 128, 64, 4, 4)])
_MOE_LORA_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "GROUP_M", "num_warps", "num_stages", "FUSED", "PDL")
# The tuner stops at its time budget, so best bets come first: the previous H200 winners with PDL (expand
# overlaps shrink) and without, then the rest; for small M the one-kernel path (FUSED) goes in after the first
# three (see moe_lora_space).
MOE_LORA_SPACE = _cfgs(_MOE_LORA_KEYS, [
    (16, 128, 64, 16, 1, 4, 3, 0, 1), (16, 128, 128, 4, 1, 4, 3, 0, 1), (16, 256, 64, 16, 1, 4, 3, 0, 1),
    (16, 128, 64, 16, 1, 4, 3, 0, 0), (16, 128, 128, 4, 1, 4, 3, 0, 0), (16, 256, 64, 16, 1, 4, 3, 0, 0),
    (16, 256, 256, 2, 1, 4, 3, 0, 1), (16, 64, 64, 8, 1, 4, 3, 0, 1), (32, 128, 128, 2, 4, 4, 3, 0, 1),
    (16, 128, 128, 1, 1, 4, 3, 0, 1), (16, 64, 64, 1, 1, 4, 2, 0, 0), (16, 128, 128, 1, 1, 4, 3, 0, 0),
    (16, 256, 256, 2, 1, 4, 3, 0, 0), (16, 64, 256, 4, 1, 4, 3, 0, 0), (32, 128, 128, 2, 4, 4, 3, 0, 0),
    (16, 128, 64, 8, 1, 4, 3, 0, 0), (32, 64, 128, 1, 4, 4, 3, 0, 0), (64, 128, 128, 1, 4, 8, 3, 0, 0),
    (16, 256, 128, 2, 1, 8, 3, 0, 0), (16, 128, 32, 16, 1, 4, 3, 0, 0)])
MOE_LORA_FUSED_SPACE = _cfgs(_MOE_LORA_KEYS, [
    (16, 256, 128, 1, 1, 4, 3, 1, 1), (16, 128, 128, 1, 1, 4, 3, 1, 1), (16, 256, 128, 1, 1, 4, 3, 1, 0),
    (16, 512, 128, 1, 1, 8, 3, 1, 1), (16, 256, 256, 1, 1, 8, 3, 1, 1), (16, 128, 256, 1, 1, 4, 4, 1, 1)])
MOE_LORA_SPACE = [{**c, "COLS": 1} for c in MOE_LORA_SPACE]  # one column block a program (the grid of old)
MOE_LORA_FUSED_SPACE = [{**c, "COLS": 1} for c in MOE_LORA_FUSED_SPACE]  # COLS unused by the one-kernel path
# expand programs over COLS column blocks (one slot search and h read for all, the next B tile in flight while
# the current y tile is written): the decode candidates' best bets with 2..8 column blocks a program
MOE_LORA_COLS_SPACE = [{**MOE_LORA_SPACE[i], "COLS": c} for i, c in
                       ((1, 4), (1, 8), (0, 4), (1, 2), (2, 2), (7, 8), (0, 8), (10, 4))]
# prefill-step sizes (M >= PREFILL_MIN_M / 2): the H200 winner at M = 1024 and 2048 (16-row blocks, split-K 4, eight
# column blocks a program, plain launches) and its neighbours, first; 32-row blocks with column groups next
MOE_LORA_PREFILL_SPACE = [{**MOE_LORA_SPACE[4], "COLS": 8}, {**MOE_LORA_SPACE[4], "COLS": 4},
                          {**MOE_LORA_SPACE[1], "COLS": 8},
                          dict(zip(_MOE_LORA_KEYS + ("COLS",), (32, 128, 128, 4, 1, 4, 3, 0, 0, 4))),
                          dict(zip(_MOE_LORA_KEYS + ("COLS",), (32, 128, 128, 4, 1, 4, 3, 0, 1, 4)))]
FUSED_MAX_M = 16  # the one-kernel path recomputes shrink per column block: only worth trying at small M


def moe_lora_space(m: int) -> list[dict]:
    """Search space of ``fused_moe_lora`` at M tokens: best bets first; the one-kernel candidates only up to
    FUSED_MAX_M, three of them after the first three PDL candidates and four COLS ones; the other COLS candidates
    after the first three above FUSED_MAX_M; at prefill-step sizes MOE_LORA_PREFILL_SPACE first (on the H200 row
    blocks of 32 and 64 lost there, with or without split-K and column groups)."""
    cols = MOE_LORA_COLS_SPACE
    if m >= PREFILL_MIN_M // 2:
        rest = [c for c in MOE_LORA_SPACE[:3] + cols + MOE_LORA_SPACE[3:] if c not in MOE_LORA_PREFILL_SPACE]
        return MOE_LORA_PREFILL_SPACE + rest
    if m > FUSED_MAX_M:
        return MOE_LORA_SPACE[:3] + cols + MOE_LORA_SPACE[3:]
    return MOE_LORA_SPACE[:3] + cols[:4] + MOE_LORA_FUSED_SPACE[:3] + MOE_LORA_SPACE[3:6] + MOE_LORA_FUSED_SPACE[3:] \
        + cols[4:] + MOE_LORA_SPACE[6:]


def moe_lora_variants(cfg: dict) -> dict[str, dict]:
    """The benchmark's and GPU check's extra ``fused_moe_lora`` runs next to ``cfg`` (the tuned config)."""
    fused = dict(zip(_MOE_LORA_KEYS, (16, 256, 128, 1, 1, 4, 3, 1, 0)))
    return {"two kernels+PDL": {**cfg, "FUSED": 0, "PDL": 1}, "fused": fused, "fused+PDL": {**fused, "PDL": 1}}


def _routing(m: int, num_experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(m, num_experts, device=device)
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1), ids


def adapter_indices(m: int, adapters: "int | AdapterMix", device) -> torch.Tensor:
    """token_lora_idx [M] int32 of ``adapters`` (``AdapterMix``): step slots 0..k-1, k the distinct adapters drawn."""
    mix = as_mix(adapters)
    if mix.dist == "even":
        return (torch.arange(m, device=device) % mix.num_adapters).to(torch.int32)
    weights = 1.0 / torch.arange(1, mix.num_adapters + 1, dtype=torch.float64)
    drawn = m // 16 if mix.dist == "prefill" else m
    draws = torch.multinomial(weights, drawn, replacement=True, generator=torch.Generator().manual_seed(m))
    if drawn < m:  # the prompt chunk's tokens: adapter 0
        draws = torch.cat([torch.zeros(m - drawn, dtype=draws.dtype), draws])
    _, slots = torch.unique(draws, return_inverse=True)  # adapter j -> step slot by rank among those drawn
    return slots.to(torch.int32).to(device)


def widen_table(table, slots: int):
    """``table`` (a LoRATable) over ``slots`` step slots, those past its own without weights (rank 0)."""
    extra = slots - table.num_slots
    if extra <= 0:
        return table
    pad = torch.zeros(extra, table.num_slices, 3, dtype=table.entries.dtype, device=table.entries.device)
    own, lookup = table.num_slots, table.lookup
    return dataclasses.replace(table, entries=torch.cat([table.entries, pad]),
                               lookup=lambda l, s: lookup(l, s) if l < own else None)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def moe_cases(s: ModelShapes, m: int, dtype, device, *, weights: str = "float") -> list[Case]:
    """The fused MoE op at M tokens with ``weights`` "float" (the model dtype), "int8" or "mxfp4" experts (none
    for mxfp4 when H or I is not a multiple of 32: such a model cannot use the format)."""
    from loraplex.kernels import reference, reference_lora
    from loraplex.kernels.fused_moe import DEFAULT_CONFIG, fused_moe, shape_of
    from loraplex.kernels.fused_moe_int8 import fused_moe_int8

    h, e, i = s.hidden, s.num_experts, s.moe_intermediate
    if weights == "mxfp4" and (h % 32 or i % 32):
        return []
    x = torch.randn(m, h, device=device, dtype=dtype)
    w13 = (torch.randn(e, 2 * i, h, device=device) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=device) / i ** 0.5).to(dtype)
    b13 = torch.randn(e, 2 * i, device=device, dtype=dtype) * 0.1 if s.expert_bias else None
    b2 = torch.randn(e, h, device=device, dtype=dtype) * 0.1 if s.expert_bias else None
    topk_weights, ids = _routing(m, e, s.top_k, device)
    active = int(ids.unique().numel())
    kw = dict(activation=s.activation, b13=b13, b2=b2)
    act_bytes = _nbytes(x) * 2 + m * s.top_k * i * x.element_size() * 2
    if weights == "float":
        return [Case("fused_moe", "fused_moe", m, shape_of(x, w13, ids),
                     lambda cfg: fused_moe(x, w13, w2, topk_weights, ids, config=cfg, **kw),
                     lambda cfg=None: rel_error(fused_moe(x, w13, w2, topk_weights, ids, config=cfg, **kw),
                                                reference.fused_moe(x, w13, w2, topk_weights, ids, **kw)),
                     nbytes=active * (w13[0].numel() + w2[0].numel()) * w13.element_size() + act_bytes,
                     default=DEFAULT_CONFIG, space=MOE_FLOAT_SPACE)]
    if weights == "int8":
        q13, s13 = reference_lora.quantize_int8_per_channel(w13)
        q2, s2 = reference_lora.quantize_int8_per_channel(w2)
        op, ref, space = fused_moe_int8, reference_lora.fused_moe_int8, MOE_SPACE
    elif weights == "mxfp4":  # 4 bits a weight plus one byte per 32: 4.25 bits
        return [_mxfp4_case(s, m, x, w13, w2, topk_weights, ids, kw, act_bytes, active)]
    else:
        raise ValueError(f"weights {weights!r}: expected 'float', 'int8' or 'mxfp4'")
    del w13, w2
    args = (x, q13, s13, q2, s2, topk_weights, ids)
    name = f"fused_moe_{weights}"
    return [Case(name, name, m, shape_of(x, q13, ids), lambda cfg: op(*args, config=cfg, **kw),
                 lambda cfg=None: rel_error(op(*args, config=cfg, **kw), ref(*args, **kw)),
                 nbytes=active * _nbytes(q13[0], q2[0], s13[0], s2[0]) + act_bytes, default=DEFAULT_CONFIG,
                 space=space)]


def _mxfp4_case(s: ModelShapes, m: int, x, w13, w2, topk_weights, ids, kw: dict, act_bytes: int,
                active: int) -> Case:
    """fused_moe_mxfp4 on the kernel layout (``mxfp4.prepare_for_kernel``), as the engine runs it on CUDA. A
    config with ``"LAYOUT": "checkpoint"`` runs the checkpoint layout instead (``mxfp4_variants``). Bytes: the
    codes and scales of the activated experts at 4.25 bits a weight (the layout's padding to K = 64k not
    counted) plus ``act_bytes``."""
    from loraplex.kernels import reference_lora
    from loraplex.kernels import tuning
    from loraplex.kernels.fused_moe import shape_of
    from loraplex.kernels.fused_moe_mxfp4 import DEFAULT_CONFIG, fused_moe_mxfp4
    from loraplex.kernels.mxfp4 import prepare_for_kernel, quantize_mxfp4

    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    plain = (x, q13, s13, q2, s2, topk_weights, ids)
    kernel = (x, *prepare_for_kernel(q13, s13), *prepare_for_kernel(q2, s2), topk_weights, ids)
    nbytes = active * _nbytes(q13[0], q2[0], s13[0], s2[0]) + act_bytes

    def run(cfg: dict | None):
        if cfg and cfg.get("LAYOUT") == "checkpoint":
            return fused_moe_mxfp4(*plain, config={k: v for k, v in cfg.items() if k != "LAYOUT"}, **kw)
        return fused_moe_mxfp4(*kernel, config=cfg, **kw)

    def check(cfg: dict | None = None) -> float:
        return rel_error(run(cfg), reference_lora.fused_moe_mxfp4(*plain, **kw))

    shape = shape_of(x, q13, ids)
    tuned = tuning.get_config("fused_moe_mxfp4", shape, m, DEFAULT_CONFIG)
    return Case("fused_moe_mxfp4", "fused_moe_mxfp4", m, shape, run, check, nbytes=nbytes, default=DEFAULT_CONFIG,
                space=mxfp4_moe_space(m), variants=mxfp4_variants(tuned),
                refine=lambda best: mxfp4_one_launch_space(m, best))


def dense_lora_cases(s: ModelShapes, m: int, max_loras: "int | AdapterMix", rank: int, dtype, device, *,
                     shared_metadata: bool = False, target: str = "qkv") -> list[Case]:
    """Attention LoRA: ``target`` "qkv" (the fused q/k/v projection, 3 slices, K = hidden) or "o" (one slice,
    K = heads x head_dim, N = hidden). ``max_loras``: the adapters (``AdapterMix``; an int n: n round robin).
    ``shared_metadata``: shrink and expand given the step's ``lora_segments`` (untuned op name, " kernel" label;
    see ``shared_metadata_cases``)."""
    from loraplex.kernels import lora_expand as ex
    from loraplex.kernels import lora_shrink as sh
    from loraplex.kernels import lora_shrink_expand as fu
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels import tuning
    from loraplex.kernels.lora_table import LoRATable

    mix = as_mix(max_loras)
    if target == "qkv":
        slices, k_in = s.qkv_slices, s.hidden
    elif target == "o":
        slices, k_in = (s.hidden,), s.num_heads * s.head_dim
    else:
        raise ValueError(f"dense LoRA target {target!r}: expected 'qkv' or 'o'")
    n, ns = sum(slices), len(slices)
    x = torch.randn(m, k_in, device=device, dtype=dtype)
    # every adapter at rank R, read through a LoRATable made once (outside the timed calls)
    lora_a = (torch.randn(ns, mix.num_adapters, rank, k_in, device=device) / k_in ** 0.5).to(dtype)
    lora_b = (torch.randn(mix.num_adapters, n, rank, device=device) / rank ** 0.5).to(dtype)
    table = widen_table(LoRATable.from_stacked(lora_a, lora_b, output_slices=slices), mix.slots)
    lora_a = lora_b = table
    max_loras = mix.slots
    scaling = torch.full((max_loras,), 2.0, device=device)
    idx = adapter_indices(m, mix, device)
    active = int(idx.unique().numel())  # adapters the batch reads
    buf = ref.lora_shrink(x, lora_a, idx, scaling)
    y = torch.randn(m, n, device=device, dtype=dtype)

    def check_expand(cfg: dict | None = None) -> float:
        got, want = y.clone(), y.clone()
        ex.lora_expand(got, buf, lora_b, idx, slices, config=cfg)
        ref.lora_expand(want, buf, lora_b, idx, slices)
        return rel_error(got, want)

    expand_shape = ex.shape_of(y, buf, slices)
    expand_variants = {"PDL": {**tuning.get_config("lora_expand", expand_shape, m, ex.DEFAULT_CONFIG), "PDL": 1}}

    if shared_metadata:
        seg = sh.lora_segments(idx, max_loras)

        def check_expand_shared(cfg: dict | None = None) -> float:
            got, want = y.clone(), y.clone()
            ex.lora_expand(got, buf, lora_b, idx, slices, config=cfg, segments=seg)
            ref.lora_expand(want, buf, lora_b, idx, slices)
            return rel_error(got, want)

        return [
            Case("", f"lora_shrink[{target}] kernel", m, sh.shape_of(x, lora_a),
                 lambda cfg: sh.lora_shrink(x, lora_a, idx, scaling, config=cfg, segments=seg),
                 lambda cfg=None: rel_error(sh.lora_shrink(x, lora_a, idx, scaling, config=cfg, segments=seg), buf),
                 nbytes=_nbytes(x, buf) + ns * active * rank * k_in * x.element_size(),
                 default=sh.default_config(k_in)),
            Case("", f"lora_expand[{target}] kernel", m, ex.shape_of(y, buf, slices),
                 lambda cfg: ex.lora_expand(y, buf, lora_b, idx, slices, config=cfg, segments=seg),
                 check_expand_shared,
                 nbytes=_nbytes(buf) + 2 * _nbytes(y) + active * n * rank * x.element_size(),
                 default=ex.DEFAULT_CONFIG, variants=expand_variants),
        ]

    def check_fused(cfg: dict | None = None) -> float:
        got, want = y.clone(), y.clone()
        fu.lora_shrink_expand(got, x, table, None, idx, scaling, slices, config=cfg)
        ref.lora_shrink_expand(want, x, table, None, idx, scaling, slices)
        return rel_error(got, want)

    return [
        Case("lora_shrink_expand", f"lora_shrink_expand[{target}]", m, fu.shape_of(y, lora_a, slices),
             lambda cfg: fu.lora_shrink_expand(y, x, table, None, idx, scaling, slices, config=cfg),
             check_fused,
             nbytes=_nbytes(x) + 2 * _nbytes(y) + active * rank * (ns * k_in + n) * x.element_size(),
             default=fu.DEFAULT_CONFIG, space=FUSED_LORA_SPACE),
        Case("lora_shrink", f"lora_shrink[{target}]", m, sh.shape_of(x, lora_a),
             lambda cfg: sh.lora_shrink(x, lora_a, idx, scaling, config=cfg),
             lambda cfg=None: rel_error(sh.lora_shrink(x, lora_a, idx, scaling, config=cfg),
                                        ref.lora_shrink(x, lora_a, idx, scaling)),
             nbytes=_nbytes(x, buf) + ns * active * rank * k_in * x.element_size(),
             default=sh.default_config(k_in), space=shrink_space(m, ns)),
        Case("lora_expand", f"lora_expand[{target}]", m, ex.shape_of(y, buf, slices),
             lambda cfg: ex.lora_expand(y, buf, lora_b, idx, slices, config=cfg), check_expand,
             nbytes=_nbytes(buf) + 2 * _nbytes(y) + active * n * rank * x.element_size(),
             default=ex.DEFAULT_CONFIG, space=EXPAND_SPACE, variants=expand_variants),
    ]


def moe_lora_cases(s: ModelShapes, m: int, max_loras: "int | AdapterMix", rank: int, dtype, device, *,
                   shared_metadata: bool = False) -> list[Case]:
    """Expert LoRA on gate_up (K = H, N = 2I, token rows) and down (K = I, N = H, pair rows, weighted).
    ``max_loras``: the adapters (``AdapterMix``; an int n: n round robin).
    ``shared_metadata``: given the layer's ``moe_align_lora`` (untuned op name, " kernels" label)."""
    from loraplex.kernels import fused_moe_lora as fl
    from loraplex.kernels import reference_lora as ref
    from loraplex.kernels import tuning
    from loraplex.kernels.lora_table import LoRATable
    from loraplex.kernels.moe_align import moe_align_lora

    e, a = s.num_experts, s.top_k
    mix = as_mix(max_loras)
    max_loras = mix.slots
    weights, ids = _routing(m, e, a, device)
    idx = adapter_indices(m, mix, device)
    scaling = torch.full((max_loras,), 2.0, device=device)
    pairs = (idx.long()[:, None] * e + ids).unique().numel()  # distinct (adapter, expert) weight sets read
    cases = []
    for target, k, n, per_pair in (("gate_up", s.hidden, 2 * s.moe_intermediate, False),
                                   ("down", s.moe_intermediate, s.hidden, True)):
        x = torch.randn(m * a if per_pair else m, k, device=device, dtype=dtype)
        lora_a = widen_table(LoRATable.from_stacked(  # every adapter at rank R; the table holds A and B
            (torch.randn(mix.num_adapters, e, rank, k, device=device) / k ** 0.5).to(dtype),
            (torch.randn(mix.num_adapters, e, n, rank, device=device) / rank ** 0.5).to(dtype), experts=True),
            max_loras)
        lora_b = None
        y = torch.randn(m * a, n, device=device, dtype=dtype)
        tw = weights if per_pair else None

        def check(cfg=None, graph=False, x=x, lora_a=lora_a, lora_b=lora_b, y=y, tw=tw) -> float:
            """``graph``: the op (alignment included) captured in a CUDA graph and replayed once, as a step runs
            it (PDL launches become programmatic graph edges)."""
            got, want = y.clone(), y.clone()

            def call(out):
                fl.fused_moe_lora(out, x, lora_a, lora_b, ids, idx, scaling, tw, config=cfg)

            if graph:
                call(y.clone())  # compile outside the capture
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    call(got)
                g.replay()
                torch.cuda.synchronize()
            else:
                call(got)
            ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling, tw)
            return rel_error(got, want)

        shape = fl.shape_of(y, x, lora_a, ids)
        variants = moe_lora_variants(tuning.get_config("fused_moe_lora", shape, m, fl.default_config(k)))
        nbytes = pairs * rank * (k + n) * x.element_size() + _nbytes(x) + 2 * _nbytes(y)
        if shared_metadata:
            aligns = {}

            def run(cfg, x=x, lora_a=lora_a, lora_b=lora_b, y=y, tw=tw, shape=shape, aligns=aligns, k=k):
                cfg = cfg or tuning.get_config("fused_moe_lora", shape, m, fl.default_config(k))
                bm = int(cfg["BLOCK_M"])
                if bm not in aligns:  # made by the first (untimed) call, reused by the timed replays
                    aligns[bm] = moe_align_lora(ids, idx, e, max_loras, bm)
                fl.fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, tw, config=cfg, align=aligns[bm])

            def check_shared(cfg=None, x=x, lora_a=lora_a, lora_b=lora_b, y=y, tw=tw, run=run) -> float:
                want = y.clone()
                ref.fused_moe_lora(want, x, lora_a, lora_b, ids, idx, scaling, tw)
                run(cfg)  # in place on y
                return rel_error(y, want)

            cases.append(Case("", f"fused_moe_lora[{target}] kernels", m, shape, run, check_shared, nbytes=nbytes,
                              default=fl.default_config(k), variants=variants))
            continue
        cases.append(Case(
            "fused_moe_lora", f"fused_moe_lora[{target}]", m, shape,
            lambda cfg, x=x, lora_a=lora_a, lora_b=lora_b, y=y, tw=tw:
                fl.fused_moe_lora(y, x, lora_a, lora_b, ids, idx, scaling, tw, config=cfg),
            check, nbytes=nbytes, default=fl.default_config(k), space=moe_lora_space(m), variants=variants))
    return cases


def distinct_logits(m: int, num_experts: int, dtype, device) -> torch.Tensor:
    """Router logits [M, E] in (-3, 3), random order, no two equal in ``dtype`` (bf16 randn rows tie often, and
    torch.topk's tie order is unspecified, so ids could not be compared)."""
    levels = torch.argsort(torch.rand(m, num_experts, device=device), dim=-1).float()
    return ((levels + 0.3 * torch.rand(m, num_experts, device=device)) * (6.0 / num_experts) - 3.0).to(dtype)


def routing_and_rope_cases(s: ModelShapes, m: int, dtype, device, *, max_pos: int = 8192) -> list[Case]:
    """The decode step's two elementwise ops, each with its torch reference for the benchmark's comparison:
    rotary_embedding on q / k as strided views of the fused qkv output (positions anywhere in the table), and
    moe_route with the model's scoring (softmax ones renormalised)."""
    from loraplex.kernels import reference
    from loraplex.kernels.moe_route import moe_route
    from loraplex.kernels.rotary import rotary_embedding

    qh, kvh, d = s.num_heads, s.num_kv_heads, s.head_dim
    qkv = torch.randn(m, (qh + 2 * kvh) * d, device=device, dtype=dtype)
    q, k, _ = qkv.split(list(s.qkv_slices), dim=-1)
    q, k = q.reshape(m, qh, d), k.reshape(m, kvh, d)
    positions = torch.randint(0, max_pos, (m,), device=device)
    inv_freq = 1.0 / 150000.0 ** (torch.arange(0, d, 2, device=device).float() / d)
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, D] float32
    logits = distinct_logits(m, s.num_experts, dtype, device)
    route_kw = dict(scoring=s.router_scoring, renormalize=s.router_scoring == "softmax")

    def check_route() -> float:
        (w, ids), (want_w, want_ids) = (moe_route(logits, s.top_k, **route_kw),
                                        reference.moe_route(logits, s.top_k, **route_kw))
        return rel_error(w, want_w) if torch.equal(ids, want_ids) else 1.0

    return [
        Case("", "rotary_embedding", m, {}, lambda cfg: rotary_embedding(positions, q, k, cache),
             lambda: max(rel_error(a, b) for a, b in zip(rotary_embedding(positions, q, k, cache),
                                                         reference.rotary_embedding(positions, q, k, cache))),
             nbytes=2 * _nbytes(q, k) + m * d * cache.element_size() + _nbytes(positions),
             reference=lambda: reference.rotary_embedding(positions, q, k, cache)),
        Case("", f"moe_route[{s.router_scoring}]", m, {}, lambda cfg: moe_route(logits, s.top_k, **route_kw),
             check_route, nbytes=_nbytes(logits) + m * s.top_k * (4 + 8),
             reference=lambda: reference.moe_route(logits, s.top_k, **route_kw)),
    ]


def misc_cases(s: ModelShapes, m: int, dtype, device, *, context: int = 2048) -> list[Case]:
    """Untuned ops: rms_norm (+residual), activation, moe_align_lora, moe_align_pair, reshape_and_cache,
    rotary_embedding_and_cache, decode attention, and ``routing_and_rope_cases``."""
    from loraplex.kernels import reference, reference_lora
    from loraplex.kernels.activation import swiglu_clamp_and_mul
    from loraplex.kernels.moe_align import moe_align_lora, moe_align_pair
    from loraplex.kernels.paged_attention import paged_attention
    from loraplex.kernels.reshape_and_cache import reshape_and_cache
    from loraplex.kernels.rms_norm import rms_norm
    from loraplex.kernels.rotary import rotary_embedding_and_cache

    h = s.hidden
    x, res = torch.randn(m, h, device=device, dtype=dtype), torch.randn(m, h, device=device, dtype=dtype)
    w = torch.randn(h, device=device, dtype=dtype)
    g = torch.randn(m * s.top_k, 2 * s.moe_intermediate, device=device, dtype=dtype) * 4
    _, ids = _routing(m, s.num_experts, s.top_k, device)
    idx = adapter_indices(m, 8, device)
    # decode: M sequences of `context` tokens, blocks shuffled across the pool
    bs, kvh, d, qh = 16, s.num_kv_heads, s.head_dim, s.num_heads
    per_seq = context // bs
    nb = m * per_seq + 1
    kc = torch.randn(nb, bs, kvh, d, device=device, dtype=dtype)
    vc = torch.randn(nb, bs, kvh, d, device=device, dtype=dtype)
    tables = torch.randperm(nb - 1, device=device)[:m * per_seq].view(m, per_seq).to(torch.int32)
    seq_lens = torch.full((m,), context, device=device, dtype=torch.int32)
    qsl = torch.arange(m + 1, device=device, dtype=torch.int32)
    q = torch.randn(m, qh, d, device=device, dtype=dtype)
    sinks = torch.randn(qh, device=device)
    scale = d ** -0.5
    new_k, new_v = torch.randn(m, kvh, d, device=device, dtype=dtype), torch.randn(m, kvh, d, device=device,
                                                                                    dtype=dtype)
    slots = (tables[:, -1].long() * bs + bs - 1).to(torch.int32)

    def check_cache() -> float:
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        reshape_and_cache(new_k, new_v, k1, v1, slots)
        reference.reshape_and_cache(new_k, new_v, k2, v2, slots)
        return rel_error(torch.cat([k1, v1]), torch.cat([k2, v2]))

    def check_align() -> float:
        got = moe_align_lora(ids, idx, s.num_experts, 8, 16)
        want = reference_lora.moe_align_lora(ids, idx, s.num_experts, 8, 16)
        return 0.0 if all(torch.equal(a, b) for a, b in zip(got, want)) else 1.0

    def check_align_pair() -> float:
        base, lora = moe_align_pair(ids, idx, s.num_experts, 8, 64, 16)
        want = (*reference_lora.moe_align(ids, s.num_experts, 64),
                *reference_lora.moe_align_lora(ids, idx, s.num_experts, 8, 16))
        return 0.0 if all(torch.equal(a, b) for a, b in zip((*base, *lora), want)) else 1.0

    # rope + cache write on the strided views of a fused qkv output, positions anywhere in a table of 4096
    qkv = torch.randn(m, (qh + 2 * kvh) * d, device=device, dtype=dtype)
    rq, rk, rv = (t.reshape(m, -1, d) for t in qkv.split(list(s.qkv_slices), dim=-1))
    rope_pos = torch.randint(0, 4096, (m,), device=device)
    rope_table = torch.randn(4096, d, device=device)

    def check_rope_cache() -> float:
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        q1 = rotary_embedding_and_cache(rope_pos, rq, rk, rv, rope_table, k1, v1, slots)
        q2 = reference.rotary_embedding_and_cache(rope_pos, rq, rk, rv, rope_table, k2, v2, slots)
        return max(rel_error(q1, q2), rel_error(torch.cat([k1, v1]), torch.cat([k2, v2])))

    attn_kw = dict(sinks=sinks)
    return [
        Case("", "rms_norm+residual", m, {}, lambda cfg: rms_norm(x, w, 1e-5, res),
             lambda: max(rel_error(a, b) for a, b in zip(rms_norm(x, w, 1e-5, res),
                                                         reference.rms_norm(x, w, 1e-5, res))),
             nbytes=4 * _nbytes(x) + _nbytes(w)),
        Case("", "swiglu_clamp_and_mul", m, {}, lambda cfg: swiglu_clamp_and_mul(g, 1.702, 7.0),
             lambda: rel_error(swiglu_clamp_and_mul(g, 1.702, 7.0), reference.swiglu_clamp_and_mul(g, 1.702, 7.0)),
             nbytes=_nbytes(g) * 3 // 2),
        Case("", "moe_align_lora", m, {}, lambda cfg: moe_align_lora(ids, idx, s.num_experts, 8, 16), check_align,
             nbytes=_nbytes(ids, idx)),
        Case("", "moe_align_pair", m, {}, lambda cfg: moe_align_pair(ids, idx, s.num_experts, 8, 64, 16),
             check_align_pair, nbytes=_nbytes(ids, idx)),
        Case("", "reshape_and_cache", m, {}, lambda cfg: reshape_and_cache(new_k, new_v, kc, vc, slots),
             check_cache, nbytes=4 * _nbytes(new_k)),
        Case("", "rotary_embedding_and_cache", m, {},
             lambda cfg: rotary_embedding_and_cache(rope_pos, rq, rk, rv, rope_table, kc, vc, slots),
             check_rope_cache, nbytes=2 * _nbytes(qkv) + m * d * 4 + _nbytes(rope_pos)),
        Case("", f"paged_attention[decode ctx={context}]", m, {},
             lambda cfg: paged_attention(q, kc, vc, tables, seq_lens, qsl, scale, **attn_kw),
             lambda: rel_error(paged_attention(q, kc, vc, tables, seq_lens, qsl, scale, **attn_kw),
                               reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale, **attn_kw)),
             nbytes=2 * m * context * kvh * d * kc.element_size() + 2 * _nbytes(q)),
    ] + routing_and_rope_cases(s, m, dtype, device)


def shared_metadata_cases(s: ModelShapes, m: int, max_loras: "int | AdapterMix", rank: int, dtype,
                          device) -> list[Case]:
    """The LoRA ops as a step should run them, metadata computed once and shared (``segments=`` per step for the
    dense ops, ``align=`` per MoE layer for gate_up and down): kernel time alone, for the benchmark; plus that
    metadata (``lora_segments``). Op names are empty (the tuner skips them); ``default`` is set so the
    benchmark still compares the tuned config (``run(None)``) with the default."""
    from loraplex.kernels.lora_shrink import lora_segments

    idx = adapter_indices(m, max_loras, device)
    slots = as_mix(max_loras).slots
    want = torch.argsort(torch.where(idx < 0, slots, idx), stable=True)
    segments = Case("", "lora_segments", m, {}, lambda cfg: lora_segments(idx, slots),
                    lambda: 0.0 if torch.equal(lora_segments(idx, slots)[0][:m].long(), want) else 1.0,
                    nbytes=_nbytes(idx) * 2)
    return ([segments] + dense_lora_cases(s, m, max_loras, rank, dtype, device, shared_metadata=True)
            + moe_lora_cases(s, m, max_loras, rank, dtype, device, shared_metadata=True))


TUNED_OPS = ("fused_moe", "fused_moe_int8", "fused_moe_mxfp4", "lora_shrink_expand", "lora_shrink", "lora_expand",
             "fused_moe_lora")


DENSE_LORA_TARGETS = ("qkv", "o")  # the attention projections whose LoRA the dense LoRA ops run


def tunable_cases(s: ModelShapes, m: int, max_loras: "int | AdapterMix", rank: int, dtype, device, *,
                  ops: "set[str] | None" = None,
                  lora_targets: "tuple[str, ...]" = DENSE_LORA_TARGETS) -> list[Case]:
    """The tuner's cases at M: every op of TUNED_OPS (``ops``: only these; the other inputs are not built). The
    dense LoRA ops run on each projection of ``lora_targets`` (qkv, o); ``max_loras`` is the LoRA ops'
    ``AdapterMix`` (an unknown target: ``dense_lora_cases``' ValueError)."""
    want = lambda *names: ops is None or any(o in ops for o in names)  # noqa: E731
    cases = []
    for weights, op in (("float", "fused_moe"), ("int8", "fused_moe_int8"), ("mxfp4", "fused_moe_mxfp4")):
        if want(op):
            cases += moe_cases(s, m, dtype, device, weights=weights)
    if want("lora_shrink_expand", "lora_shrink", "lora_expand"):
        for target in lora_targets:
            cases += dense_lora_cases(s, m, max_loras, rank, dtype, device, target=target)
    if want("fused_moe_lora"):
        cases += moe_lora_cases(s, m, max_loras, rank, dtype, device)
    return [c for c in cases if ops is None or c.op in ops]


_FLUSH: dict[str, Any] = {}  # device -> (buffer larger than L2, its read time in ms)


def _graph_ms(fn: Callable[[], Any], n: int, flush: Callable[[], Any] | None = None) -> float:
    """Median over 7 replays of one CUDA graph holding ``n`` x (flush; fn), per iteration, in ms."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured on torch's side stream, replayed on the current one
        for _ in range(n):
            if flush is not None:
                flush()
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    del graph
    return sorted(times)[len(times) // 2]


def _l2_flush() -> tuple[Callable[[], Any], float]:
    """A read of 4x the L2 size (evicts every line, no write-backs) and a first estimate of its time in ms (for
    sizing graphs only: ``bench_time_ms`` measures the flush again beside each op)."""
    dev = str(torch.cuda.current_device())
    if dev not in _FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(), "L2_cache_size", 0) or 64 << 20
        buf = torch.ones(l2, dtype=torch.float32, device="cuda")  # 4 bytes per element: 4x the L2
        flush = lambda: buf.sum()  # noqa: E731
        flush()
        _FLUSH[dev] = (flush, _graph_ms(flush, 20))
    return _FLUSH[dev]


def bench_time_ms(fn: Callable[[], Any], rep_ms: int = 20, *, cold: bool = True, strict: bool = False) -> float:
    """Device time of one call by CUDA-graph replay (no launch gaps, as the engine replays decode steps).

    ``cold``: each call in the graph follows a read of 4x the L2 size and that read's own graph time is
    subtracted, so weights come from HBM as in the engine, where every other layer's weights pass through L2
    between two calls of one layer's op (``cold=False``: back-to-back calls, small weights stay in L2).
    A call that cannot be captured falls back to plain timing with triton's L2 clearing, unless ``strict``
    (the tuner: a config that breaks capture would break the engine's graphs too).
    """
    fn()
    torch.cuda.synchronize()
    try:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        estimate = max(start.elapsed_time(end) / 5, 1e-3)
        if not cold:
            return _graph_ms(fn, max(1, min(500, int(rep_ms / estimate))))
        flush, flush_estimate = _l2_flush()
        n = max(1, min(100, int(rep_ms / (estimate + flush_estimate))))
        # the flush's own time is measured again next to each op (same n, same clocks): a figure cached at the
        # first call was measured before the GPU's clocks settled and over-subtracted a constant ~7 us
        return max(_graph_ms(fn, n, flush) - _graph_ms(flush, n), 0.0)
    except Exception:  # noqa: BLE001  (an op that cannot be captured)
        if strict:
            raise
        import triton.testing

        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=5, rep=rep_ms))
