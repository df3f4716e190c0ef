"""Which part of every weight a tensor-parallel rank keeps: pure index arithmetic, shared by the model transform
(``tensor_parallel.py``) and the LoRA slots (``lora.py``) so the two can never disagree.

Shape legend: Q query heads, KV kv heads, D head dim, I intermediate (dense or per expert), tp world size.

    attention   rank r keeps q heads [r·Q/tp, (r+1)·Q/tp) and the kv heads those q heads read:
                KV % tp == 0  ->  kv heads [r·KV/tp, (r+1)·KV/tp)           (each kv head on one rank)
                tp % KV == 0  ->  kv head  r // (tp/KV)                      (replicated on tp/KV ranks)
    MLP/experts rank r keeps intermediate rows [r·I/tp, (r+1)·I/tp) of gate AND of up (and those columns of down)

    fused qkv rows, tp = 2, Q = 6, KV = 2, D = 1:    [ q0 q1 q2 | q3 q4 q5 | k0 | k1 | v0 | v1 ]
                                         rank 0:     [ q0 q1 q2 | k0 | v0 ]    rank 1: [ q3 q4 q5 | k1 | v1 ]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engine.config import ModelConfig


class TensorParallelError(ValueError):
    """A model that cannot be split over this many ranks; the message names the dimension and the sizes that fit."""


@dataclass(frozen=True)
class ShardPlan:
    """The slices rank ``rank`` of ``world_size`` keeps of a model with config ``cfg``."""

    cfg: ModelConfig
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        cfg, tp = self.cfg, self.world_size
        if not 0 <= self.rank < tp:
            raise TensorParallelError(f"rank {self.rank} is outside a tensor-parallel world of size {tp}")
        if cfg.num_heads % tp:
            raise TensorParallelError(f"num_attention_heads ({cfg.num_heads}) is not divisible by "
                                      f"tensor_parallel_size={tp}; use a divisor of {cfg.num_heads}")
        if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            raise TensorParallelError(f"num_key_value_heads ({cfg.num_kv_heads}) and tensor_parallel_size={tp}: one "
                                      "must divide the other (kv heads are split, or replicated when tp > kv heads)")
        dense = any(not (cfg.is_moe and cfg.is_moe_layer(i)) for i in range(cfg.num_layers))
        for name, size, used in (("intermediate_size", cfg.intermediate_size, dense),
                                 ("moe_intermediate_size", cfg.moe_intermediate_size, cfg.is_moe)):
            if used and size % tp:
                raise TensorParallelError(f"{name} ({size}) is not divisible by tensor_parallel_size={tp}")

    # ---- attention -------------------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.cfg.num_heads // self.world_size

    @property
    def q_heads(self) -> torch.Tensor:
        """Global indices of this rank's query heads [Q/tp]."""
        return torch.arange(self.rank * self.num_heads, (self.rank + 1) * self.num_heads)

    @property
    def kv_heads(self) -> torch.Tensor:
        """Global indices of the kv heads this rank's query heads read [max(1, KV/tp)]."""
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        return torch.unique(self.q_heads // group)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.numel()

    @property
    def kv_replicated(self) -> bool:
        """True when tp > kv heads: every kv head lives on tp / KV ranks (its K/V computed and cached on each)."""
        return self.world_size > self.cfg.num_kv_heads

    def _head_rows(self, heads: torch.Tensor) -> torch.Tensor:
        d = self.cfg.head_dim
        return (heads[:, None] * d + torch.arange(d)[None, :]).reshape(-1)

    @property
    def q_rows(self) -> torch.Tensor:
        """Rows of q_proj (= columns of o_proj) this rank keeps [Q/tp · D]."""
        return self._head_rows(self.q_heads)

    @property
    def kv_rows(self) -> torch.Tensor:
        """Rows of k_proj and of v_proj this rank keeps [KV_local · D]."""
        return self._head_rows(self.kv_heads)

    # ---- MLP and experts -------------------------------------------------------------------------------------
    def inter_rows(self, size: int) -> torch.Tensor:
        """This rank's part of an intermediate dimension of ``size`` (rows of gate or of up, columns of down)."""
        n = size // self.world_size
        return torch.arange(self.rank * n, (self.rank + 1) * n)

    def gate_up_rows(self, size: int) -> torch.Tensor:
        """Rows of a fused [gate; up] weight with ``size`` rows per half: this rank's gate rows, then its up rows."""
        mine = self.inter_rows(size)
        return torch.cat((mine, mine + size))


def shard_plan(cfg: ModelConfig, rank: int, world_size: int) -> ShardPlan:
    """The plan of ``rank``; raises TensorParallelError when ``cfg`` cannot be split over ``world_size`` ranks."""
    return ShardPlan(cfg, rank, world_size)


__all__ = ["ShardPlan", "TensorParallelError", "shard_plan"]
