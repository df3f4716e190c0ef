"""Both blob stores through the same checks; S3 against moto's server process."""
from __future__ import annotations

import hashlib
import os
import uuid

import pytest

from loraplex.platform.blobs.base import BlobNotFound, BlobStoreUnavailable
from loraplex.platform.blobs.local import LocalBlobStore
from loraplex.platform.blobs.s3 import S3BlobStore
from tests.utils.services import free_port


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, moto):
    if request.param == "local":
        return LocalBlobStore(str(tmp_path / "blobs"))
    s = S3BlobStore(bucket=f"b-{uuid.uuid4().hex[:12]}", endpoint_url=moto.endpoint, access_key_id="testing",
                    secret_access_key="testing", part_size=5000)
    s.ensure_bucket()
    return s


def blob(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / f"src-{size}"
    path.write_bytes(data)
    return str(path), data, hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("size", [0, 4999, 5000, 23456])
def test_roundtrip_multipart(store, tmp_path, size):
    path, data, sha = blob(tmp_path, size)
    key = f"adapters/t/a/{sha}.safetensors"
    uri = store.put_file(key, path, sha256=sha)
    assert uri == store.uri(key) and store.exists(key)
    assert b"".join(store.iter_chunks(key, 4096)) == data
    out = tmp_path / "out"
    store.download_file(key, str(out))
    assert out.read_bytes() == data
    assert store.list_keys("adapters/t/") == [key] and store.list_keys("adapters/x/") == []
    store.delete(key)
    store.delete(key)  # idempotent
    assert not store.exists(key) and store.list_keys() == []
    with pytest.raises(BlobNotFound):
        list(store.iter_chunks(key))


def test_checksum_mismatch_leaves_nothing(store, tmp_path):
    path, _, _ = blob(tmp_path, 12000)
    with pytest.raises(BlobStoreUnavailable, match="checksum mismatch"):
        store.put_file("adapters/t/a/x.safetensors", path, sha256="0" * 64)
    assert store.list_keys() == []


def test_s3_down(tmp_path):
    s = S3BlobStore(bucket="b", endpoint_url=f"http://127.0.0.1:{free_port()}", access_key_id="x",
                    secret_access_key="x", max_attempts=1, connect_timeout_s=0.5)
    path, _, sha = blob(tmp_path, 10)
    with pytest.raises(BlobStoreUnavailable, match="blob store unavailable"):
        s.put_file("adapters/t/a/k", path, sha256=sha)
    with pytest.raises(BlobStoreUnavailable):
        s.exists("adapters/t/a/k")


def test_local_store_refuses_keys_outside_its_folder(tmp_path):
    with pytest.raises(ValueError, match="leaves the blob folder"):
        LocalBlobStore(str(tmp_path)).exists("../../etc/passwd")


def _leave_incomplete(store, key: str) -> None:
    """What a process killed in the middle of ``put_file`` leaves behind."""
    if isinstance(store, S3BlobStore):
        upload_id = store.client.create_multipart_upload(Bucket=store.bucket, Key=key)["UploadId"]
        store.client.upload_part(Bucket=store.bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"x" * 100)
    else:
        path = store._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.part-abc123"), "wb") as f:
            f.write(b"x" * 100)


def test_incomplete_uploads_are_listed_by_key_and_aborted(store, tmp_path):
    keys = ["adapters/t1/a/v1/s.safetensors", "adapters/t1/b/v2/s.safetensors", "adapters/t2/a/v3/s.safetensors"]
    for key in keys:
        _leave_incomplete(store, key)
    path, _, sha = blob(tmp_path, 100)
    store.put_file("adapters/t1/a/v4/s.safetensors", path, sha256=sha)      # a complete one is not listed
    assert [u.key for u in store.incomplete_uploads("adapters/")] == keys
    assert [u.key for u in store.incomplete_uploads("adapters/t1/")] == keys[:2]
    assert store.list_keys() == ["adapters/t1/a/v4/s.safetensors"]          # never visible as blobs
    assert all(u.initiated.tzinfo is not None for u in store.incomplete_uploads())
    for u in store.incomplete_uploads("adapters/t1/"):
        store.abort_incomplete(u)
        store.abort_incomplete(u)                                           # gone already: not an error
    assert [u.key for u in store.incomplete_uploads()] == keys[2:]


def test_progress_callback_sees_every_part_and_can_abort(store, tmp_path):
    path, _, sha = blob(tmp_path, 12000)
    seen = []
    store.put_file("adapters/t/a/v1/s.safetensors", path, sha256=sha, on_progress=seen.append)
    assert seen[-1] == 12000 and seen == sorted(seen) and len(seen) >= (3 if isinstance(store, S3BlobStore) else 1)

    def refuse(done: int) -> None:
        raise RuntimeError("the registry says this upload expired")
    with pytest.raises(RuntimeError, match="expired"):
        store.put_file("adapters/t/a/v2/s.safetensors", path, sha256=sha, on_progress=refuse)
    assert store.list_keys() == ["adapters/t/a/v1/s.safetensors"] and store.incomplete_uploads() == []
