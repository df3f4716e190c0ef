"""Verify steps through the decode path's static buffers and CUDA graphs (``SpeculativeConfig.verify_cuda_graphs``).

A verify step of B sequences with k drafts each computes B x (k + 1) tokens. Row j of sequence s (position
start_s + j) needs keys 0 .. start_s + j: a one-token decode at that position over the same block table. So the
step is a decode step of B x (k + 1) rows, and ``DecodeGraphs`` (cuda_graphs.py) serves it unchanged:

    seq s: [ x  d1  d2  d3 ]  at positions p .. p+3   ->   rows (s, p, x), (s, p+1, d1), (s, p+2, d2), (s, p+3, d3)
    every row's K/V is written (rope + cache write, all rows) before any row's attention reads, in every layer

``VerifyGraphs`` is a second ``DecodeGraphs`` of the same runner whose buckets go past the decode graphs' largest
(up to ``verify_graph_max_rows``): a step of at most that many rows replays the decode graph (when it fits) or
one of these. Graphs are captured on CUDA with tensor_parallel_size 1 and enforce_eager off; elsewhere the same
padded path runs eagerly (how the CPU tests prove it token-identical to the eager multi-token forward).

``DecodeGraphs.run_rows`` writes a verify step's rows into the static buffers a sequence at a time.
"""
from __future__ import annotations

import logging

from loraplex.engine.cuda_graphs import DecodeGraphs, batch_buckets

logger = logging.getLogger(__name__)


class VerifyGraphs(DecodeGraphs):
    """Buckets of ``batch_buckets(max_rows)`` above ``skip_up_to`` (those the decode graphs already cover)."""

    def __init__(self, runner, max_rows: int, max_model_len: int, *, capture: bool, skip_up_to: int = 0,
                 aux_layer_ids: tuple[int, ...] = ()) -> None:
        super().__init__(runner, max_rows, max_model_len, capture=capture, aux_layer_ids=aux_layer_ids)
        self.buckets = [b for b in batch_buckets(max_rows) if b > skip_up_to] or [max_rows]


def make_verify_graphs(runner, max_rows: int, max_model_len: int, *,
                       aux_layer_ids: tuple[int, ...] = ()) -> tuple[VerifyGraphs | None, DecodeGraphs | None]:
    """(the verify graphs, the decode graphs to use for steps that fit them). On CUDA with graphs enabled the
    buckets above the decode graphs' are captured; a failed capture leaves verify steps eager (None). With
    ``aux_layer_ids`` (a proposer reading the target's aux hidden states, EAGLE-3) the verify graphs cover every
    bucket up to ``max_rows`` and also give those layers' inputs, and the decode graphs (hidden states only) are
    not used."""
    decode = runner.decode_graphs
    capture = runner.graphs_enabled() and decode is not None and decode.capture
    if aux_layer_ids:
        graphs = VerifyGraphs(runner, max_rows, max_model_len, capture=capture, aux_layer_ids=aux_layer_ids)
        if capture and not graphs.capture_all():
            logger.warning("verify CUDA graphs with aux hidden states could not be captured: verify steps run "
                           "eagerly")
            return None, None
        return graphs, None
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
