"""Helpers of the fault tests: figures written to ``LORAPLEX_FAULT_REPORT`` (JSON) for docs/reliability.md, and
waiting for a condition with the time it took."""
from __future__ import annotations

import json
import os
import time

FIGURES: dict[str, dict] = {}


def record_figures(fault: str, **figures) -> None:
    FIGURES[fault] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in figures.items()}
    path = os.environ.get("LORAPLEX_FAULT_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(FIGURES, f, indent=1)


def wait_for(cond, timeout_s: float, what: str, interval_s: float = 0.1) -> float:
    """Seconds until ``cond()`` was true; AssertionError after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if cond():
            return time.monotonic() - start
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def clear(kind: str) -> bool:
    """An outcome that says what went wrong (no transport error, no error without a message, no silent cut)."""
    return not (kind.startswith("transport:") or kind.startswith("unclear") or kind == "stream_cut_without_done")
