"""Compiling the eager steps' Triton kernel variants at start, so that no serving step waits for a compile.

A Triton kernel compiles once per specialisation: its constexprs (the tile config chosen per token count from
``tuning_configs/``, the LoRA kernels' slot block ``BLOCK_L``, split-K partials or atomics, paged attention's
decode or prefill tiles and key splits, ...) and its launch options. The decode graphs compile the shapes they
capture; prefill chunks, mixed steps and decode batches past the graphs run eagerly, and each new variant would
compile inside a serving step, stalling every running request for as long (seconds for a LoRA kernel). At start,
before any request, the warm-up runs the model eagerly on dummy inputs over the step shapes the engine can
schedule:

    token counts T = 1, 2, 4, ... up to max_num_batched_tokens, T + 1 (odd counts) and every M of the device's
    tuning files, each
        as prefill-like sequences of up to max_model_len tokens     (attention's prefill tiles)
        as T decode rows of one token, T <= max_num_seqs             (attention's decode tiles, key splits or not)
    LoRA step slots L: none first, then each eager slot count (8, 16, ... up to max_step_slots), prefill-like
    the copy-on-write block copy (n > 1, beam search), once the step shapes are done

Every tile config the tuning files give a token count is reached (its own M is among the counts), as are both
sides of the split-K partials limit (pairs x SPLIT_K crosses it at a power of two). Dummy tokens write
no KV (slot -1) and read only block 0, zeroed first (no sequence exists yet); LoRA runs in always-on mode with no
token mapped to an adapter, as in graph capture, so its kernels launch and compile but add nothing. Once
``budget_s`` is spent the warm-up stops (the rest compiles on first use, as without it); a dummy step that
raises stops it with a warning (serving goes on). ``run`` returns what it did; the engine logs it:

    report = run(runner, budget_s=90.0)     # -> WarmupReport(shapes=.., seconds=.., compiles=.., skipped=..)
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.engine.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from loraplex.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """One dummy step: ``tokens`` tokens as prefill-like sequences or as decode rows, LoRA with ``slots`` step
    slots (None: no LoRA)."""

    tokens: int
    decode: bool
    slots: int | None = None

    def __str__(self) -> str:
        return f"{'decode' if self.decode else 'prefill'} T={self.tokens}" + (f" L={self.slots}" if self.slots else "")


@dataclass
class WarmupReport:
    shapes: int = 0                      # dummy steps run
    planned: int = 0                     # dummy steps planned
    seconds: float = 0.0
    compiles: int | None = None          # Triton compiles during the warm-up (None: this Triton has no JIT hooks)
    compile_seconds: float | None = None
    skipped: list[Shape] = field(default_factory=list)   # left out once the budget was spent
    failed: str | None = None            # the shape whose dummy step raised (the warm-up stopped there)

    def summary(self) -> str:
        compiled = (f", {self.compiles} kernel compiles ({self.compile_seconds:.1f} s)"
                    if self.compiles is not None else "")
        left = (f"; stopped by an error at {self.failed}" if self.failed else
                f"; budget spent, {len(self.skipped)} shapes left to compile on first use" if self.skipped else "")
        return f"{self.shapes} of {self.planned} step shapes in {self.seconds:.1f} s{compiled}{left}"


def token_counts(max_tokens: int, tuned: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """1, 2, 4, ... up to ``max_tokens`` (always included), each with its successor (odd counts), and the ``tuned``
    token counts of the tuning files (a tuned config's range of counts may hold no power of two)."""
    counts, t = set(), 1
    while t <= max_tokens:
        counts.update((t, t + 1))
        t *= 2
    counts.add(max_tokens)
    counts.update(tuned)
    return sorted(c for c in counts if 1 <= c <= max_tokens)


def plan(max_tokens: int, max_num_seqs: int, slot_counts: list[int],
         tuned: set[int] | frozenset[int] = frozenset()) -> list[Shape]:
    """The dummy steps in the order they run: no LoRA (prefill-like and decode rows), then per slot count."""
    counts = token_counts(max_tokens, tuned)
    shapes = [Shape(t, decode) for t in counts for decode in (False, True) if not decode or t <= max_num_seqs]
    shapes += [Shape(t, False, slots) for slots in slot_counts for t in counts]
    return shapes


def eager_slot_counts(runner: "ModelRunner") -> list[int]:
    """The step-slot counts an eager LoRA step can have (none without LoRA)."""
    lora = runner.lora
    if lora is None:
        return []
    return sorted({lora.eager_step_slots(k) for k in range(1, lora.max_step_slots + 1)})


def run(runner: "ModelRunner", *, budget_s: float, max_tokens: int | None = None) -> WarmupReport:
    """Runs the dummy steps of ``plan`` on ``runner`` until ``budget_s`` seconds have passed. Call it at start,
    before any sequence holds KV blocks (block 0 is overwritten)."""
    from loraplex.kernels import compile_watch, tuning

    max_tokens = max_tokens or runner.config.max_num_batched_tokens
    shapes = plan(max_tokens, runner.max_num_seqs, eager_slot_counts(runner), tuning.tuned_ms())
    report = WarmupReport(planned=len(shapes))
    watch = compile_watch.install()
    before = watch.snapshot() if watch is not None else None
    start = time.perf_counter()
    for k_cache, v_cache in runner.kv_caches:
        k_cache[0].zero_()
        v_cache[0].zero_()
    i = 0
    try:
        with torch.inference_mode():
            for i, shape in enumerate(shapes):
                if time.perf_counter() - start > budget_s:
                    report.skipped = shapes[i:]
                    break
                _step(runner, shape)
                report.shapes += 1
            else:
                i = len(shapes)
                _copy_blocks(runner)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    except Exception as e:  # noqa: BLE001 - the warm-up only saves compiles; serving goes on without the rest
        report.failed = f"{shapes[i] if i < len(shapes) else 'copy-on-write block copy'}: {type(e).__name__}: {e}"
        report.skipped = shapes[i:]
        logger.warning("eager warm-up stopped at %s; the remaining shapes compile on first use", report.failed)
    report.seconds = time.perf_counter() - start
    if watch is not None:
        done = watch.since(before)
        report.compiles, report.compile_seconds = done["compiles"], done["seconds"]
    return report


def _copy_blocks(runner: "ModelRunner") -> None:
    """The copy-on-write block copy (``n`` > 1, beam search, forks): block 0 onto itself."""
    from loraplex.kernels import ops

    ops.copy_blocks([k for k, _ in runner.kv_caches], [v for _, v in runner.kv_caches],
                    torch.tensor([[0, 0]], dtype=torch.int64, device=runner.device))


def dummy_inputs(shape: Shape, *, block_size: int, max_model_len: int,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, attention metadata) of one dummy step: ``shape.tokens`` tokens as decode rows of
    one token, or as sequences of up to ``max_model_len`` new tokens; no KV write (slot -1), every block-table
    entry block 0."""
    t = shape.tokens
    if shape.decode:
        lens = [1] * t
    else:
        per_seq = max(1, max_model_len)
        lens = [per_seq] * (t // per_seq) + ([t % per_seq] if t % per_seq else [])
    width = max(1, -(-max(lens) // block_size))
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    attn = AttentionMetadata(
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(len(lens), width, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_query_len=max(lens), max_seq_len=max(lens))
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(device)
    return torch.zeros(t, dtype=torch.int64, device=device), positions, attn


def _step(runner: "ModelRunner", shape: Shape) -> None:
    """One dummy forward of ``shape`` (hidden states discarded)."""
    dev = runner.device
    input_ids, positions, attn = dummy_inputs(shape, block_size=runner.block_size,
                                              max_model_len=runner.max_model_len, device=dev)
    lora = runner.lora
    if shape.slots is not None:
        lora.bind_static_token_slots(torch.full((shape.tokens,), -1, dtype=torch.int32, device=dev), shape.slots)
    try:
        runner.model(input_ids, positions, attn, runner.kv_caches)
    finally:
        if lora is not None:
            lora.set_token_slots(None)
