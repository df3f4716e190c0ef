"""Steps of any shape (prefill chunks beside decode and verify rows) padded to a token bucket and run from static
device buffers; on CUDA one graph per (token bucket, LoRA step slots).

A step that computes a prompt next to the running sequences' decodes is the one the decode graphs cannot take, and
run eagerly its forward is host-bound (hundreds of Triton launches, the LoRA wrappers' Python: at GPT-OSS-20B
about as long as its device time). Here such a step is written into static buffers and replayed:

    step of n sequences, T tokens, k adapters ──▶ L = LoRA step slots of k (0 without adapters)
        ──▶ bucket b = smallest token bucket >= T that holds n sequences
        host (pinned) buffers ── 2 copies ──▶ static device buffers ──▶ graph[b, L].replay() ──▶ hidden[:T]
        (logits of the sampled rows and sampling stay outside the graph, as on the eager path)

Bucket b holds up to ``seqs_in(b) = min(max_seqs, b // 4)`` sequences (so its attention keeps the prefill tiling,
at least 3 query rows per sequence in the kernel's view, and never splits keys). Its attention sees
``seqs_in(b) + 1`` sequences: the step's n, then one padding sequence owning tokens T..b-1 with no context (its
rows attend to nothing: zeros), then empty ones (no tokens). Padded tokens write no K/V (slot -1) and carry no
adapter (-1); their hidden rows are discarded. Token buckets (``token_buckets``): every ``granule`` tokens up to
16 granules, every 2 to 32, every 4 beyond, the last the step budget. A step pads to at most twice its tokens
(plus one granule); one that would pad more, has prompt logprobs, more than MAX_GRAPH_ADAPTERS adapters, or more
sequences or tokens than the largest bucket holds runs eagerly.

LoRA step slots: a prefill-sized step's LoRA kernels cost more the more step slots their table has (idle slots'
programs still read the token map and pad their rows), so each bucket has a graph per slot count an eager step
would use: 0 (no adapter in the step: LoRA off) and ``LoRASlots.eager_step_slots(k)`` for k = 1..16 adapters
(8 and 16 by default), the LoRA kernels always on in the latter (``LoRASlots.bind_static_token_slots``). The
same power-of-two counts as the eager steps', so their kernel variants serve both.

Static buffers (T = largest bucket, S = seqs_in(T) + 1, W = ceil(max_model_len / block_size)):

    int64  [4T]              input_ids [T] | positions [T] | slot_mapping [T] | pending_rows [T]
    int32  [2S+1+T+S*W]      seq_lens [S] | query_start_loc [S+1] | token_lora_idx [T] | block_tables [S, W]

Only the step's rows of the block tables are written and copied: the padding and empty sequences have no
context, so no program reads their rows. Every graph copies its hidden rows into one static [T, H] output buffer,
so the pool holds no output of its own per graph (72 of them would hold the sum of their buckets' rows). Rows whose input token the overlapped step in flight samples take it
from that step's tokens on the device after the copy (as on the decode path, cuda_graphs.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from loraplex.engine.attention_metadata import AttentionMetadata, query_start_loc, scheduled_tokens, token_slots
from loraplex.engine.graph_capture import BucketGraphs

if TYPE_CHECKING:
    from loraplex.engine.scheduler_output import SchedulerOutput
    from loraplex.engine.step_pipeline import PendingTokens

DEFAULT_GRANULE = 128  # tokens; CUDA steps. Tests pass smaller ones.
TOKENS_PER_SEQ = 4     # a bucket of b tokens holds b // TOKENS_PER_SEQ sequences
MAX_GRAPH_ADAPTERS = 16  # steps with more distinct adapters run eagerly


def token_buckets(max_tokens: int, granule: int = DEFAULT_GRANULE) -> list[int]:
    """Token counts with a graph: multiples of ``granule`` up to 16 of them, of 2 granules up to 32, of 4 beyond,
    capped at ``max_tokens`` (always the last bucket)."""
    if max_tokens < 1 or granule < 1:
        raise ValueError(f"max_tokens and granule must be >= 1, got {max_tokens} and {granule}")
    sizes, b = [], granule
    while b < max_tokens:
        sizes.append(b)
        b += granule if b < 16 * granule else 2 * granule if b < 32 * granule else 4 * granule
    return sizes + [max_tokens]


class MixedGraphs(BucketGraphs):
    """The padded path of steps with prefill chunks (module docstring), for one ``ModelRunner``."""

    label = "mixed-step"

    def __init__(self, runner, max_tokens: int, max_seqs: int, max_model_len: int, *, capture: bool,
                 granule: int = DEFAULT_GRANULE, aux_layer_ids: tuple[int, ...] = ()) -> None:
        super().__init__(runner, token_buckets(max_tokens, granule), capture=capture)
        # with aux_layer_ids the forward also gives the residual stream entering those layers (EAGLE-3 drafts);
        # each step leaves its rows in ``last_aux`` [T, len(ids) * H]
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.last_aux: torch.Tensor | None = None
        self.granule = granule
        self.max_seqs = max_seqs
        lora = runner.lora
        # LoRA step slots a graph is captured for: 0 (no adapter in the step: LoRA off, as an eager step), then
        # the eager steps' slot counts of 1..MAX_GRAPH_ADAPTERS adapters
        self.slot_counts = [0] + (sorted({lora.eager_step_slots(k) for k in
                                          range(1, min(MAX_GRAPH_ADAPTERS, lora.max_step_slots) + 1)})
                                  if lora is not None else [])
        self._keys = {(b, slots) for b in self.buckets for slots in self.slot_counts}
        T = self.max_tokens = self.buckets[-1]
        S = self._num_seqs(T)
        W = self.max_blocks = -(-max_model_len // runner.block_size)
        dev = runner.device
        pin = dev.type == "cuda"
        self._host64 = torch.zeros(4 * T, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(2 * S + 1 + T + S * W, dtype=torch.int32, pin_memory=pin)
        self._h64, self._h32 = self._host64.numpy(), self._host32.numpy()
        self._dev64 = self._host64.to(dev, copy=True)
        self._dev32 = self._host32.to(dev, copy=True)
        self.input_ids, self.positions, self.slot_mapping, self.pending_rows = self._dev64.view(4, T)
        self.seq_lens = self._dev32[:S]
        self.query_start_loc = self._dev32[S:2 * S + 1]
        self.token_lora_idx = self._dev32[2 * S + 1:2 * S + 1 + T]
        self.block_tables = self._dev32[2 * S + 1 + T:].view(S, W)
        self._table_offset = 2 * S + 1 + T
        self._copied: torch.cuda.Event | None = None  # host buffers are free again once this completes
        # every graph leaves its hidden rows here (one [T, H] buffer, not one per graph in the pool)
        hidden_size = runner.model_config.hidden_size
        self._hidden = torch.empty(T, hidden_size, dtype=runner.dtype, device=dev)
        self._aux = torch.empty(T, len(self.aux_layer_ids) * hidden_size, dtype=runner.dtype, device=dev) \
            if self.aux_layer_ids else None

    def seqs_in(self, b: int) -> int:
        """How many sequences a step in bucket ``b`` may have."""
        return max(1, min(self.max_seqs, b // TOKENS_PER_SEQ))

    def _num_seqs(self, b: int) -> int:
        return self.seqs_in(b) + 1  # the step's, then the padding sequence

    def _attn(self, b: int) -> AttentionMetadata:
        s = self._num_seqs(b)
        return AttentionMetadata(slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:s],
                                 seq_lens=self.seq_lens[:s], query_start_loc=self.query_start_loc[:s + 1],
                                 max_query_len=b, max_seq_len=self.max_blocks * self.runner.block_size)

    def step_slots(self, row_slots: list[int]) -> int:
        """The LoRA step slots of a step whose sequences have these resident slots (-1: base): 0 without adapters,
        else the eager steps' count (``LoRASlots.eager_step_slots``); -1 when no graph is captured for it."""
        used = len({c for c in row_slots if c >= 0})
        if not used:
            return 0
        slots = self.runner.lora.eager_step_slots(used) if self.runner.lora is not None else -1
        return slots if used <= MAX_GRAPH_ADAPTERS and slots in self.slot_counts else -1

    def bucket_for(self, num_tokens: int, num_seqs: int, slots: int = 0) -> int | None:
        """The bucket of a step of ``num_tokens`` tokens over ``num_seqs`` sequences with ``slots`` LoRA step slots
        (a captured one, the smallest that holds the step); None: it runs eagerly."""
        for b in self.buckets:
            if b >= num_tokens and self.seqs_in(b) >= num_seqs and (b, slots) in self._keys:
                return b if b - num_tokens <= max(num_tokens, self.granule) else None
        return None

    def _fits(self, num_tokens: int, widths, row_slots: list[int]) -> bool:
        if not row_slots or (self.capture and not self._graphs) or max(widths) > self.max_blocks:
            return False
        slots = self.step_slots(row_slots)
        return slots >= 0 and self.bucket_for(num_tokens, len(row_slots), slots) is not None

    def can_run(self, out: "SchedulerOutput", lora_slots: dict[int, int] | None) -> bool:
        """True when ``out`` (any step: the decode path is asked first) fits a captured bucket, has at most
        MAX_GRAPH_ADAPTERS adapters and asks for no prompt logprobs."""
        scheduled = out.scheduled
        if any(s.prompt_logprobs is not None for s in scheduled):
            return False
        return self._fits(sum(s.num_new_tokens for s in scheduled), [len(s.block_ids) for s in scheduled],
                          _row_slots(scheduled, lora_slots))

    def can_run_entries(self, entries: list[tuple[list[int], int, list[int]]], row_slots: list[int]) -> bool:
        """``can_run`` for (token_ids, start, block_ids) entries (spec_decode/batch_inputs.py) with their LoRA
        resident slots."""
        return self._fits(sum(len(t) for t, _, _ in entries), [len(blocks) for _, _, blocks in entries], row_slots)

    # ---- one step -------------------------------------------------------------------------------------------
    def run(self, out: "SchedulerOutput", lora_slots: dict[int, int] | None,
            pending: "PendingTokens | None" = None) -> tuple[torch.Tensor, np.ndarray]:
        """(hidden [T, H] of the step's tokens in ``out.scheduled`` order, query_start_loc [n + 1] on the host).
        ``pending``: the overlapped step in flight, whose sampled tokens are the inputs still pending."""
        scheduled = out.scheduled
        ids, starts, counts, qsl = scheduled_tokens(scheduled)
        src = self.runner._pending_rows(scheduled, starts, counts, qsl, pending)
        row_slots = _row_slots(scheduled, lora_slots)
        hidden = self._step(ids, starts, counts, qsl, [s.block_ids for s in scheduled], row_slots, src,
                            pending.device_ids if src is not None else None)
        return hidden, qsl

    def run_entries(self, entries: list[tuple[list[int], int, list[int]]],
                    row_slots: list[int]) -> tuple[torch.Tensor, list[int]]:
        """(hidden [T, H] of the entries' tokens in order, the row of each entry's first token). ``row_slots[i]``:
        entry i's LoRA resident slot (-1: base)."""
        n = len(entries)
        starts = np.fromiter((start for _, start, _ in entries), dtype=np.int64, count=n)
        counts = np.fromiter((len(t) for t, _, _ in entries), dtype=np.int64, count=n)
        qsl = query_start_loc(counts)
        ids = [t for tokens, _, _ in entries for t in tokens]
        hidden = self._step(ids, starts, counts, qsl, [blocks for _, _, blocks in entries], row_slots, None, None)
        return hidden, qsl[:-1].tolist()

    def _step(self, ids: list[int], starts: np.ndarray, counts: np.ndarray, qsl: np.ndarray,
              tables: list[list[int]], row_slots: list[int], src: np.ndarray | None,
              pending_ids: torch.Tensor | None) -> torch.Tensor:
        n, total = len(tables), int(qsl[-1])
        slots = self.step_slots(row_slots)
        if slots < 0 and any(c >= 0 for c in row_slots) and self.runner.lora is None:
            raise ValueError("a step has adapter slots but LoRA is not attached")
        b = self.bucket_for(total, n, slots) if slots >= 0 else None
        if b is None:
            raise ValueError(f"a step of {total} tokens over {n} sequences and {slots} LoRA step slots fits no "
                             f"bucket of {self.buckets} x {self.slot_counts}")
        self._write(ids, starts, counts, qsl, tables, row_slots, src, b)
        if src is not None:
            inp, rows = self.input_ids[:b], self.pending_rows[:b]
            inp.copy_(torch.where(rows >= 0, pending_ids[rows.clamp(min=0)], inp))
        out = self._run_bucket((b, slots))
        if self.aux_layer_ids:
            hidden, aux = out
            self.last_aux = aux[:total]
            return hidden[:total]
        return out[:total]

    def _write(self, ids: list[int], starts: np.ndarray, counts: np.ndarray, qsl: np.ndarray,
               tables: list[list[int]], row_slots: list[int], src: np.ndarray | None, b: int) -> None:
        """Fill the host buffers for bucket ``b`` (padding included) and copy them to the static device buffers."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the pinned buffers
        T, S, W = self.max_tokens, self._num_seqs(self.max_tokens), self.max_blocks
        h64, h32 = self._h64, self._h32
        inp, pos, slots, pend = h64[:T], h64[T:2 * T], h64[2 * T:3 * T], h64[3 * T:]
        seq_lens, q_loc, lora_idx = h32[:S], h32[S:2 * S + 1], h32[2 * S + 1:2 * S + 1 + T]
        table = h32[self._table_offset:].reshape(S, W)
        n, total = len(tables), int(qsl[-1])
        width = max((len(t) for t in tables), default=0)
        table[:n, :width] = 0
        for i, blocks in enumerate(tables):
            table[i, :len(blocks)] = blocks
        inp[:total] = ids
        pos[:total], slots[:total] = token_slots(starts, counts, qsl, table, self.runner.block_size)
        pend[:total] = -1 if src is None else src
        inp[total:b], pos[total:b], slots[total:b], pend[total:b] = 0, 0, -1, -1
        seq_lens[:n] = starts + counts
        seq_lens[n:] = 0
        q_loc[:n + 1] = qsl
        q_loc[n + 1:] = b  # the padding sequence owns tokens total..b-1; the ones after it none
        if any(c >= 0 for c in row_slots):  # (``_step`` refused adapter slots without LoRA)
            lora_idx[:total] = np.repeat(self.runner.lora.step_indices(row_slots), counts)  # and the LoRA table
        else:
            lora_idx[:total] = -1
        lora_idx[total:b] = -1
        nb = self._dev64.is_cuda
        self._dev64.copy_(self._host64, non_blocking=nb)
        used = self._table_offset + n * W
        self._dev32[:used].copy_(self._host32[:used], non_blocking=nb)
        if nb:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    # ---- capture (graph_capture.py) -------------------------------------------------------------------------
    def capture_order(self) -> list[tuple[int, int]]:
        """(bucket, LoRA step slots): the largest bucket first, its widest slot count first; then the smallest
        bucket upwards."""
        wide = sorted(self.slot_counts, reverse=True)
        return [(self.buckets[-1], c) for c in wide] + [(b, c) for b in self.buckets[:-1] for c in wide]

    def _captured(self) -> str:
        self._keys = set(self._graphs)
        self.buckets = sorted({b for b, _ in self._keys})
        return f"{','.join(map(str, self.buckets))} x LoRA step slots {','.join(map(str, self.slot_counts))}"

    def _write_padding(self, key: tuple[int, int]) -> None:
        """Every token of the key's bucket padded (warm-up and capture: no KV cache read or written)."""
        none = np.zeros(0, np.int64)
        self._write([], none, none, query_start_loc(none), [], [], None, key[0])

    def _forward(self, key: tuple[int, int]):
        """The model on bucket b's static buffers with ``slots`` LoRA step slots (0: LoRA off) -> hidden [b, H],
        with aux layers (hidden, aux [b, n H]) (what a graph captures)."""
        b, slots = key
        runner = self.runner
        lora = runner.lora
        if lora is not None:
            if slots:
                lora.bind_static_token_slots(self.token_lora_idx[:b], slots)
            else:
                lora.set_token_slots(None)
        try:
            args = (self.input_ids[:b], self.positions[:b], self._attn(b), runner.kv_caches)
            if self.aux_layer_ids:
                hidden, aux = runner.model(*args, self.aux_layer_ids)
                return self._hidden[:b].copy_(hidden), self._aux[:b].copy_(aux)
            return self._hidden[:b].copy_(runner.model(*args))
        finally:
            if lora is not None:
                lora.set_token_slots(None)


def _row_slots(scheduled: list, lora_slots: dict[int, int] | None) -> list[int]:
    """Each scheduled sequence's LoRA resident slot (-1: base)."""
    return [-1 if lora_slots is None else lora_slots.get(s.seq.seq_id, -1) for s in scheduled]
