"""UploadTracker: uploads in flight (bytes received of the declared length, stage) and the last finished ones, for
the dashboard's progress report. The ASGI middleware (``middleware.py``) feeds it; nothing here knows HTTP.

    start(id, total_bytes) ─▶ received(id, n)* ─▶ body_done(id)  (stage "validating": checks, sha256, blob write)
                                                      ─▶ finish(id, status, outcome, reason)
    note(id, tenant=..., adapter=..., version=...)    the route names the upload as soon as it knows
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable


@dataclass
class UploadProgress:
    upload_id: str
    started: float
    total_bytes: int | None        # from Content-Length; None for a chunked body
    received_bytes: int = 0
    stage: str = "receiving"       # receiving -> validating -> done
    status: int | None = None
    outcome: str | None = None
    reason: str | None = None
    finished: float | None = None
    tenant: str | None = None      # names, once the route knows them (tenant name, adapter name, version number)
    adapter: str | None = None
    version: int | None = None

    def as_dict(self, now: float) -> dict:
        d = asdict(self)
        d["fraction"] = (min(1.0, self.received_bytes / self.total_bytes) if self.total_bytes else None)
        d["elapsed_s"] = (self.finished or now) - self.started
        return d


class UploadTracker:
    """Thread-safe registry of uploads in flight and the last ``max_recent`` finished ones."""

    def __init__(self, max_recent: int = 20, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._active: dict[str, UploadProgress] = {}
        self._recent: deque[UploadProgress] = deque(maxlen=max_recent)
        self._lock = threading.Lock()

    def start(self, upload_id: str, total_bytes: int | None) -> None:
        with self._lock:
            self._active[upload_id] = UploadProgress(upload_id, self.clock(), total_bytes)

    def received(self, upload_id: str, num_bytes: int) -> None:
        with self._lock:
            p = self._active.get(upload_id)
            if p is not None:
                p.received_bytes += num_bytes

    def note(self, upload_id: str, **names) -> None:
        """Names an upload in flight: ``tenant``, ``adapter``, ``version`` (only the ones given change)."""
        with self._lock:
            p = self._active.get(upload_id)
            if p is not None:
                for k in ("tenant", "adapter", "version"):
                    if k in names:
                        setattr(p, k, names[k])

    def tenant_of(self, upload_id: str) -> str | None:
        with self._lock:
            p = self._active.get(upload_id)
            return p.tenant if p is not None else None

    def body_done(self, upload_id: str) -> None:
        with self._lock:
            p = self._active.get(upload_id)
            if p is not None and p.stage == "receiving":
                p.stage = "validating"

    def finish(self, upload_id: str, *, status: int | None, outcome: str, reason: str) -> None:
        with self._lock:
            p = self._active.pop(upload_id, None)
            if p is None:
                return
            p.stage, p.status, p.outcome, p.reason, p.finished = "done", status, outcome, reason, self.clock()
            self._recent.append(p)

    def snapshot(self) -> dict:
        """``{"active": [...], "recent": [...newest first]}``, each with ``fraction`` and ``elapsed_s``."""
        now = self.clock()
        with self._lock:
            return {"active": [p.as_dict(now) for p in self._active.values()],
                    "recent": [p.as_dict(now) for p in reversed(self._recent)]}
