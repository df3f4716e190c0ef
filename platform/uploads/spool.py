"""Where uploads are streamed before validation, laid out so that the leftovers of a killed process can be found:

    <SPOOL_DIR>/                     default: <system temp dir>/loraplex-spool
      <instance>/                    one folder per platform process ("<host>-<pid>-<random>")
        owner.json                   {"instance", "host", "pid", "pid_start"}; touched every SPOOL_LEASE_S / 4
        upload-<random>/             one per upload in progress, removed when the request ends

``sweep()`` removes the folders of other instances whose owner is gone: on this host, when no process with that pid
and start time (``/proc/<pid>/stat``) runs, so a restarted container whose new process got the same pid is still
told apart; for folders of other hosts (a shared volume) or without ``owner.json``, when they were not touched for
``SPOOL_LEASE_S``. A live process's folders are never touched, however old.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
from typing import Any, Iterator

logger = logging.getLogger(__name__)

OWNER = "owner.json"
HOST = socket.gethostname()


def _pid_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), or None when it does not run (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(owner: dict) -> bool | None:
    """Whether the owner of a spool folder still runs; None when this host cannot tell (another host)."""
    if owner.get("host") != HOST or not isinstance(owner.get("pid"), int):
        return None
    start = _pid_start(owner["pid"])
    if os.path.isdir("/proc/self"):
        return start is not None and start == owner.get("pid_start")
    try:                                     # no /proc: the pid alone
        os.kill(owner["pid"], 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Spool:
    """The spool folders of this process under ``root``."""

    def __init__(self, root: str, *, lease_s: float = 60.0, instance: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.lease_s = lease_s
        self.instance = instance or f"{HOST}-{os.getpid()}-{secrets.token_hex(3)}"
        self.dir = os.path.join(self.root, self.instance)
        self._last_beat = 0.0

    def _ensure(self) -> None:
        if os.path.isfile(os.path.join(self.dir, OWNER)):
            return
        os.makedirs(self.dir, exist_ok=True)
        owner = {"instance": self.instance, "host": HOST, "pid": os.getpid(), "pid_start": _pid_start(os.getpid())}
        tmp = os.path.join(self.dir, f".{OWNER}.tmp")
        with open(tmp, "w") as f:
            json.dump(owner, f)
        os.replace(tmp, os.path.join(self.dir, OWNER))

    @contextlib.contextmanager
    def upload_dir(self) -> Iterator[str]:
        """A fresh folder for one upload, removed (with everything in it) when the block ends."""
        self._ensure()
        path = tempfile.mkdtemp(dir=self.dir, prefix="upload-")
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def heartbeat(self) -> None:
        """Marks this process's folder as in use (for sweeps that cannot check the pid: other hosts)."""
        self._ensure()
        os.utime(os.path.join(self.dir, OWNER))
        self._last_beat = time.time()

    def sweep(self) -> list[str]:
        """Removes the folders of instances that are gone; returns their paths."""
        removed = []
        try:
            entries = os.listdir(self.root)
        except FileNotFoundError:
            return removed
        now = time.time()
        for name in entries:
            path = os.path.join(self.root, name)
            if name == self.instance or not os.path.isdir(path):
                continue
            owner = _read_owner(path)
            alive = _alive(owner) if owner is not None else None
            if alive is None:
                alive = now - _mtime(os.path.join(path, OWNER) if owner is not None else path) < self.lease_s
            if not alive:
                shutil.rmtree(path, ignore_errors=True)
                if not os.path.exists(path):
                    removed.append(path)
                    logger.info("removed spool folder %s of a process that is gone", path)
        return removed

    def close(self) -> None:
        """Removes this process's folder (at shutdown; uploads in it are over)."""
        shutil.rmtree(self.dir, ignore_errors=True)


def _read_owner(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, OWNER)) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else None
    except (OSError, ValueError):
        return None


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def spool_of(app: Any) -> Spool:
    """The app's spool (``app.state.spool``, made from the settings on first use)."""
    spool = getattr(app.state, "spool", None)
    if spool is None:
        settings = app.state.settings
        spool = app.state.spool = Spool(settings.spool_path, lease_s=settings.spool_lease_s)
    return spool
