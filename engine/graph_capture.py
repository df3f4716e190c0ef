"""Padded steps replayed from CUDA graphs: one graph per bucket, all captured in one memory pool within a time budget.

A padded path writes its step into static device buffers sized for its largest bucket, pads the step up to the
smallest bucket that holds it, and runs the model on that bucket's views of the buffers. ``BucketGraphs`` is
what such paths share: the buckets, capture (warm-up forward, then capture, largest bucket first so its pool
serves the rest, then the smallest upwards, until ``budget_s`` is spent) and the replay. Graphs are keyed by
what they were captured for: the bucket (decode rows, cuda_graphs.py) or a (token bucket, LoRA step slots) pair
(steps of any shape, mixed_graphs.py). A subclass gives ``capture_order()`` (the keys, largest first),
``_write_padding(key)`` (every row of the key's bucket padded) and ``_forward(key)`` (the model on that bucket's
buffers: what a graph captures).

With ``capture=False`` the same padded path runs eagerly (any device): how the CPU tests check it.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)


class BucketGraphs:
    """Buckets, graphs and their capture for one padded path of a model runner (``runner``: its ``device`` and
    ``lora``). ``label`` names the path in the logs."""

    label = "padded"

    def __init__(self, runner, buckets: list[int], *, capture: bool) -> None:
        if capture and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use capture=False for the eager padded path")
        self.runner = runner
        self.capture = capture
        self.buckets = list(buckets)
        self._graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[Any, Any] = {}  # what each graph's forward returned (its static output tensors)
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self.num_steps = 0                  # steps run on this path (graph replays or padded eager)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _write_padding(self, key) -> None:
        raise NotImplementedError

    def _forward(self, key):
        raise NotImplementedError

    def _run_bucket(self, key):
        """The graph of ``key`` on the static buffers just written: replayed (its output tensors returned), or
        without capture the forward run eagerly."""
        self.num_steps += 1
        if self.capture:
            self._graphs[key].replay()
            return self._outputs[key]
        return self._forward(key)

    def capture_order(self) -> list:
        """Largest bucket first (its pool serves the rest), then the smallest upwards (the sizes low load uses)."""
        return [self.buckets[-1]] + self.buckets[:-1]

    def _captured(self) -> str:
        """After capture: keep what was captured (``buckets``); the keys for the log line."""
        self.buckets = sorted(self._graphs)
        return ",".join(map(str, self.buckets))

    def capture_all(self, budget_s: float | None = None) -> bool:
        """Warm up and capture one graph per bucket (``capture_order``) in one shared memory pool, stopping once
        ``budget_s`` seconds have passed (the largest bucket is always captured). On any failure: a warning, no
        graphs (the runner then runs these steps eagerly). Returns whether graphs are in place."""
        if not self.capture:
            return False
        lora = self.runner.lora
        if lora is not None and not lora.supports_static_token_slots():
            logger.warning("CUDA graphs disabled: the LoRA layers do not support LoRAState.always_on (a graph would "
                           "leave out the LoRA kernels); running %s steps eagerly", self.label)
            return False
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        free_before = torch.cuda.mem_get_info(dev)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        skipped: list = []
        try:
            with torch.inference_mode():
                for key in self.capture_order():
                    if self._graphs and budget_s is not None and time.perf_counter() - start > budget_s:
                        skipped.append(key)
                        continue
                    self._write_padding(key)
                    self._forward(key)  # warm-up: Triton compiles and tuning lookups happen outside the capture
                    torch.cuda.synchronize(dev)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                        out = self._forward(key)
                    self._graphs[key], self._outputs[key] = graph, out
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - any capture problem: fall back to eager, loudly
            self._graphs.clear()
            self._outputs.clear()
            if lora is not None:
                lora.set_token_slots(None)
            logger.warning("CUDA graph capture failed (%s: %s); running %s steps eagerly", type(e).__name__, e,
                           self.label)
            try:
                torch.cuda.synchronize(dev)
            except Exception:  # noqa: BLE001
                logger.exception("CUDA device unusable after the failed capture")
                raise
            return False
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info(dev)[0])
        keys = self._captured()
        logger.info("CUDA graphs: %d %s buckets (%s) captured in %.1f s, %.0f MiB%s%s", len(self._graphs),
                    self.label, keys, self.capture_seconds,
                    self.graph_memory_bytes / 2**20, " (LoRA kernels included)" if lora is not None else "",
                    f"; capture budget of {budget_s:.0f} s spent, buckets {','.join(map(str, skipped))} left out "
                    f"(served by the next larger one)" if skipped else "")
        return True
