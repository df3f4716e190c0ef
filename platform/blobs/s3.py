"""Blob store on S3 (or any S3-compatible server) through boto3.

Uploads are multipart (one part in memory at a time, each with a SHA-256 checksum S3 verifies), aborted on any
failure so no object appears unless every part landed. botocore retries each call (standard mode, bounded
attempts); connection failures surface as ``BlobStoreUnavailable``. A multipart upload that cannot be aborted
(the server is gone, or the process was killed) is never visible as an object; ``incomplete_uploads`` lists it
(ListMultipartUploads) and ``abort_incomplete`` aborts it: the janitor does both (``uploads/janitor.py``). A bucket
lifecycle rule (AbortIncompleteMultipartUpload) is a good second net.
"""
from __future__ import annotations

import base64
import hashlib
import logging
from typing import Callable, Iterator

from loraplex.platform.blobs.base import BlobInfo, BlobNotFound, BlobStoreUnavailable, IncompleteUpload
from loraplex.platform.core import checkpoints

log = logging.getLogger(__name__)


def _b64_sha256(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


class S3BlobStore:
    """Blobs as objects of one bucket."""

    def __init__(self, *, bucket: str, endpoint_url: str | None = None, region: str = "us-east-1",
                 access_key_id: str | None = None, secret_access_key: str | None = None,
                 part_size: int = 16 * 1024 * 1024, max_attempts: int = 4, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 60.0) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, self.part_size = bucket, part_size
        self.client = boto3.client(
            "s3", endpoint_url=endpoint_url, region_name=region, aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            config=Config(retries={"max_attempts": max_attempts, "mode": "standard"},
                          connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _unavailable(self, what: str, e: Exception) -> BlobStoreUnavailable:
        return BlobStoreUnavailable(f"blob store unavailable ({what}): {type(e).__name__}: {e}")

    def put_file(self, key: str, path: str, *, sha256: str,
                 on_progress: Callable[[int], None] | None = None) -> str:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            upload_id = self.client.create_multipart_upload(
                Bucket=self.bucket, Key=key, ChecksumAlgorithm="SHA256", Metadata={"sha256": sha256})["UploadId"]
        except (BotoCoreError, ClientError) as e:
            raise self._unavailable(f"starting upload of {key}", e) from e
        try:
            parts, digest, done = [], hashlib.sha256(), 0
            with open(path, "rb") as f:
                number = 1
                while True:
                    data = f.read(self.part_size)
                    if not data and number > 1:
                        break
                    digest.update(data)
                    checksum = _b64_sha256(data)
                    resp = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                   PartNumber=number, Body=data, ChecksumSHA256=checksum)
                    parts.append({"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": checksum})
                    if number == 1:
                        checkpoints.reached("blob.part_stored")
                    number += 1
                    done += len(data)
                    if on_progress is not None:
                        on_progress(done)
                    if not data:
                        break
                    del data
            if digest.hexdigest() != sha256:
                raise BlobStoreUnavailable(f"checksum mismatch uploading {key}: the source changed during the upload")
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts})
            checkpoints.reached("blob.completed")
        except BaseException as e:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:  # the server is gone; the lifecycle rule cleans up
                log.warning("could not abort multipart upload of %s", key)
            if isinstance(e, (BotoCoreError, ClientError)):
                raise self._unavailable(f"uploading {key}", e) from e
            raise
        return self.uri(key)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._unavailable(f"checking {key}", e) from e
        except BotoCoreError as e:
            raise self._unavailable(f"checking {key}", e) from e

    def iter_chunks(self, key: str, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise BlobNotFound(key) from None
            raise self._unavailable(f"reading {key}", e) from e
        except BotoCoreError as e:
            raise self._unavailable(f"reading {key}", e) from e
        with body:
            yield from body.iter_chunks(chunk_bytes)

    def download_file(self, key: str, path: str) -> None:
        with open(path, "wb") as out:
            for chunk in self.iter_chunks(key):
                out.write(chunk)

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except (BotoCoreError, ClientError) as e:
            raise self._unavailable(f"deleting {key}", e) from e

    def list_keys(self, prefix: str = "") -> list[str]:
        return [b.key for b in self.list_blobs(prefix)]

    def list_blobs(self, prefix: str = "") -> list[BlobInfo]:
        from botocore.exceptions import BotoCoreError, ClientError

        out = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                out += [BlobInfo(o["Key"], o["LastModified"]) for o in page.get("Contents", [])]
        except (BotoCoreError, ClientError) as e:
            raise self._unavailable(f"listing {prefix!r}", e) from e
        return sorted(out, key=lambda b: b.key)

    def incomplete_uploads(self, prefix: str = "") -> list[IncompleteUpload]:
        from botocore.exceptions import BotoCoreError, ClientError

        out = []
        try:
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                                    Prefix=prefix):
                out += [IncompleteUpload(key=u["Key"], upload_id=u["UploadId"], initiated=u["Initiated"])
                        for u in page.get("Uploads", [])]
        except (BotoCoreError, ClientError) as e:
            raise self._unavailable(f"listing multipart uploads under {prefix!r}", e) from e
        return sorted(out, key=lambda u: (u.key, u.upload_id))

    def abort_incomplete(self, upload: IncompleteUpload) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload.key, UploadId=upload.upload_id)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchUpload", "404"):
                return
            raise self._unavailable(f"aborting the upload of {upload.key}", e) from e
        except BotoCoreError as e:
            raise self._unavailable(f"aborting the upload of {upload.key}", e) from e

    def ensure_bucket(self) -> None:
        """Creates the bucket if it does not exist (development and tests)."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            self.client.create_bucket(Bucket=self.bucket)
