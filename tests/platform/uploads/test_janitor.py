"""The janitor against PostgreSQL and moto's S3 (and the embedded SQLite + local folder): what interrupted uploads
leave (rows `uploading`, intended blobs, incomplete multipart uploads, spool folders, orphans) goes, what live
uploads and ready versions hold stays, several janitors at once do each thing once, and a retry with the freed
Idempotency-Key succeeds. The kill -9 matrix against a real `loraplex serve` is tests/platform/uploads/test_crash_safety.py."""
from __future__ import annotations

import json
import os
import subprocess
import threading
from datetime import timedelta

from sqlalchemy import text

from loraplex.platform.crud import adapters as crud
from loraplex.platform.crud import tenants as tenants_crud
from loraplex.platform.db.base import utcnow
from loraplex.platform.db.models import AdapterStatus
from loraplex.platform.uploads.janitor import Janitor
from loraplex.platform.uploads.service import blob_key
from loraplex.platform.uploads.spool import Spool
from tests.platform.conftest import read_files


def err(r) -> dict:
    """The error of an answer, in OpenAI's shape or the older ``{"detail", "code"}``."""
    body = r.json()
    return body["error"] if "error" in body else {"message": body.get("detail"), "code": body.get("code")}


def make_version(p, tenant_id: str, name: str, *, status=AdapterStatus.uploading, age_s: float = 0.0,
                 key: str = "new", idempotency_key: str | None = None):
    """A version row as the upload path writes it (``uploading`` with its intended key); returns (id, key)."""
    with p.session_factory() as s:
        tenant = tenants_crud.get_tenant(session=s, tenant_id=tenant_id)
        adapter = crud.get_or_create_adapter(session=s, tenant=tenant, name=name)
        v = crud.create_version(session=s, adapter=adapter, idempotency_key=idempotency_key, status=status)
        v.blob_key = blob_key(tenant_id, name, v.id, "0" * 64) if key == "new" else key
        if status == AdapterStatus.ready:
            v.blob_uri = p.store.uri(v.blob_key)
        s.commit()
        s.execute(text("UPDATE adapter_versions SET updated_at = :t WHERE id = :i"),
                  {"t": utcnow() - timedelta(seconds=age_s), "i": v.id})
        s.commit()
        return v.id, v.blob_key


def put(p, key: str, tmp_path) -> None:
    import hashlib

    path = tmp_path / "blob"
    path.write_bytes(b"w" * 3000)
    p.store.put_file(key, str(path), sha256=hashlib.sha256(b"w" * 3000).hexdigest())


def start_multipart(p, key: str) -> None:
    c = p.store.client
    uid = c.create_multipart_upload(Bucket=p.store.bucket, Key=key)["UploadId"]
    c.upload_part(Bucket=p.store.bucket, Key=key, UploadId=uid, PartNumber=1, Body=b"x" * 100)


def test_a_pass_removes_what_interrupted_uploads_left_and_keeps_live_state(platform, tmp_path):
    p = platform
    tid, _ = p.new_tenant()
    ready_id, ready_key = make_version(p, tid, "m", status=AdapterStatus.ready, age_s=3600)
    put(p, ready_key, tmp_path)
    # killed after the blob completed, before the registry commit: row uploading, blob there
    done_id, done_key = make_version(p, tid, "m", age_s=3600, idempotency_key="K1")
    put(p, done_key, tmp_path)
    # killed after the first part: row uploading, incomplete multipart upload
    part_id, part_key = make_version(p, tid, "m", age_s=3600)
    start_multipart(p, part_key)
    # reused the ready version's blob and was killed: the shared blob must stay
    shared_id, _ = make_version(p, tid, "m", age_s=3600, key=ready_key)
    # an upload still running (fresh heartbeat) with its multipart upload in flight
    live_id, live_key = make_version(p, tid, "m", age_s=0)
    start_multipart(p, live_key)
    # a blob no row knows (a tenant deleted by an older platform) and a multipart upload no row owns
    put(p, f"adapters/{tid}/gone/v0/{'1' * 64}.safetensors", tmp_path)
    start_multipart(p, f"adapters/{tid}/gone/v9/{'2' * 64}.safetensors")
    import time

    time.sleep(1.2)     # the store's own times (object / upload creation) must be older than the threshold
    with p.session_factory() as s:                    # the live upload's heartbeat
        assert crud.touch_upload(session=s, version_id=live_id)
        s.commit()
    report = Janitor(p.session_factory, p.store, stale_after_s=1.0).run_once()
    assert (report.uploads_expired, report.blobs_removed, report.incomplete_uploads_aborted) == (3, 2, 2), report
    rows = dict(p.sql("SELECT id, status FROM adapter_versions"))
    assert rows == {ready_id: "ready", done_id: "failed", part_id: "failed", shared_id: "failed", live_id: "uploading"}
    assert p.store.list_keys() == [ready_key]
    assert [u.key for u in p.store.incomplete_uploads()] == [live_key]
    assert p.sql("SELECT error, idempotency_key FROM adapter_versions WHERE id = :i", i=done_id) == [
        ("upload interrupted before it finished (the platform stopped or lost it); retry the upload", None)]
    with p.session_factory() as s:  # the live upload heartbeats on (the checks above may take over a second)
        assert crud.touch_upload(session=s, version_id=live_id)
        s.commit()
    again = Janitor(p.session_factory, p.store, stale_after_s=1.0).run_once()
    assert not again.changed and not again.skipped


