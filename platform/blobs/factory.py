"""Builds the configured blob store."""
from __future__ import annotations

from loraplex.platform.blobs.base import BlobStore
from loraplex.platform.core.config import Settings


def make_blob_store(settings: Settings) -> BlobStore:
    if settings.blob_backend == "s3":
        from loraplex.platform.blobs.s3 import S3BlobStore

        secret = settings.s3_secret_access_key
        return S3BlobStore(bucket=settings.s3_bucket, endpoint_url=settings.s3_endpoint_url,
                           region=settings.s3_region, access_key_id=settings.s3_access_key_id,
                           secret_access_key=secret.get_secret_value() if secret else None,
                           part_size=settings.s3_part_size, max_attempts=settings.s3_max_attempts,
                           connect_timeout_s=settings.s3_connect_timeout_s, read_timeout_s=settings.s3_read_timeout_s)
    from loraplex.platform.blobs.local import LocalBlobStore

    return LocalBlobStore(settings.blob_path)
