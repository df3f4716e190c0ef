"""Overlapped ("async") scheduling: the host plans and launches decode step n+1 while the device still runs step n.

A synchronous step leaves the GPU idle while the host schedules, packs inputs, reads the sampled tokens back
(``.tolist()``), runs stop checks, detokenizes and builds outputs. With ``EngineConfig.async_scheduling`` the engine
keeps one step in flight (pipeline depth one):

    host:   schedule n+1 │ launch n+1 │ wait n │ resolve n, stop checks, outputs │ launched n+1 ▶ return
    device: ....... step n runs ........ │ step n+1 runs ......................................
                                 input ids of n+1 gathered on the device from n's sampled-token tensor

    LLMEngine.step()
      1. Scheduler.schedule()         sequences of step n carry a *pending* token (value still on the device):
                                      it counts for blocks and max_tokens; one whose pending token is its last
                                      (max_tokens / max_model_len) is not scheduled again
      2. can_overlap(step n+1)?       yes: ModelRunner.launch_decode(): padded decode path, rows with a pending
                                      input take it from step n's tokens (cuda_graphs.py), sample on the device,
                                      non-blocking copy of the tokens to pinned memory + a CUDA event
      3. wait for step n's tokens     PendingTokens.wait(); Scheduler.update_resolved() writes them in and runs
                                      the stop checks; the engine applies stop strings and builds the outputs
      4. Scheduler.update_launched()  step n+1's surviving sequences: input token computed, a pending token added
      not overlappable:               drain step n (3), then run step n+1 synchronously as without overlap;
                                      an eager step (a prefill chunk beside decodes: an arrival) is enqueued
                                      first (``ModelRunner.launch_eager``: inputs from pinned memory, pending
                                      ones gathered from step n's tokens on the device), then step n is drained
                                      and step n+1 sampled and read back as usual

The eager step's early launch hides its host work (packing, LoRA token maps, hundreds of kernel launches) behind
step n's device time instead of after it, so an arrival's first token and the running requests' next one come one
host launch sooner. It applies when the step moves no blocks and asks for no prompt logprobs; rows of sequences
that finish when step n is read (EOS, a stop token or string) were computed and are dropped before sampling, their KV
writes landing in freed blocks as described below.

A step with grammar-constrained sequences (structured outputs) overlaps too, with 2 split in two: its masks need
step n's tokens, so the engine launches step n+1's forward (``ModelRunner.launch_forward``), resolves step n's
tokens (3, up to the matchers), fills and uploads the masks and launches the sampling (``sample_launched``), then
builds step n's outputs; the mask work runs on the host while the device computes the forward.

A step is overlappable when the runner's padded decode path (CUDA graphs, or ``init_decode_graphs(capture=False)``)
serves it, it moves no blocks (swap, copy-on-write), no logits hook is set, and every scheduled sequence is a plain
decode of a "simple" request: one sequence (no n > 1, best_of or beam search), no logprobs, no penalties or
``min_tokens`` (those read the token history on the host). Requests asking for logprobs run synchronously: any step
holding one drains the pipeline. Speculative decoding (engine/spec_decode/): a verify step has several new tokens
per sequence and its proposals follow the previous step's tokens, so it overlaps differently (``can_overlap_verify``):

    host:   read back n │ append, propose, schedule, pack n+1 │ launch n+1 │ outputs of n ▶ return │ read back n+1
    device: .. n runs ..│.............. idle ..................│ ........... step n+1 runs .............│

only the output work (detokenizer, stop strings, RequestOutputs, the caller's hand-off) is hidden. A verify step
overlaps when it moves no blocks and every request in it has one sequence; it may hold logprobs, penalties and
prefill chunks, which it computes in full at its launch or read-back.

A sequence that finishes when step n's tokens arrive (EOS, stop token, stop string) or that is aborted while step
n+1 is in flight already has a row in step n+1: that row is discarded (never appended, reported or counted) and
its KV blocks are freed at once. Freeing is safe although step n+1 may still write into those blocks: every later
use of a freed block (another sequence's prefill or decode, a copy-on-write, a swap) is enqueued on the same CUDA
stream after step n+1, so it runs after step n+1's writes; the discarded write itself lands in a slot nothing
reads. Prefix-cache hashing only covers computed tokens, which never include a pending one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.scheduler_output import SchedulerOutput


class PendingTokens:
    """The sampled tokens of a launched step: ``device_ids`` [n] (int64, row i = ``seq_ids[i]``) for the next
    step's gather, and their copy to the host, started at construction (pinned memory and an event on CUDA; on
    CPU the values are simply there)."""

    def __init__(self, seq_ids: list[int], device_ids: torch.Tensor) -> None:
        self.seq_ids = seq_ids
        self.row_of = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        self.device_ids = device_ids
        self._event: torch.cuda.Event | None = None
        if device_ids.is_cuda:
            self._host = torch.empty(device_ids.shape, dtype=device_ids.dtype, pin_memory=True)
            self._host.copy_(device_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = device_ids
        self._values: list[int] | None = None

    def wait(self) -> dict[int, int]:
        """Block until the tokens are on the host; {seq_id: token}."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
        return dict(zip(self.seq_ids, self._values))


@dataclass
class InflightStep:
    """The step launched but not yet resolved: its schedule and its tokens on their way (a verify step: held by
    the SpecDecoder until ``SpecDecoder.finish``)."""

    out: "SchedulerOutput"
    tokens: PendingTokens | None
    verify: bool = False


def is_simple(params: "SamplingParams") -> bool:
    """Whether a request's sampling can stay on the device for a whole step: one sequence, no logprobs, nothing
    that reads the token history on the host (penalties, ``min_tokens``)."""
    return (params.num_sequences == 1 and not params.use_beam_search and params.logprobs is None
            and not params.needs_token_history)


def can_overlap(out: "SchedulerOutput", runner, params_of) -> bool:
    """Whether step ``out`` may be launched before the previous step's tokens are read (module docstring).
    ``params_of(request_id)`` gives a request's SamplingParams."""
    if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy or not out.scheduled:
        return False
    graphs = runner.decode_graphs
    if graphs is None or runner.logits_hook is not None or not graphs.can_run(out):
        return False
    return all(s.sample and s.num_samples == 1 and not s.beam and is_simple(params_of(s.seq.request_id))
               for s in out.scheduled)


def can_overlap_verify(out: "SchedulerOutput", params_of) -> bool:
    """Whether verify step ``out`` may stay in flight while the previous step's outputs are built (module
    docstring): no block moves, and one sequence per request (a late stop string then ends a whole request)."""
    if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy or not out.scheduled:
        return False
    return all(s.num_samples == 1 and not s.beam and params_of(s.seq.request_id).num_sequences == 1
               and not params_of(s.seq.request_id).use_beam_search for s in out.scheduled)
