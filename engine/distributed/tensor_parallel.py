"""``apply_tp``: shard a built model in place for one tensor-parallel rank (gpt-fast style: the model files know
nothing of TP; this transform swaps their parameters for this rank's slices and hooks the all-reduces in).

Shape legend: T tokens, H hidden, Q query heads, KV kv heads, D head dim, I intermediate, E experts, tp ranks.

    self_attn.qkv_proj   column-parallel  [Q·D + 2·KV·D, H] -> [(Q + 2·KV_local)·D / .., H]   q, k, v heads of this rank
    self_attn.o_proj     row-parallel     [H, Q·D] -> [H, Q·D/tp]         (bias on rank 0 only)
    self_attn            all-reduce of its output [T, H]
    mlp.gate_up_proj     column-parallel  [2I, H] -> [2I/tp, H]           this rank's gate rows, then its up rows
    mlp.down_proj        row-parallel     [H, I] -> [H, I/tp]             (bias on rank 0 only)
    mlp.experts          every expert on every rank, split along I:  w13 [E, 2I/tp, H], w2 [E, H, I/tp],
                         b13 [E, 2I/tp], b2 [E, H] on rank 0 (zero elsewhere); the router is replicated
                         (MXFP4 experts of a quantised checkpoint: the same split of their codes and scales)
    mlp                  all-reduce of its output [T, H] (one per layer, dense or MoE)
    sinks                this rank's q heads; q_norm / k_norm (per head) and embeddings / lm_head replicated

Because every rank ends a layer with the same all-reduced hidden state, the replicated router picks the same
experts on every rank and rank 0's lm_head alone gives the logits. The KV cache of a rank holds its KV_local
heads only. LoRA (``lora.py``) must be attached after this transform: its slot buffers take the sharded sizes.
"""
from __future__ import annotations

import torch
from torch import nn

from loraplex.engine.config import ModelConfig
from loraplex.engine.distributed.parallel_state import TensorParallel
from loraplex.engine.distributed.sharding import ShardPlan, shard_plan
from loraplex.engine.models.layers.attention import Attention
from loraplex.engine.models.layers.linear import Linear
from loraplex.engine.models.layers.mlp import GatedMLP
from loraplex.engine.models.layers.moe import FusedExperts, SparseMoE


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _column_parallel(lin: Linear, rows: torch.Tensor, output_sizes: list[int]) -> None:
    """Keep output ``rows`` of ``lin`` (fused slices shrink to ``output_sizes``)."""
    rows = rows.to(lin.weight.device)
    lin.weight = _param(lin.weight.data[rows])
    if lin.bias is not None:
        lin.bias = _param(lin.bias.data[rows])
    lin.out_features, lin.output_sizes = len(rows), list(output_sizes)


def _row_parallel(lin: Linear, cols: torch.Tensor, rank: int) -> None:
    """Keep input columns ``cols`` of ``lin``; its bias is added once, by rank 0, before the all-reduce."""
    lin.weight = _param(lin.weight.data[:, cols.to(lin.weight.device)])
    lin.in_features = len(cols)
    if lin.bias is not None and rank != 0:
        lin.bias.data.zero_()


def _shard_attention(attn: Attention, plan: ShardPlan) -> None:
    cfg = plan.cfg
    q_rows, kv_rows = plan.q_rows, plan.kv_rows
    qkv_rows = torch.cat((q_rows, cfg.q_size + kv_rows, cfg.q_size + cfg.kv_size + kv_rows))
    _column_parallel(attn.qkv_proj, qkv_rows, [len(q_rows), len(kv_rows), len(kv_rows)])
    _row_parallel(attn.o_proj, q_rows, plan.rank)
    attn.num_heads, attn.num_kv_heads = plan.num_heads, plan.num_kv_heads
    attn.q_size, attn.kv_size = len(q_rows), len(kv_rows)
    if attn.sinks is not None:
        attn.sinks = _param(attn.sinks.data[plan.q_heads.to(attn.sinks.device)])


def _shard_dense_mlp(mlp: GatedMLP, plan: ShardPlan) -> None:
    size = mlp.down_proj.in_features
    rows = plan.gate_up_rows(size)
    _column_parallel(mlp.gate_up_proj, rows, [size // plan.world_size] * 2)
    _row_parallel(mlp.down_proj, plan.inter_rows(size), plan.rank)


def _shard_experts(ex: FusedExperts, plan: ShardPlan) -> None:
    size = ex.intermediate_size
    rows = plan.gate_up_rows(size).to(ex.w13.device)
    cols = plan.inter_rows(size).to(ex.w2.device)
    ex.w13 = _param(ex.w13.data[:, rows])
    ex.w2 = _param(ex.w2.data[:, :, cols])
    if ex.b13 is not None:
        ex.b13 = _param(ex.b13.data[:, rows])
    if ex.b2 is not None and plan.rank != 0:
        ex.b2.data.zero_()
    ex.intermediate_size = size // plan.world_size


def _shard_quantized_experts(ex: FusedExperts, plan: ShardPlan) -> FusedExperts:
    """MXFP4 experts of a quantised checkpoint: the same split, on the codes (I per rank a multiple of 32)."""
    size = ex.intermediate_size
    q = ex.shard_intermediate(plan.gate_up_rows(size), plan.inter_rows(size))
    if q.b2 is not None and plan.rank != 0:
        q.b2.data.zero_()
    return q


def _all_reduce_hook(tp: TensorParallel):
    def hook(_module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(output)
    return hook


def apply_tp(model: nn.Module, model_config: ModelConfig, tp: TensorParallel) -> ShardPlan:
    """Shard ``model`` (a CausalLM built and loaded at full size, no LoRA attached yet) in place for ``tp.rank``
    and register the all-reduce after each attention and each MLP. Returns the plan (what this rank keeps).
    Raises TensorParallelError when the model cannot be split over ``tp.world_size`` ranks."""
    plan = shard_plan(model_config, tp.rank, tp.world_size)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn.qkv_proj) is not Linear or type(attn.o_proj) is not Linear:
            raise RuntimeError("apply_tp must run before LoRA is attached (the slot buffers take the shard sizes)")
        _shard_attention(attn, plan)
        if isinstance(mlp, SparseMoE) and hasattr(mlp.experts, "shard_intermediate"):
            mlp.experts = _shard_quantized_experts(mlp.experts, plan)
        elif isinstance(mlp, SparseMoE):
            _shard_experts(mlp.experts, plan)
        else:
            _shard_dense_mlp(mlp, plan)
        attn.register_forward_hook(_all_reduce_hook(tp))
        mlp.register_forward_hook(_all_reduce_hook(tp))
    model.tp_plan = plan
    return plan


__all__ = ["apply_tp"]
