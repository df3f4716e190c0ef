"""Multi-LoRA on a tensor-parallel rank: the slots are the ordinary ``LoRASlots`` built on the sharded model (so
their table entries take the shard sizes), and every adapter is cut to this rank's part on its way in.

Shape legend: r rank, E experts, K in, N out (full sizes; the plan of ``sharding.py`` picks the part).

    column-parallel targets (q_proj, k_proj, v_proj, gate_proj, up_proj, experts.gate_up_proj):
        lora_a [r, K] replicated,   lora_b [N, r] -> this rank's output rows (the same rows as the base weight)
    row-parallel targets (o_proj, down_proj, experts.down_proj):
        lora_a [r, K] -> this rank's input columns,   lora_b [N, r] replicated
        each rank adds B·(A_part·x_part) to its partial output; the layer's all-reduce sums the parts, so the
        delta joins the base output before the reduction, exactly once.

Every rank holds the same adapter in the same slot: rank 0's ``TPLoRASlots`` records each load / clear /
token map in ``journal`` (full weights, CPU), and the workers replay the journal before the step's forward.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from loraplex.engine.distributed.sharding import ShardPlan
from loraplex.engine.lora.slots import LoRASlots
from loraplex.engine.lora.weights import AdapterWeights, LoraTensors

COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
                   "mlp.experts.gate_up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj", "mlp.experts.down_proj")


def _rows_of(plan: ShardPlan, target: str) -> torch.Tensor:
    """The full-size output rows (column-parallel) or input columns (row-parallel) of ``target`` on this rank."""
    cfg = plan.cfg
    if target in ("self_attn.q_proj", "self_attn.o_proj"):
        return plan.q_rows
    if target in ("self_attn.k_proj", "self_attn.v_proj"):
        return plan.kv_rows
    if target in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        return plan.inter_rows(cfg.intermediate_size)
    if target == "mlp.experts.gate_up_proj":
        return plan.gate_up_rows(cfg.moe_intermediate_size)
    if target == "mlp.experts.down_proj":
        return plan.inter_rows(cfg.moe_intermediate_size)
    raise ValueError(f"no tensor-parallel layout for LoRA target {target!r}")


def shard_lora_tensors(t: LoraTensors, target: str, plan: ShardPlan) -> LoraTensors:
    """This rank's part of one module's factors (plain [r, K] / [N, r] or experts [E, r, K] / [E, N, r])."""
    idx = _rows_of(plan, target).to(t.lora_a.device)
    if target in COLUMN_PARALLEL:
        return LoraTensors(lora_a=t.lora_a, lora_b=t.lora_b.index_select(-2, idx).contiguous())
    return LoraTensors(lora_a=t.lora_a.index_select(-1, idx).contiguous(), lora_b=t.lora_b)


def shard_adapter_weights(weights: AdapterWeights, plan: ShardPlan) -> AdapterWeights:
    """``weights`` (full sizes, as ``load_adapter_weights`` returns them) cut to rank ``plan.rank``'s part."""
    if plan.world_size == 1:
        return weights
    modules = {key: shard_lora_tensors(t, key[1], plan) for key, t in weights.modules.items()}
    nbytes = sum(t.lora_a.nbytes + t.lora_b.nbytes for t in modules.values())
    return replace(weights, modules=modules, nbytes=nbytes, flat=None).pack()


class TPLoRASlots(LoRASlots):
    """``LoRASlots`` of one rank: ``load`` takes full-size weights and keeps this rank's part.

    ``journal`` (rank 0 only) receives ``("load", slot, weights)``, ``("clear", slot)`` and
    ``("tokens", token_lora_idx | None)`` in call order, for the workers to replay."""

    def __init__(self, model, model_config, *, plan: ShardPlan, journal: Callable[[tuple], None] | None = None,
                 **kwargs) -> None:
        self.plan, self._journal, self._in_load = plan, journal, False
        super().__init__(model, model_config, **kwargs)

    def _record(self, entry: tuple) -> None:
        if self._journal is not None and not self._in_load:
            self._journal(entry)

    def prepare(self, weights: AdapterWeights) -> AdapterWeights:
        return shard_adapter_weights(weights, self.plan)

    def footprint(self, weights: AdapterWeights) -> int:
        return super().footprint(self.prepare(weights))  # this rank's part (rank 0 accounts; every rank alike)

    def load(self, slot: int, weights: AdapterWeights):
        self._in_load = True  # its inner clear() is part of the load, not an entry of its own
        try:
            handle = super().load(slot, weights)
        finally:
            self._in_load = False
        self._record(("load", slot, weights))
        return handle

    def clear(self, slot: int) -> None:
        super().clear(slot)
        self._record(("clear", slot))

    def set_token_slots(self, token_lora_idx: torch.Tensor | None) -> None:
        super().set_token_slots(token_lora_idx)
        self._record(("tokens", None if token_lora_idx is None else token_lora_idx.cpu()))

    def replay(self, entry: tuple) -> None:
        """Apply one journal entry of rank 0 (on a worker)."""
        kind = entry[0]
        if kind == "load":
            self.load(entry[1], entry[2])
        elif kind == "clear":
            self.clear(entry[1])
        elif kind == "tokens":
            self.set_token_slots(entry[1])
        else:
            raise ValueError(f"unknown LoRA journal entry {kind!r}")


__all__ = ["TPLoRASlots", "shard_adapter_weights", "shard_lora_tensors", "COLUMN_PARALLEL", "ROW_PARALLEL"]
