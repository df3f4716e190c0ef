"""Pausing the load between faults, so that the invariants (idle engines, no lease, every usage record) can be
checked on a quiet stack while the run goes on afterwards.

    gate = Gate(os.path.join(work_dir, "pause"), locust=True)
    waited_s = gate.pause(timeout_s=60)   # no new request starts; returns once none is in flight
    ...                                   # check the invariants
    gate.resume()

The asyncio streaming client (same process) asks ``gate.paused`` before each stream and counts itself in
``gate.inflight``. The Locust worker (own process) sees the pause file, lets its running tasks end, appends their
records to the records file and writes ``<pause file>.ack`` (``locust_users.watch_pause``).
"""
from __future__ import annotations

import os
import threading
import time


class Gate:
    def __init__(self, pause_path: str, *, locust: bool) -> None:
        self.pause_path, self.ack_path, self.locust = pause_path, pause_path + ".ack", locust
        self.locust_proc = None          # the worker's Popen: once it has exited (records written) no ack comes
        self.paused = False
        self.inflight = 0
        self._lock = threading.Lock()
        self.resume()

    def enter(self) -> None:
        with self._lock:
            self.inflight += 1

    def leave(self) -> None:
        with self._lock:
            self.inflight -= 1

    def pause(self, timeout_s: float = 60.0) -> float:
        """Stops new requests and waits for the running ones; seconds waited. TimeoutError after ``timeout_s``."""
        start = time.monotonic()
        self.paused = True
        if self.locust:
            open(self.pause_path, "w").close()
        while self.inflight or (self.locust and not os.path.exists(self.ack_path) and self._locust_running()):
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"load did not pause within {timeout_s} s (streams in flight: {self.inflight}, "
                                   f"Locust acknowledged: {os.path.exists(self.ack_path)})")
            time.sleep(0.05)
        return time.monotonic() - start

    def _locust_running(self) -> bool:
        return self.locust_proc is None or self.locust_proc.poll() is None

    def resume(self) -> None:
        for p in (self.pause_path, self.ack_path):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass
        self.paused = False
