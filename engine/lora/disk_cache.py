"""DiskCache: the adapter manager's folder of fetched adapters, least recently used first out past a byte cap.

    <root>/<sha256>-<uri digest>/{adapter_config.json, adapter_model.safetensors}   an entry (AdapterManager.cache_key)
    <root>/.fetch-XXXX/        a fetch in flight (the manager's download folder), renamed into place when verified
    <root>/.evict-XXXX/        an entry being deleted (renamed first, so no one ever reads half an entry)

    entry = cache.lookup(key)              # a hit: held (never evicted while held) and marked used; or None
    entry = cache.publish(folder, key)     # a verified fetch moves in, held; None when it is bigger than the cap
    ...read entry.path...
    cache.release(entry)                   # then LRU entries nobody holds go until the cache fits max_bytes
    cache.discard(entry)                   # a bad adapter: gone at once

Recency is a use (a load from disk or a fetch) and is kept in each entry folder's mtime, so that a restarted engine
rebuilds the LRU order by scanning the folder (``.fetch-*`` / ``.evict-*`` leftovers and incomplete entries of a
crashed run are deleted; names that are not entries, e.g. a volume's ``lost+found``, are left alone and not
counted). Evicting an entry only costs a fetch: the next load of its adapter fetches it again (weights already in
the CPU tier or a GPU slot never read the disk again). An adapter bigger than the whole cap is still served but
never cached: it is loaded from its download folder, which is deleted after the load (a warning says so; each
load fetches it again). ``max_bytes`` None: no cap; 0: nothing is cached. One engine per folder: the cap counts
what this process put there or found at start.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENTRY_NAME = re.compile(r"^[0-9a-f]{64}-[0-9a-f]{16}$")
ENTRY_FILES = ("adapter_config.json", "adapter_model.safetensors")
LEFTOVER_PREFIXES = (".fetch-", ".evict-")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?b?\s*$", re.IGNORECASE)


def parse_size(text: str | int | None) -> int | None:
    """``"20GiB"``, ``"20Gi"``, ``"500M"`` (decimal), ``"1048576"`` -> bytes; ``"none"`` / ``"unlimited"`` / None ->
    None (no cap). Raises ValueError on anything else."""
    if text is None or isinstance(text, int) and not isinstance(text, bool):
        if text is not None and text < 0:
            raise ValueError(f"a size must be >= 0, got {text}")
        return text
    if str(text).strip().lower() in ("none", "unlimited"):
        return None
    m = _SIZE.match(str(text))
    if m is None:
        raise ValueError(f"cannot read {text!r} as a size: expected bytes, e.g. 21474836480, 20GiB, 20Gi, 500MB or "
                         "none")
    number, unit, binary = m.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def folder_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (their sizes, not the blocks they take)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:
                pass
    return total


@dataclass(eq=False)
class DiskEntry:
    """One cached adapter folder. ``users``: loads reading it now (an entry with users is never evicted)."""

    key: str
    path: str
    nbytes: int
    users: int = 0


class DiskCache:
    """The cache folder ``root`` capped at ``max_bytes`` (None: unbounded). Thread-safe."""

    def __init__(self, root: str, max_bytes: int | None = None) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"adapter cache max_bytes must be None or an integer >= 0, got {max_bytes!r}")
        self.root, self.max_bytes = root, max_bytes
        os.makedirs(root, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, DiskEntry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self.evictions = 0       # entries removed to fit the cap (since start)
        self.oversized = 0       # fetches too big to cache at all
        self._scan()

    # ---- queries ----------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the entries (downloads in flight not counted)."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[str]:
        """Entry names, least recently used first."""
        with self._lock:
            return list(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {"bytes": self._bytes, "entries": len(self._entries), "max_bytes": self.max_bytes,
                    "evictions": self.evictions, "oversized": self.oversized}

    # ---- use --------------------------------------------------------------------------------------------------
    def lookup(self, key: str) -> DiskEntry | None:
        """The entry ``key``, held until ``release`` and marked most recently used; None on a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            entry.users += 1
            self._entries.move_to_end(key)
        self._touch(entry.path)
        return entry

    def temp_dir(self) -> str:
        """A fresh ``.fetch-*`` folder for a download (on the same file system, so ``publish`` is a rename)."""
        return tempfile.mkdtemp(prefix=".fetch-", dir=self.root)

    def publish(self, folder: str, key: str, *, label: str = "") -> DiskEntry | None:
        """Move the verified download ``folder`` in as ``key`` and hold it (if a racing load of the same key got
        there first, that entry is held and ``folder`` left to the caller). Least recently used entries nobody
        holds are evicted until the cache fits. None, leaving ``folder`` in place, when ``folder`` alone is bigger
        than the cap: the caller loads from it and deletes it. ``label`` names the adapter in the warning."""
        size = folder_bytes(folder)
        if self.max_bytes is not None and size > self.max_bytes:
            with self._lock:
                self.oversized += 1
            if self.max_bytes:
                logger.warning("adapter %s is %d bytes, more than the whole adapter disk cache (max %d bytes): it is "
                               "served but not cached, so every load of it fetches it again; raise "
                               "adapter_cache_max_bytes to cache it", label or key, size, self.max_bytes)
            return None
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                path = os.path.join(self.root, key)
                if os.path.isdir(path) and not os.path.islink(path):  # not an entry (made behind our back): replace
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.lexists(path):
                    os.remove(path)
                os.rename(folder, path)
                entry = DiskEntry(key, path, size)
                self._entries[key] = entry
                self._bytes += size
            entry.users += 1
            self._entries.move_to_end(key)
            doomed = self._pick_victims()
        self._touch(entry.path)
        self._delete(doomed)
        return entry

    def release(self, entry: DiskEntry) -> None:
        """The load that held ``entry`` is over; evict what no longer fits."""
        with self._lock:
            entry.users = max(0, entry.users - 1)
            doomed = self._pick_victims()
        self._delete(doomed)

    def discard(self, entry: DiskEntry) -> None:
        """Delete ``entry`` now (its bytes failed a check): the next load of its adapter fetches it again."""
        with self._lock:
            doomed = []
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                self._bytes -= entry.nbytes
                doomed = [self._to_graveyard(entry.path)]
        self._delete(doomed)

    # ---- internals --------------------------------------------------------------------------------------------
    def _pick_victims(self) -> list[str | None]:
        """Under the lock: drop entries, least recently used first and never held ones, until within the cap;
        each is renamed out of its name at once. Returns the renamed folders for ``_delete``."""
        doomed: list[str | None] = []
        if self.max_bytes is None or self._bytes <= self.max_bytes:
            return doomed
        for key, entry in list(self._entries.items()):
            if self._bytes <= self.max_bytes:
                break
            if entry.users:
                continue
            del self._entries[key]
            self._bytes -= entry.nbytes
            self.evictions += 1
            doomed.append(self._to_graveyard(entry.path))
            logger.info("adapter disk cache: evicted %s (%d bytes), %d bytes left of %d", key, entry.nbytes,
                        self._bytes, self.max_bytes)
        return doomed

    def _to_graveyard(self, path: str) -> str | None:
        grave = os.path.join(self.root, f".evict-{os.path.basename(path)}-{time.monotonic_ns()}")
        try:
            os.rename(path, grave)
            return grave
        except OSError:  # already gone
            return None

    @staticmethod
    def _delete(paths: list[str | None]) -> None:
        for path in paths:
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def _touch(path: str) -> None:
        try:
            os.utime(path)  # the folder's mtime is its recency across restarts
        except OSError:
            pass

    def _scan(self) -> None:
        """Start-up: index the entries already there, oldest use first; delete leftovers of a crashed run."""
        found: list[tuple[float, str, int]] = []
        dropped = 0
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith(LEFTOVER_PREFIXES):
                shutil.rmtree(path, ignore_errors=True)
                dropped += 1
                continue
            if not ENTRY_NAME.match(name) or not os.path.isdir(path) or os.path.islink(path):
                continue
            if not all(os.path.isfile(os.path.join(path, f)) for f in ENTRY_FILES):
                shutil.rmtree(path, ignore_errors=True)  # half an entry: the next load fetches it again
                dropped += 1
                continue
            found.append((os.stat(path).st_mtime, name, folder_bytes(path)))
        for _mtime, name, size in sorted(found):
            self._entries[name] = DiskEntry(name, os.path.join(self.root, name), size)
            self._bytes += size
        with self._lock:
            doomed = self._pick_victims()  # the cap may be lower than in the last run
        self._delete(doomed)
        if found or dropped:
            logger.info("adapter disk cache %s: %d entries (%d bytes) found, %d evicted to fit, %d leftovers "
                        "deleted", self.root, len(found), sum(s for _, _, s in found), len(doomed), dropped)
