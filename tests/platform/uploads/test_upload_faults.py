"""Faults during an upload: the blob store down (before and in the middle of a multipart upload) and a database
error after the blob write. Nothing half-written may remain: no ready row, no object."""
from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import text

from tests.platform.conftest import _platform, make_settings, read_files
from tests.utils.services import CuttingProxy, free_port


def s3_platform(pg_url, base_model_dir, endpoint, bucket, **kw):
    return _platform(make_settings(database_url=pg_url, blob_backend="s3", s3_endpoint_url=endpoint, s3_bucket=bucket,
                                   base_model_path=base_model_dir, **kw))


def objects(moto, bucket):
    return moto.client().list_objects_v2(Bucket=bucket).get("Contents", [])


@pytest.fixture
def bucket(moto, pg_url):
    name = f"b-{uuid.uuid4().hex[:12]}"
    moto.client().create_bucket(Bucket=name)
    yield name
    from tests.platform.conftest import TABLES
    from loraplex.platform.db.session import make_engine

    engine = make_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} CASCADE"))
    engine.dispose()


def test_s3_unreachable_is_503_and_nothing_written(pg_url, base_model_dir, moto, bucket, adapter_dir):
    p = s3_platform(pg_url, base_model_dir, f"http://127.0.0.1:{free_port()}", bucket)
    _, auth = p.new_tenant()
    r = p.upload(auth, "m", read_files(adapter_dir(seed=1)))
    assert r.status_code == 503, r.text
    assert "blob store is unavailable; nothing was stored" in r.json()["error"]["message"]
    assert p.ready_rows() == 0
    assert p.sql("SELECT status, error FROM adapter_versions") == [("failed", "blob store unavailable during upload")]
    assert objects(moto, bucket) == []
    assert p.client.get("/v1/adapters/m", headers=auth).json()["aliases"] == {}


def test_s3_dies_mid_multipart_upload(pg_url, base_model_dir, moto, bucket, adapter_dir):
    files = read_files(adapter_dir(seed=1, r=8))
    size = len(files["adapter_model.safetensors"])
    assert size > 40_000  # several 4 KiB parts
    proxy = CuttingProxy(moto.port, cut_after=size // 2)
    p = s3_platform(pg_url, base_model_dir, f"http://127.0.0.1:{proxy.port}", bucket, s3_part_size=4096)
    _, auth = p.new_tenant()
    r = p.upload(auth, "m", files)
    assert proxy.down, "the proxy never cut the connection: the upload did not reach the store"
    assert r.status_code == 503, r.text
    assert "retry the upload later" in r.json()["error"]["message"]
    assert p.ready_rows() == 0
    assert [s for (s,) in p.sql("SELECT status FROM adapter_versions")] == ["failed"]
    assert objects(moto, bucket) == []  # parts of an unfinished multipart upload are never an object
    # the store is back: the same upload now succeeds
    p2 = s3_platform(pg_url, base_model_dir, moto.endpoint, bucket, s3_part_size=4096)
    r = p2.upload(auth, "m", files)
    assert r.status_code == 201 and r.json()["number"] == 2
    assert [o["Key"] for o in objects(moto, bucket)] == p2.store.list_keys() and len(objects(moto, bucket)) == 1


def test_database_error_after_blob_write_removes_the_blob(pg_url, base_model_dir, moto, bucket, adapter_dir):
    p = s3_platform(pg_url, base_model_dir, moto.endpoint, bucket)
    _, auth = p.new_tenant()
    trigger = """
        CREATE OR REPLACE FUNCTION refuse_ready() RETURNS trigger AS $$
        BEGIN RAISE EXCEPTION 'injected registry failure'; END; $$ LANGUAGE plpgsql;
        CREATE TRIGGER refuse_ready BEFORE UPDATE ON adapter_versions
        FOR EACH ROW WHEN (NEW.status = 'ready') EXECUTE FUNCTION refuse_ready();"""
    with p.session_factory() as s:
        s.execute(text(trigger))
        s.commit()
    puts = []
    real_put = p.store.put_file
    p.store.put_file = lambda *a, **k: puts.append(real_put(*a, **k)) or puts[-1]
    try:
        r = p.upload(auth, "m", read_files(adapter_dir(seed=1)))
    finally:
        with p.session_factory() as s:
            s.execute(text("DROP TRIGGER refuse_ready ON adapter_versions; DROP FUNCTION refuse_ready();"))
            s.commit()
    assert r.status_code == 503, r.text
    assert "registry failed while recording the upload; nothing was stored" in r.json()["error"]["message"]
    assert len(puts) == 1, "the blob was never written, so the fault came too early"
    assert objects(moto, bucket) == []
    assert p.ready_rows() == 0
    assert [s for (s,) in p.sql("SELECT status FROM adapter_versions")] == ["failed"]


def test_blob_stored_but_answer_lost_is_removed_once_the_store_is_back(pg_url, base_model_dir, moto, bucket,
                                                                       adapter_dir):
    """S3 completes the multipart upload, the answer is lost and the store stays down for the cleanup: the upload
    is a 503 and a failed row, and its object goes as soon as the store answers again (not at the janitor's
    stale age)."""
    from botocore.exceptions import ConnectionClosedError

    from loraplex.platform.blobs.removals import removals_of
    from tests.utils.faults import FaultProxy

    proxy = FaultProxy(moto.port)
    p = s3_platform(pg_url, base_model_dir, proxy.endpoint, bucket)
    _, auth = p.new_tenant()
    client = p.store.client
    real_complete = client.complete_multipart_upload

    def complete_then_lose_the_answer(**kw):
        real_complete(**kw)
        proxy.down()
        raise ConnectionClosedError(endpoint_url=proxy.endpoint)

    client.complete_multipart_upload = complete_then_lose_the_answer
    try:
        r = p.upload(auth, "m", read_files(adapter_dir(seed=1)))
        assert r.status_code == 503, r.text
        assert "blob store is unavailable; nothing was stored" in r.json()["error"]["message"]
        stored = [o["Key"] for o in objects(moto, bucket)]
        assert len(stored) == 1, "the store never completed the write, so the fault came too early"
        assert removals_of(p.store).pending() == stored
        assert [s for (s,) in p.sql("SELECT status FROM adapter_versions")] == ["failed"]
        time.sleep(0.5)
        assert [o["Key"] for o in objects(moto, bucket)] == stored   # still down: nothing could remove it
        proxy.up()
        deadline = time.monotonic() + 15
        while objects(moto, bucket) or removals_of(p.store).pending():
            assert time.monotonic() < deadline, (objects(moto, bucket), removals_of(p.store).pending())
            time.sleep(0.1)
        assert p.ready_rows() == 0
    finally:
        proxy.close()
