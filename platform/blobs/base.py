"""The blob store interface. Keys are relative paths (``adapters/<tenant>/<adapter>/<sha256>.safetensors``);
URIs (``s3://bucket/key``, ``file:///abs/path``) are what the registry stores and engines fetch."""
from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable


class BlobStoreUnavailable(RuntimeError):
    """The store could not be reached or refused the operation; retry later (the API answers 503)."""


class BlobNotFound(KeyError):
    """No blob under that key."""


@runtime_checkable
class BlobStore(Protocol):
    """Streaming blob storage. Writes are all-or-nothing: a failed ``put_file`` leaves no object behind."""

    def uri(self, key: str) -> str:
        """The URI of ``key`` as stored in the registry."""

    def put_file(self, key: str, path: str, *, sha256: str) -> str:
        """Streams the file at ``path`` to ``key`` (checksummed with ``sha256``, hex); returns its URI."""

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