def test_janitors_racing_do_each_thing_once(platform, tmp_path):
    p = platform
    tid, _ = p.new_tenant()
    keys = []
    for i in range(6):
        _, key = make_version(p, tid, f"m{i}", age_s=3600)
        put(p, key, tmp_path)
        keys.append(key)
    reports, errors = [], []

    def run():
        try:
            reports.append(Janitor(p.session_factory, p.store, stale_after_s=60).run_once())
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []
    assert sum(r.uploads_expired for r in reports) == 6 and sum(r.blobs_removed for r in reports) == 6
    assert p.store.list_keys() == [] and p.sql("SELECT DISTINCT status FROM adapter_versions") == [("failed",)]


def test_expired_upload_frees_its_idempotency_key(platform, adapter_dir):
    p = platform
    tid, auth = p.new_tenant()
    files = read_files(adapter_dir(seed=1))
    make_version(p, tid, "m", age_s=3600, idempotency_key="retry-me")
    r = p.upload({**auth, "Idempotency-Key": "retry-me"}, "m", files)
    assert r.status_code == 409 and err(r)["code"] == "idempotency_in_progress"
    Janitor(p.session_factory, p.store, stale_after_s=60).run_once()
    r = p.upload({**auth, "Idempotency-Key": "retry-me"}, "m", files)
    assert r.status_code == 201 and r.json()["number"] == 2, r.text
    replay = p.upload({**auth, "Idempotency-Key": "retry-me"}, "m", files)
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"


def test_an_upload_the_janitor_expired_while_it_ran_stores_nothing(platform, adapter_dir, monkeypatch):
    """A stalled upload (no heartbeat for longer than the threshold) is expired; when it wakes up its conditional
    commit fails: 503, its blob removed, the row stays failed."""
    from loraplex.platform.crud import adapters

    p = platform
    _, auth = p.new_tenant()
    real = adapters.finish_upload

    def expire_first(*, session, version, **values):
        session.execute(text("UPDATE adapter_versions SET updated_at = now() - interval '1 hour' WHERE id = :i"),
                        {"i": version.id})
        session.commit()
        Janitor(p.session_factory, p.store, stale_after_s=60).run_once()
        return real(session=session, version=version, **values)
    monkeypatch.setattr(adapters, "finish_upload", expire_first)
    r = p.upload(auth, "m", read_files(adapter_dir(seed=1)))
    assert r.status_code == 503 and err(r)["code"] == "upload_interrupted", r.text
    assert p.store.list_keys() == [] and p.store.incomplete_uploads() == []
    assert p.sql("SELECT status FROM adapter_versions") == [("failed",)]


def test_deleting_a_tenant_removes_every_blob_recorded_or_intended(platform, adapter_dir, tmp_path):
    p = platform
    tid, auth = p.new_tenant()
    other_tid, other_auth = p.new_tenant()
    for name in ("a", "b"):
        assert p.upload(auth, name, read_files(adapter_dir(seed=1))).status_code == 201
    assert p.upload(other_auth, "a", read_files(adapter_dir(seed=1))).status_code == 201
    _, intended = make_version(p, tid, "a")             # an upload that died after its blob completed
    put(p, intended, tmp_path)
    _, partial = make_version(p, tid, "b")              # and one that died mid-multipart
    start_multipart(p, partial)
    put(p, f"adapters/{tid}/x/v/{'3' * 64}.safetensors", tmp_path)   # under the prefix, unknown to the registry
    assert len(p.store.list_keys(f"adapters/{tid}/")) == 4
    r = p.client.delete(f"/admin/tenants/{tid}", headers=p.admin())
    assert r.status_code == 204, r.text
    assert p.store.list_keys(f"adapters/{tid}/") == [] and p.store.incomplete_uploads(f"adapters/{tid}/") == []
    assert p.sql("SELECT count(*) FROM adapter_versions WHERE tenant_id = :t", t=tid) == [(0,)]
    assert p.client.get("/v1/adapters", headers=auth).status_code == 401
    assert {e.tenant_id for e in p.notifier.evicted} == {tid}
    assert len(p.store.list_keys(f"adapters/{other_tid}/")) == 1 and \
        p.client.get("/v1/adapters/a", headers=other_auth).status_code == 200
    assert p.client.delete(f"/admin/tenants/{tid}", headers=p.admin()).status_code == 404


