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
