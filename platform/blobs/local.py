"""Blob store on a local folder (the embedded default)."""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Iterator

from loraplex.platform.blobs.base import BlobNotFound, BlobStoreUnavailable


class LocalBlobStore:
    """Blobs as files under ``root``; a write goes to a temp file in the same folder, then an atomic rename."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        path = os.path.abspath(os.path.join(self.root, key))
        if not path.startswith(self.root + os.sep):
            raise ValueError(f"blob key {key!r} leaves the blob folder")
        return path

    def uri(self, key: str) -> str:
        return "file://" + self._path(key)

    def put_file(self, key: str, path: str, *, sha256: str) -> str:
        dest = self._path(key)
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".part-")
        except OSError as e:
            raise BlobStoreUnavailable(f"blob folder {self.root} is not writable: {e}") from e
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != sha256:
                raise BlobStoreUnavailable(f"checksum mismatch writing {key}: the source changed during the copy")
            os.replace(tmp, dest)
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
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def list_keys(self, prefix: str = "") -> list[str]:
        keys = []
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if name.startswith(".part-"):
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)