def test_tenant_delete_with_the_store_down_is_503_and_finishes_when_repeated(pg_url, base_model_dir, moto,
                                                                             adapter_dir):
    from tests.platform.conftest import TABLES
    from tests.platform.uploads.test_upload_faults import s3_platform
    from tests.utils.faults import FaultProxy

    import uuid

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    moto.client().create_bucket(Bucket=bucket)
    proxy = FaultProxy(moto.port)
    p = s3_platform(pg_url, base_model_dir, proxy.endpoint, bucket)
    try:
        tid, auth = p.new_tenant()
        assert p.upload(auth, "a", read_files(adapter_dir(seed=1))).status_code == 201
        proxy.down()
        r = p.client.delete(f"/admin/tenants/{tid}", headers=p.admin())
        assert r.status_code == 503 and "repeat the DELETE" in err(r)["message"], r.text
        assert p.client.get("/v1/adapters", headers=auth).status_code == 403      # disabled meanwhile
        proxy.up()
        assert p.client.delete(f"/admin/tenants/{tid}", headers=p.admin()).status_code == 204
        assert p.store.list_keys() == [] and p.sql("SELECT count(*) FROM tenants WHERE id = :t", t=tid) == [(0,)]
    finally:
        proxy.close()
        with p.session_factory() as s:
            s.execute(text(f"TRUNCATE {TABLES} CASCADE"))
            s.commit()


def test_spool_sweep_removes_folders_of_dead_processes_only(tmp_path):
    root = str(tmp_path / "spool")
    mine = Spool(root, lease_s=60)
    with mine.upload_dir() as work:
        open(os.path.join(work, "part-0"), "wb").write(b"weights")
        dead = subprocess.Popen(["python3", "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE, text=True)
        dead_pid = int(dead.communicate()[0])
        gone = Spool(root, instance="gone")
        with gone.upload_dir():
            pass
        owner = os.path.join(root, "gone", "owner.json")
        json.dump({**json.load(open(owner)), "pid": dead_pid}, open(owner, "w"))      # its process has exited
        os.makedirs(os.path.join(root, "gone", "upload-x"))
        alive = Spool(root, instance="alive-elsewhere")       # this process, another instance name: alive
        alive.heartbeat()
        remote = Spool(root, instance="remote")
        remote.heartbeat()
        json.dump({**json.load(open(os.path.join(root, "remote", "owner.json"))), "host": "other-host"},
                  open(os.path.join(root, "remote", "owner.json"), "w"))
        os.makedirs(os.path.join(root, "legacy-no-owner"))
        assert mine.sweep() == [os.path.join(root, "gone")]       # remote and legacy are fresh: kept for now
        old = 1_000_000_000
        os.utime(os.path.join(root, "remote", "owner.json"), (old, old))
        os.utime(os.path.join(root, "legacy-no-owner"), (old, old))
        assert sorted(mine.sweep()) == [os.path.join(root, "legacy-no-owner"), os.path.join(root, "remote")]
        assert sorted(os.listdir(root)) == ["alive-elsewhere", mine.instance]
        assert os.listdir(work) == ["part-0"]
    assert os.listdir(mine.dir) == ["owner.json"]
    mine.close()
    assert not os.path.exists(mine.dir)


def test_embedded_store_janitor_and_cli(embedded, tmp_path, monkeypatch):
    """SQLite + the local blob folder: a killed write's temp file and blob go; `loraplex db janitor` prints the
    report."""
    from loraplex.cli import main

    p = embedded
    tid, _ = p.new_tenant()
    _, key = make_version(p, tid, "m", age_s=3600)
    put(p, key, tmp_path)
    _, partial = make_version(p, tid, "n", age_s=3600)
    path = p.store._path(partial)
    os.makedirs(os.path.dirname(path))
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.part-xyz")
    open(tmp, "wb").write(b"half")
    os.utime(tmp, (1_000_000_000, 1_000_000_000))
    for k, v in {"LORAPLEX_DATA_DIR": p.settings.data_dir, "LORAPLEX_UPLOAD_STALE_AFTER_S": "60",
                 "LORAPLEX_SPOOL_DIR": str(tmp_path / "spool")}.items():
        monkeypatch.setenv(k, v)
    from loraplex.platform.core.config import get_settings

    get_settings.cache_clear()
    try:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["db", "janitor"]) == 0
    finally:
        get_settings.cache_clear()
    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert report["uploads_expired"] == 2 and report["blobs_removed"] == 1 and report["incomplete_uploads_aborted"] == 1
    assert p.store.list_keys() == [] and p.store.incomplete_uploads() == []
