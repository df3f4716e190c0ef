"""Host -> device copies of adapter weights, off the step's critical path.

    CUDA:   blob = empty(n) on the copy stream ─ blob.copy_(pinned CPU tensor, non_blocking) ─ event.record()
            the step stream keeps running; ``handle.done()`` is ``event.query()`` (no host sync): the scheduler
            admits the adapter's requests once it is True
    other:  the copy runs at once, synchronously; ``done()`` is True

The blob is allocated on the copy stream and marked as used by the step stream (``record_stream``), so freeing
it (eviction) never lets its memory be reused before the steps already enqueued that read it have run, and
adapter blobs are recycled within the copy stream's own pool, apart from the KV cache and activations.
A copier is injectable (``LoRASlots(copier=...)``): CPU tests use one whose copies complete when the test says.
"""
from __future__ import annotations

import time
from typing import Protocol

import torch


class CopyHandle(Protocol):
    def done(self) -> bool: ...

    @property
    def seconds(self) -> float | None: ...  # copy duration once done (None while in flight)


class CopyDone:
    """A copy that completed synchronously."""

    def __init__(self, seconds: float = 0.0) -> None:
        self._seconds = seconds

    def done(self) -> bool:
        return True

    @property
    def seconds(self) -> float | None:
        return self._seconds


class _EventCopy:
    """A copy on the side stream: done when its end event has completed (``query``, never ``synchronize``)."""

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event, source: torch.Tensor) -> None:
        self._start, self._end, self._source = start, end, source
        self._done = False
        self._seconds: float | None = None

    def done(self) -> bool:
        if not self._done and self._end.query():
            self._done = True
            self._seconds = self._start.elapsed_time(self._end) / 1000.0
            self._source = None  # the pinned source may go now
        return self._done

    @property
    def seconds(self) -> float | None:
        return self._seconds


class DeviceCopier:
    """Allocates a device blob for a flat CPU tensor and copies it there: on a side stream with an event on CUDA
    (``asynchronous``), synchronously otherwise."""

    def __init__(self, device: torch.device, *, asynchronous: bool | None = None) -> None:
        self.device = torch.device(device)
        is_cuda = self.device.type == "cuda"
        self.asynchronous = is_cuda if asynchronous is None else (asynchronous and is_cuda)
        self.stream = torch.cuda.Stream(self.device) if self.asynchronous else None

    def copy(self, source: torch.Tensor) -> tuple[torch.Tensor, CopyHandle]:
        """(device blob holding ``source``'s values, handle). ``source`` is a flat CPU tensor (pinned on CUDA for
        the copy to be asynchronous; the CPU tier's are) or a device tensor; it must not be written while the copy
        is in flight."""
        if not self.asynchronous:
            t0 = time.perf_counter()
            blob = source.to(self.device, copy=True)
            return blob, CopyDone(time.perf_counter() - t0)
        step_stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if source.is_cuda:  # made on the step stream (tests, GPU checks): the copy waits for it; a host source
            self.stream.wait_stream(step_stream)  # is ready now, and the copy must not wait for queued steps
            source.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            blob = torch.empty(source.shape, dtype=source.dtype, device=self.device)
            start.record(self.stream)
            blob.copy_(source, non_blocking=True)
            end.record(self.stream)
        blob.record_stream(step_stream)  # reads by steps enqueued before a free keep the memory from reuse
        return blob, _EventCopy(start, end, source)


__all__ = ["CopyDone", "CopyHandle", "DeviceCopier"]
