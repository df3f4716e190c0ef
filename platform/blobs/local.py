"""Blob store on a local folder (the embedded default)."""
from __future__ import annotations

import hashlib
import os
import tempfile
from datetime import datetime, timezone
from typing import Callable, Iterator

from loraplex.platform.blobs.base import BlobInfo, BlobNotFound, BlobStoreUnavailable, IncompleteUpload
from loraplex.platform.core import checkpoints

PART_MARK = ".part-"   # temp files: ".<blob file name>.part-<random>" beside the blob


class LocalBlobStore:
    """Blobs as files under ``root``; a write goes to a temp file in the same folder, then an atomic rename. A
    process killed mid-write leaves the temp file: ``incomplete_uploads`` lists it, ``abort_incomplete`` removes it."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        path = os.path.abspath(os.path.join(self.root, key))
        if not path.startswith(self.root + os.sep):
            raise ValueError(f"blob key {key!r} leaves the blob folder")
        return path

    def _key(self, path: str) -> str:
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def uri(self, key: str) -> str:
        return "file://" + self._path(key)

    def put_file(self, key: str, path: str, *, sha256: str,
                 on_progress: Callable[[int], None] | None = None) -> str:
        dest = self._path(key)
        for attempt in range(2):    # a delete may prune the (empty) folder between makedirs and mkstemp: once more
            try:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=f".{os.path.basename(dest)}{PART_MARK}")
                break
            except FileNotFoundError:
                if attempt:
                    raise BlobStoreUnavailable(f"blob folder {self.root} keeps vanishing") from None
            except OSError as e:
                raise BlobStoreUnavailable(f"blob folder {self.root} is not writable: {e}") from e
        try:
            digest, done = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    if done == len(chunk):
                        out.flush()
                        checkpoints.reached("blob.part_stored")
                    if on_progress is not None:
                        on_progress(done)
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != sha256:
                raise BlobStoreUnavailable(f"checksum mismatch writing {key}: the source changed during the copy")
            os.replace(tmp, dest)
            checkpoints.reached("blob.completed")
        except OSError as e:
            raise BlobStoreUnavailable(f"could not write blob {key}: {e}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return self.uri(key)

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def iter_chunks(self, key: str, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
        try:
            f = open(self._path(key), "rb")
        except FileNotFoundError:
            raise BlobNotFound(key) from None
        with f:
            while chunk := f.read(chunk_bytes):
                yield chunk

    def download_file(self, key: str, path: str) -> None:
        with open(path, "wb") as out:
            for chunk in self.iter_chunks(key):
                out.write(chunk)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        _prune_empty_dirs(os.path.dirname(path), self.root)

    def list_keys(self, prefix: str = "") -> list[str]:
        keys = []
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if name.startswith("."):        # temp files of writes in progress (or of a killed process)
                    continue
                key = self._key(os.path.join(dirpath, name))
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def list_blobs(self, prefix: str = "") -> list[BlobInfo]:
        out = []
        for key in self.list_keys(prefix):
            try:
                out.append(BlobInfo(key, datetime.fromtimestamp(os.stat(self._path(key)).st_mtime, timezone.utc)))
            except FileNotFoundError:
                continue
        return out

    def incomplete_uploads(self, prefix: str = "") -> list[IncompleteUpload]:
        out = []
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if not (name.startswith(".") and PART_MARK in name):
                    continue
                path = os.path.join(dirpath, name)
                key = self._key(os.path.join(dirpath, name[1:].rsplit(PART_MARK, 1)[0]))
                if not key.startswith(prefix):
                    continue
                try:
                    initiated = datetime.fromtimestamp(os.stat(path).st_mtime, timezone.utc)
                except FileNotFoundError:
                    continue
                out.append(IncompleteUpload(key=key, upload_id=name, initiated=initiated))
        return sorted(out, key=lambda u: (u.key, u.upload_id))

    def abort_incomplete(self, upload: IncompleteUpload) -> None:
        path = os.path.join(os.path.dirname(self._path(upload.key)), upload.upload_id)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _prune_empty_dirs(path: str, root: str) -> None:
    """Removes ``path`` and its parents up to ``root`` (exclusive) while they are empty."""
    while path.startswith(root + os.sep):
        try:
            os.rmdir(path)
        except OSError:   # not empty (or gone)
            return
        path = os.path.dirname(path)
