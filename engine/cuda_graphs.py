"""Decode steps padded to a batch-size bucket and run from static device buffers; on CUDA one graph per bucket.

    pure-decode step of n sequences ──▶ bucket b = smallest bucket >= n
        host (pinned) buffers ── 2 copies ──▶ static device buffers (rows n..b-1 padded) ──▶ graph[b].replay()
        ──▶ hidden[:n]   (logits and sampling stay outside the graph)

Static buffers (B = largest bucket, W = ceil(max_model_len / block_size)), in two packed device tensors so a
step makes one host->device copy per dtype:

    int64  [4B]           input_ids [B] | positions [B] | slot_mapping [B] | pending_rows [B]
                                                                    (pad: 0 | 0 | -1 | -1)
    int32  [3B+1+B*W]     seq_lens [B] | query_start_loc [B+1] | token_lora_idx [B] | block_tables [B, W]
                                                                    (pad: 0 | arange, fixed | -1 | 0)

A padded row is a sequence of one query token with context length 0: the KV-cache write skips its slot (-1),
paged attention (Triton and the torch reference) reads no key and writes zeros, LoRA gives it no delta (-1);
its hidden row is discarded. So a graph serves base and adapter requests alike: token -> step-slot indices, the
step's LoRA table (where each adapter's factors are, ``lora/step_table.py``, written in place before the replay)
and block tables are graph inputs, never captured constants, and the LoRA kernels are always in the graph
(``LoRAState.always_on``; base tokens have index -1, a module an adapter does not target has rank 0). The graph
of bucket b is captured for min(b, max_step_slots) step slots: a batch of b rows has at most b adapters.

Overlapped steps (engine/step_pipeline.py): a row whose input token is still on the device (pending) gets its id
from the previous step's sampled-token tensor, by a gather on the device after the copy and before the replay:

    input_ids[i] = prev_tokens[pending_rows[i]]   where pending_rows[i] >= 0 (else the id copied from the host)

Graphable step: every scheduled sequence computes exactly one token, no prompt logprobs, at most B sequences
and block tables of at most W blocks. Graphs are captured only on CUDA with tensor_parallel_size == 1 and
enforce_eager off; ``capture=False`` runs the same padded path eagerly (CPU tests prove it token-identical).

Capture (graph_capture.py) runs at start, largest bucket first (its memory pool then serves the smaller ones),
then the smallest upwards, within ``capture_budget_s``: a bucket left out when the budget runs out is served by
the next larger captured one (more padded rows, same result). The log line gives the buckets, the time and the
pool's size. Steps with prefill chunks have their own padded path (mixed_graphs.py).
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from loraplex.engine.attention_metadata import AttentionMetadata
from loraplex.engine.graph_capture import BucketGraphs

if TYPE_CHECKING:
    from loraplex.engine.lora.slots import LoRASlots
    from loraplex.engine.scheduler_output import SchedulerOutput


def batch_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every 8 to 64, every 16 to 128, every 32 beyond, capped at
    ``max_batch_size`` (which is always the last bucket)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes, b = [1, 2, 4], 8
    while b < max_batch_size:
        sizes.append(b)
        b += 8 if b < 64 else 16 if b < 128 else 32
    return [s for s in sizes if s < max_batch_size] + [max_batch_size]


class DecodeRunner(Protocol):
    """What the padded decode path needs of the model runner that owns it (``ModelRunner`` satisfies it)."""

    device: torch.device
    block_size: int
    model: nn.Module
    kv_caches: list[Any]
    lora: "LoRASlots | None"


class DecodeGraphs(BucketGraphs):
    """The padded decode path of one ``ModelRunner``: static buffers, buckets and (``capture=True``) graphs."""

    label = "decode"

    def __init__(self, runner: DecodeRunner, max_batch_size: int, max_model_len: int, *, capture: bool,
                 aux_layer_ids: tuple[int, ...] = ()) -> None:
        super().__init__(runner, batch_buckets(max_batch_size), capture=capture)
        # with aux_layer_ids the forward also gives the residual stream entering those layers (EAGLE-3 drafts,
        # CausalLM.forward); each run leaves its rows in ``last_aux`` [n, len(ids) * H]
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.last_aux: torch.Tensor | None = None
        self.max_model_len = max_model_len
        B = self.max_batch_size = self.buckets[-1]
        W = self.max_blocks = -(-max_model_len // runner.block_size)
        dev = runner.device
        pin = dev.type == "cuda"
        self._host64 = torch.zeros(4 * B, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(3 * B + 1 + B * W, dtype=torch.int32, pin_memory=pin)
        self._h64, self._h32 = self._host64.numpy(), self._host32.numpy()
        self._h32[B:2 * B + 1] = range(B + 1)  # query_start_loc: one token per row, fixed
        self._dev64 = self._host64.to(dev, copy=True)  # a separate tensor on CPU too: the same copies run there
        self._dev32 = self._host32.to(dev, copy=True)
        # device views (the graph inputs)
        self.input_ids, self.positions, self.slot_mapping, self.pending_rows = self._dev64.view(4, B)
        self.seq_lens = self._dev32[:B]
        self.query_start_loc = self._dev32[B:2 * B + 1]
        self.token_lora_idx = self._dev32[2 * B + 1:3 * B + 1]
        self.block_tables = self._dev32[3 * B + 1:].view(B, W)
        self._attn = {b: AttentionMetadata(slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
                                           seq_lens=self.seq_lens[:b], query_start_loc=self.query_start_loc[:b + 1],
                                           max_query_len=1, max_seq_len=max_model_len) for b in self.buckets}
        self._copied: torch.cuda.Event | None = None  # host buffers are free again once this completes

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch of {n} sequences is over the largest bucket {self.max_batch_size}")

    def can_run(self, out: "SchedulerOutput") -> bool:
        """True when ``out`` is a pure decode step this path serves (see the module docstring)."""
        if self.capture and not self._graphs:
            return False  # capture failed or was not made: the runner's eager path
        scheduled = out.scheduled
        if not scheduled or len(scheduled) > self.max_batch_size:
            return False
        return all(s.num_new_tokens == 1 and s.prompt_logprobs is None and len(s.block_ids) <= self.max_blocks
                   for s in scheduled)

    # ---- one step -------------------------------------------------------------------------------------------
    def run(self, out: "SchedulerOutput", lora_slots: dict[int, int] | None,
            pending: "tuple[torch.Tensor, dict[int, int]] | None" = None) -> torch.Tensor:
        """Hidden states [n, H] of the step's n decode tokens, in ``out.scheduled`` order. ``pending``:
        (the previous step's sampled tokens [m] on the device, {seq_id: its row there}) for sequences whose input
        token is pending (module docstring)."""
        n = len(out.scheduled)
        b = self.bucket_for(n)
        rows = pending[1] if pending is not None else None
        if self._write_inputs(out.scheduled, lora_slots, b, rows):
            ids, src = self.input_ids[:b], self.pending_rows[:b]
            ids.copy_(torch.where(src >= 0, pending[0][src.clamp(min=0)], ids))
        return self._replay(b, n)

    def run_rows(self, entries: list[tuple[list[int], int, list[int]]], row_slots: list[int]) -> torch.Tensor:
        """Hidden [R, H] of the R = sum(len(token_ids)) rows of ``entries`` (token_ids, start, block_ids) in order:
        entry i's token j is a one-token decode at position start_i + j over block_ids_i (a verify step's rows,
        spec_decode/verify_graphs.py). ``row_slots[i]``: entry i's LoRA step slot input (-1: base). Written for all
        entries at once (a fixed number of numpy calls whatever the entry count): the entries' tables as one
        [E, W] array, each row picking its entry's table, its position = its entry's start + its index there."""
        num_rows = [len(t) for t, _, _ in entries]
        widths = [len(blocks) for _, _, blocks in entries]
        n = sum(num_rows)
        b = self.bucket_for(n)
        ids, pos, slots, src, seq_lens, _, tables = self._host_buffers(b)
        bs = self.runner.block_size
        e = len(entries)
        entry_of_block = np.repeat(np.arange(e), widths)
        first_block = np.repeat(np.cumsum(widths) - widths, widths)
        table = np.zeros((e, max(widths, default=0)), dtype=np.int64)
        table[entry_of_block, np.arange(entry_of_block.size) - first_block] = np.fromiter(
            itertools.chain.from_iterable(blocks for _, _, blocks in entries), np.int64, entry_of_block.size)
        entry_of_row = np.repeat(np.arange(e), num_rows)
        starts = np.fromiter((start for _, start, _ in entries), np.int64, e)
        p = np.arange(n) + np.repeat(starts - (np.cumsum(num_rows) - num_rows), num_rows)
        ids[:n] = list(itertools.chain.from_iterable(t for t, _, _ in entries))
        pos[:n] = p
        slots[:n] = table[entry_of_row, p // bs] * bs + p % bs
        seq_lens[:n] = p + 1
        tables[:n, :table.shape[1]] = table[entry_of_row]
        src[:n] = -1
        self._send_inputs(n, b, np.repeat(row_slots, num_rows).tolist(), "verify")
        return self._replay(b, n)

    def _replay(self, b: int, n: int) -> torch.Tensor:
        """Run bucket ``b`` on the static buffers just written: hidden [n, H] of its first ``n`` rows (and their
        aux rows in ``last_aux`` when the path has aux layers)."""
        out = self._run_bucket(b)  # hidden [b, H] (with aux ids: (hidden, aux))
        if self.aux_layer_ids:
            hidden, aux = out
            self.last_aux = aux[:n]
            return hidden[:n]
        return out[:n]

    def _host_buffers(self, b: int) -> tuple:
        """Views of the pinned host buffers (ids, positions, slots, pending rows, seq_lens, LoRA indices, block
        tables [B, W]), once the previous step's copy has read them; bucket ``b``'s table rows cleared."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the pinned buffers
        views = self._host_views()
        views[-1][:b] = 0
        return views

    def _send_inputs(self, n: int, b: int, row_slots: list[int], what: str) -> None:
        """Rows 0..n-1's LoRA indices from their step slots (``row_slots``), rows n..b-1 padded, then the host
        buffers copied to the static device buffers (asynchronously on CUDA; ``_copied`` marks when they are free)."""
        ids, pos, slots, src, seq_lens, lora_idx, _ = self._host_views()
        lora = self.runner.lora
        if any(c >= 0 for c in row_slots):
            if lora is None:
                raise ValueError(f"a {what} step has adapter slots but LoRA is not attached")
            lora_idx[:n] = lora.step_indices(row_slots)  # writes the step's LoRA table too
        else:
            lora_idx[:n] = -1
        ids[n:b], pos[n:b], slots[n:b], src[n:b], seq_lens[n:b], lora_idx[n:b] = 0, 0, -1, -1, 0, -1
        nb = self._dev64.is_cuda
        self._dev64.copy_(self._host64, non_blocking=nb)
        used = 3 * self.max_batch_size + 1 + b * self.max_blocks
        self._dev32[:used].copy_(self._host32[:used], non_blocking=nb)
        if nb:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    def _host_views(self) -> tuple:
        """(ids, positions, slots, pending rows, seq_lens, LoRA indices, block tables [B, W]) of the host buffers."""
        B, W = self.max_batch_size, self.max_blocks
        h64, h32 = self._h64, self._h32
        return (h64[:B], h64[B:2 * B], h64[2 * B:3 * B], h64[3 * B:], h32[:B], h32[2 * B + 1:3 * B + 1],
                h32[3 * B + 1:].reshape(B, W))

    def _write_inputs(self, scheduled: list, lora_slots: dict[int, int] | None, b: int,
                      pending_rows: dict[int, int] | None = None) -> bool:
        """Fill the host buffers (rows n..b-1 padded) and copy them to the static device buffers. Returns whether
        some row's input token is pending (its row in the previous step's tokens is in ``pending_rows``)."""
        ids, pos, slots, src, seq_lens, _, tables = self._host_buffers(b)
        bs = self.runner.block_size
        n = len(scheduled)
        any_pending = False
        for i, s in enumerate(scheduled):
            seq, table = s.seq, s.block_ids
            ctx = seq.num_computed_tokens
            if seq.num_pending_tokens:
                if pending_rows is None or seq.seq_id not in pending_rows:
                    raise ValueError(f"sequence {seq.seq_id}'s input token is pending but not in the previous step")
                ids[i], src[i] = 0, pending_rows[seq.seq_id]
                any_pending = True
            else:
                ids[i], src[i] = seq.token_ids_slice(ctx, ctx + 1)[0], -1
            pos[i] = ctx
            slots[i] = table[ctx // bs] * bs + ctx % bs
            seq_lens[i] = ctx + 1
            tables[i, :len(table)] = table
        row_slots = [-1 if lora_slots is None else lora_slots.get(s.seq.seq_id, -1) for s in scheduled]
        self._send_inputs(n, b, row_slots, "decode")
        return any_pending

    def _write_padding(self, b: int) -> None:
        """Every row of bucket ``b`` padded (warm-up and capture: no KV cache read or written)."""
        self._write_inputs([], None, b)

    def _forward(self, b: int):
        """The model on bucket ``b``'s static buffers -> hidden [b, H], with aux layers (hidden, aux [b, n H])
        (what a graph captures)."""
        runner = self.runner
        lora = runner.lora
        if lora is not None:
            lora.bind_static_token_slots(self.token_lora_idx[:b], min(b, lora.max_step_slots))
        try:
            if self.aux_layer_ids:
                return runner.model(self.input_ids[:b], self.positions[:b], self._attn[b], runner.kv_caches,
                                    self.aux_layer_ids)
            return runner.model(self.input_ids[:b], self.positions[:b], self._attn[b], runner.kv_caches)
        finally:
            if lora is not None:
                lora.set_token_slots(None)
