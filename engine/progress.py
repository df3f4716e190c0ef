"""Progress bars for long work a person waits on (model load, adapter fetch and checks, kernel tuning): tqdm with
one set of defaults, so every bar in loraplex looks and behaves the same.

    with progress(total=len(tensors), desc="Loading weights", unit="tensor") as bar:
        for ...: bar.update(1)
    for case in progress(cases, desc="Tuning fused_moe"): ...
    with byte_progress(total=size, desc="Fetching adapter") as bar: bar.update(len(chunk))

Bars go to stderr, refresh at most twice a second and vanish when done (``leave=False``). They are off when
stderr is not a terminal (logs, CI) unless ``LORAPLEX_PROGRESS=1``; ``LORAPLEX_PROGRESS=0`` turns them off
everywhere. Bars never show prompts or adapter contents, only counts.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Iterable

ENV = "LORAPLEX_PROGRESS"


def progress_enabled(stream: Any = None) -> bool:
    """``LORAPLEX_PROGRESS`` (1/0, true/false, on/off) if set, else whether ``stream`` (stderr) is a terminal."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    stream = stream if stream is not None else sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def progress(iterable: Iterable | None = None, *, total: int | float | None = None, desc: str = "",
             unit: str = "it", enabled: bool | None = None, **kwargs: Any):
    """A tqdm bar with loraplex's defaults; ``enabled=None`` follows ``progress_enabled()``. Extra keyword
    arguments go to tqdm. A disabled bar still counts (``bar.n``) and works as a context manager."""
    from tqdm.auto import tqdm

    options: dict[str, Any] = dict(total=total, desc=desc, unit=unit, leave=False, mininterval=0.5,
                                   dynamic_ncols=True, file=sys.stderr,
                                   disable=not (progress_enabled() if enabled is None else enabled))
    options.update(kwargs)
    return tqdm(iterable, **options)


def byte_progress(total: int | None, desc: str, **kwargs: Any):
    """A bar counting bytes (KiB/MiB/GiB scaling), for downloads and hashing."""
    return progress(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, **kwargs)
