"""The CPU block pool for swap preemption, and the rule that picks swap or recompute (torch-free).

    GPU tables (group of 3 sequences)        CPU tables after swap_out         back on the GPU after swap_in
    s1: [ g4 | g9 | g2 ]                      s1: [ c0 | c1 | c2 ]              s1: [ g7 | g3 | g5 ]
    s2: [ g4 | g9 | g6 ]   g4, g9 ref 3  -->  s2: [ c0 | c1 | c3 ]  c0, c1 -->  s2: [ g7 | g3 | g8 ]   g7, g3 ref 3
    s3: [ g4 | g9 | g1 ]                      s3: [ c0 | c1 | c4 ]   ref 3      s3: [ g7 | g3 | g0 ]

A GPU block shared by k sequences of the group maps to one CPU block with k references, and back to one GPU
block with k references: sharing survives the round trip. Only blocks that hold computed tokens move.
The manager (``KVCacheManager.swap_out`` / ``swap_in``) does the bookkeeping; the model runner copies the data:
per step, swap-outs first, then swap-ins, then copy-on-write copies, then the forward pass.
"""
from __future__ import annotations

from typing import Literal

from loraplex.engine.kv_cache.block_pool import BlockPool

PreemptionMode = Literal["recompute", "swap"]
PREEMPTION_MODES = ("recompute", "swap", "auto")


class SwapSpace:
    """``num_cpu_blocks`` host blocks (ref counts and a free queue, no hashes) and the swapped sequences' tables."""

    def __init__(self, num_cpu_blocks: int, block_size: int) -> None:
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.num_blocks = num_cpu_blocks
        self.pool = BlockPool(num_cpu_blocks, block_size) if num_cpu_blocks else None
        self.tables: dict[int, list[int]] = {}  # seq_id -> CPU block ids of a swapped-out sequence

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks if self.pool is not None else 0

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def store(self, tables: dict[int, list[int]]) -> list[tuple[int, int]]:
        """Give each distinct GPU block of ``tables`` (seq_id -> GPU ids) one CPU block, referenced once per
        sequence that holds it. Returns the distinct ``(gpu, cpu)`` pairs, in first-seen order."""
        mapping: dict[int, int] = {}
        need = len({b for t in tables.values() for b in t})
        if need > self.num_free_blocks:
            raise RuntimeError(f"swap out needs {need} CPU blocks, {self.num_free_blocks} free; check can_swap_out")
        for seq_id, gpu_table in tables.items():
            cpu_table = []
            for g in gpu_table:
                if g in mapping:
                    self.pool.touch([mapping[g]])
                else:
                    mapping[g] = self.pool.allocate(1)[0]
                cpu_table.append(mapping[g])
            self.tables[seq_id] = cpu_table
        return list(mapping.items())

    def release(self, seq_id: int) -> list[int]:
        """Drop a swapped sequence's CPU references (after swap in, or abort); returns its CPU table."""
        table = self.tables.pop(seq_id, [])
        if table:
            self.pool.release(list(reversed(table)))
        return table

    def check_invariants(self) -> None:
        """CPU ref counts == occurrences in CPU tables; free queue == blocks with ref 0."""
        if self.pool is None:
            if self.tables:
                raise AssertionError(f"{len(self.tables)} swapped tables but no CPU pool")
            return
        counts = [0] * self.num_blocks
        for seq_id, table in self.tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"swapped sequence {seq_id} holds a CPU block twice: {table}")
            for b in table:
                counts[b] += 1
        for block in self.pool.blocks:
            if block.ref_cnt != counts[block.block_id]:
                raise AssertionError(f"CPU block {block.block_id}: ref count {block.ref_cnt}, "
                                     f"but {counts[block.block_id]} swapped tables hold it")
        self.pool.check_invariants()


def choose_preemption_mode(mode: str, *, num_seqs: int, num_computed_tokens: int, can_swap_out: bool,
                           recompute_below_tokens: int = 512) -> PreemptionMode:
    """How to preempt a group: ``mode`` is the setting ("recompute", "swap" or "auto").

    "swap" swaps when the CPU pool has room and falls back to recompute otherwise (so a small CPU pool never
    stalls the engine). "auto" (vLLM's reasoning): recomputing a short sequence is cheap — its prefill runs at
    full GPU efficiency — while swapping is bound by host-link bandwidth; recomputing a long one costs a long
    prefill, and recomputing a group of forked sequences (n > 1, beams) loses their block sharing and redoes
    every sequence's output tokens. So swap when the CPU pool has room and the group has several unfinished
    sequences or at least ``recompute_below_tokens`` computed tokens (summed over its sequences); recompute
    otherwise.
    """
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption mode must be one of {', '.join(PREEMPTION_MODES)}, got {mode!r}")
    if mode == "recompute" or not can_swap_out:
        return "recompute"
    if mode == "swap":
        return "swap"
    return "swap" if num_seqs > 1 or num_computed_tokens >= recompute_below_tokens else "recompute"
