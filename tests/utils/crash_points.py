"""The ``loraplex`` CLI with a crash hook, for the crash-safety tests of uploads:

    LORAPLEX_CRASH_FILE=/tmp/crash python -m tests.utils.crash_points serve --port 8000
    echo blob.completed > /tmp/crash        # the next upload to reach that step kills the process (SIGKILL)

At every checkpoint of the upload path (``loraplex.platform.core.checkpoints.STEPS``) the hook reads the file; when
it names that step the process sends itself SIGKILL: no ``finally``, no abort of the multipart upload, no cleanup,
exactly a ``kill -9`` at that point. An empty or missing file: the platform runs normally. Production code never
installs a hook; only this entry point does.
"""
from __future__ import annotations

import os
import signal
import sys

from loraplex.platform.core import checkpoints


def crash_if_named(step: str) -> None:
    path = os.environ.get("LORAPLEX_CRASH_FILE")
    if not path:
        return
    try:
        with open(path) as f:
            wanted = f.read().strip()
    except FileNotFoundError:
        return
    if wanted == step:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    checkpoints.install(crash_if_named)
    from loraplex.cli import main

    sys.exit(main(sys.argv[1:]))
