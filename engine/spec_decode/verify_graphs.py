"""Verify steps through the decode path's static buffers and CUDA graphs (``SpeculativeConfig.verify_cuda_graphs``).

A verify step of B sequences with k drafts each computes B x (k + 1) tokens. Row j of sequence s (position
start_s + j) needs keys 0 .. start_s + j: a one-token decode at that position over the same block table. So the
step is a decode step of B x (k + 1) rows, and ``DecodeGraphs`` (cuda_graphs.py) serves it unchanged:

    seq s: [ x  d1  d2  d3 ]  at positions p .. p+3   ->   rows (s, p, x), (s, p+1, d1), (s, p+2, d2), (s, p+3, d3)
    every row's K/V is written (reshape_and_cache, all rows) before any row's attention reads, in every layer

``VerifyGraphs`` is a second ``DecodeGraphs`` of the same runner whose buckets go past the decode graphs' largest
(up to ``verify_graph_max_rows``): a step of at most that many rows replays the decode graph (when it fits) or
one of these. Graphs are captured on CUDA with tensor_parallel_size 1 and enforce_eager off; elsewhere the same
padded path runs eagerly (how the CPU tests prove it token-identical to the eager multi-token forward).

``run_rows`` writes the static buffers a sequence at a time (its rows are consecutive positions over one block
table: numpy slices, no Python object per row), the same values ``DecodeGraphs._write_inputs`` writes row by row.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from loraplex.engine.cuda_graphs import DecodeGraphs, batch_buckets

logger = logging.getLogger(__name__)


class VerifyGraphs(DecodeGraphs):
    """Buckets of ``batch_buckets(max_rows)`` above ``skip_up_to`` (those the decode graphs already cover)."""

    def __init__(self, runner, max_rows: int, max_model_len: int, *, capture: bool, skip_up_to: int = 0) -> None:
        super().__init__(runner, max_rows, max_model_len, capture=capture)
        self.buckets = [b for b in batch_buckets(max_rows) if b > skip_up_to] or [max_rows]


def make_verify_graphs(runner, max_rows: int, max_model_len: int) -> tuple[VerifyGraphs | None, DecodeGraphs | None]:
    """(the verify graphs, the decode graphs to use for steps that fit them). On CUDA with graphs enabled the
    buckets above the decode graphs' are captured; a failed capture leaves verify steps eager (None)."""
    decode = runner.decode_graphs
    capture = runner.graphs_enabled() and decode is not None and decode.capture
    skip = decode.max_batch_size if capture and decode.num_graphs else 0
    if capture and skip >= max_rows:
        return None, decode  # the decode graphs already serve every verify step that fits a graph
    graphs = VerifyGraphs(runner, max_rows, max_model_len, capture=capture, skip_up_to=skip)
    if capture and not graphs.capture_all():
        logger.warning("verify CUDA graphs could not be captured: verify steps run eagerly")
        return None, decode
    return graphs, decode if capture else None


def can_run_rows(graphs: DecodeGraphs, entries: list[tuple[list[int], int, list[int]]]) -> bool:
    """Whether ``graphs`` serves the flattened rows of ``entries`` (token_ids, start, block_ids)."""
    if graphs.capture and not graphs.num_graphs:
        return False
    return (0 < sum(len(t) for t, _, _ in entries) <= graphs.max_batch_size
            and all(len(blocks) <= graphs.max_blocks for _, _, blocks in entries))


def run_rows(graphs: DecodeGraphs, entries: list[tuple[list[int], int, list[int]]], row_slots: list[int],
             lora) -> torch.Tensor:
    """Hidden [R, H] of the R = sum(len(token_ids)) rows of ``entries`` in order: entry i's token j is a one-token
    decode at position start_i + j over block_ids_i (module docstring). ``row_slots[i]``: entry i's LoRA step slot
    input (its adapter's slot, -1: base)."""
    n = sum(len(t) for t, _, _ in entries)
    b = graphs.bucket_for(n)
    if graphs._copied is not None:
        graphs._copied.synchronize()  # the previous step's copy has read the pinned buffers
    B, W, bs = graphs.max_batch_size, graphs.max_blocks, graphs.runner.block_size
    h64, h32 = graphs._h64, graphs._h32
    ids, pos, slots, src = h64[:B], h64[B:2 * B], h64[2 * B:3 * B], h64[3 * B:]
    seq_lens, lora_idx = h32[:B], h32[2 * B + 1:3 * B + 1]
    tables = h32[3 * B + 1:].reshape(B, W)
    tables[:b] = 0
    per_row_slots: list[int] = []
    r = 0
    for (tokens, start, blocks), slot in zip(entries, row_slots):
        k = len(tokens)
        p = np.arange(start, start + k)
        table = np.asarray(blocks, dtype=np.int64)
        ids[r:r + k] = tokens
        pos[r:r + k] = p
        slots[r:r + k] = table[p // bs] * bs + p % bs
        seq_lens[r:r + k] = p + 1
        tables[r:r + k, :len(blocks)] = table
        per_row_slots += [slot] * k
        r += k
    src[:b] = -1
    if any(c >= 0 for c in row_slots):
        if lora is None:
            raise ValueError("a verify step has adapter slots but LoRA is not attached")
        lora_idx[:n] = lora.step_indices(per_row_slots)  # writes the step's LoRA table too
    else:
        lora_idx[:n] = -1
    ids[n:b], pos[n:b], slots[n:b], seq_lens[n:b], lora_idx[n:b] = 0, 0, -1, 0, -1
    nb = graphs._dev64.is_cuda
    graphs._dev64.copy_(graphs._host64, non_blocking=nb)
    used = 3 * B + 1 + b * W
    graphs._dev32[:used].copy_(graphs._host32[:used], non_blocking=nb)
    if nb:
        if graphs._copied is None:
            graphs._copied = torch.cuda.Event()
        graphs._copied.record()
    graphs.num_steps += 1
    if graphs.capture:
        graphs._graphs[b].replay()
        return graphs._outputs[b][:n]
    return graphs._forward(b)[:n]
