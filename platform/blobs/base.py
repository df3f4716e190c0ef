"""The blob store interface. Keys are relative paths (``adapters/<tenant>/<adapter>/<sha256>.safetensors``);
URIs (``s3://bucket/key``, ``file:///abs/path``) are what the registry stores and engines fetch."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Iterator, Protocol, runtime_checkable


class BlobStoreUnavailable(RuntimeError):
    """The store could not be reached or refused the operation; retry later (the API answers 503)."""


class BlobNotFound(KeyError):
    """No blob under that key."""


@dataclass(frozen=True)
class BlobInfo:
    key: str
    modified: datetime    # timezone-aware


@dataclass(frozen=True)
class IncompleteUpload:
    """A blob write that never finished (its process died): an S3 multipart upload that was neither completed nor
    aborted, or a local store's temp file. It is never visible as a blob; ``abort_incomplete`` removes it."""

    key: str
    upload_id: str
    initiated: datetime


@runtime_checkable
class BlobStore(Protocol):
    """Streaming blob storage. Writes are all-or-nothing: a failed ``put_file`` leaves no object behind."""

    def uri(self, key: str) -> str:
        """The URI of ``key`` as stored in the registry."""

    def put_file(self, key: str, path: str, *, sha256: str,
                 on_progress: Callable[[int], None] | None = None) -> str:
        """Streams the file at ``path`` to ``key`` (checksummed with ``sha256``, hex); returns its URI.
        ``on_progress(bytes so far)`` is called after each part; an exception from it aborts the write."""

    def exists(self, key: str) -> bool:
        """Whether a complete blob is stored under ``key``."""

    def iter_chunks(self, key: str, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
        """Streams a blob's bytes."""

    def download_file(self, key: str, path: str) -> None:
        """Streams a blob to a local file."""

    def delete(self, key: str) -> None:
        """Removes ``key``; removing a missing key is not an error."""

    def list_keys(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix``."""

    def list_blobs(self, prefix: str = "") -> list[BlobInfo]:
        """Every blob under ``prefix`` with its last modification time."""

    def incomplete_uploads(self, prefix: str = "") -> list[IncompleteUpload]:
        """Writes under ``prefix`` that were started and never completed or aborted."""

    def abort_incomplete(self, upload: IncompleteUpload) -> None:
        """Removes an incomplete write (gone already is not an error)."""
