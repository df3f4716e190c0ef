"""Named points of the upload path where a crash-safety test may stop the process.

    upload.validated      the upload is spooled and validated; no registry row yet
    upload.recorded       the version row (``uploading``, with its intended blob key) is committed; no byte stored
    blob.part_stored      the first part of the blob is in the store (S3: an incomplete multipart upload)
    blob.completed        the blob is complete in the store; the registry still says ``uploading``
    upload.committing     the ``ready`` update is flushed; the commit is next

``reached(step)`` does nothing unless a hook was installed (``install``); the platform never installs one. The
crash tests start ``loraplex serve`` through ``tests/utils/crash_points.py``, which installs a hook that SIGKILLs the
process at the step named in a file (see ``docs/platform.md``, "Crash safety and the janitor").
"""
from __future__ import annotations

from typing import Callable

STEPS = ("upload.validated", "upload.recorded", "blob.part_stored", "blob.completed", "upload.committing")

_hook: Callable[[str], None] | None = None


def install(hook: Callable[[str], None] | None) -> None:
    """Calls ``hook(step)`` at every checkpoint from now on (None: remove it)."""
    global _hook
    _hook = hook


def reached(step: str) -> None:
    if _hook is not None:
        _hook(step)
