"""kill -9 of a real ``loraplex serve`` (PostgreSQL, moto's S3 server) at every step of an upload, then a restart:

| step killed at       | left behind by the kill (asserted)                       |
|----------------------|----------------------------------------------------------|
| spooling             | spool folder with part of the body; no row                |
| upload.validated     | spool folder with the whole upload; no row                |
| upload.recorded      | row `uploading` naming its blob key; nothing in S3        |
| blob.part_stored     | row `uploading`; an incomplete multipart upload           |
| blob.completed       | row `uploading`; the complete blob (no ready version)     |
| upload.committing    | row `uploading`; the complete blob                        |

After the restart the janitor runs (in the restarted process at start; for the last step the CronJob's
``loraplex db janitor`` with the in-process janitor off): 0 rows in progress, 0 blobs without a ready version,
0 incomplete multipart uploads, 0 spool folders but the live process's own, and a retry with the same
Idempotency-Key succeeds (201, then replayed 200). The process dies at each step by its own SIGKILL through the
test-only hook of ``tests/utils/crash_points.py`` (spooling: killed from outside while the body is half sent).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import text

from tests.platform.conftest import ADMIN_KEY, BASE_NAME, TABLES, read_files
from tests.utils.services import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STALE_S = 3.0
STEPS = ["spooling", "upload.validated", "upload.recorded", "blob.part_stored", "blob.completed",
         "upload.committing"]
MATRIX: list[dict] = []


class Serve:
    """``loraplex serve`` (through the crash-hook entry point) as a subprocess."""

    def __init__(self, tmp, env: dict) -> None:
        self.tmp, self.env, self.port = tmp, env, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = open(os.path.join(tmp, "serve.log"), "ab")

    def start(self, **extra: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.utils.crash_points", "serve", "--port",
                                      str(self.port)], env={**self.env, **extra}, cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"loraplex serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("loraplex serve did not start within 90 s")

    def wait_killed(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def stack(pg_url, moto, base_model_dir, tmp_path):
    bucket = f"crash-{uuid.uuid4().hex[:10]}"
    moto.client().create_bucket(Bucket=bucket)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update({"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "LORAPLEX_ENVIRONMENT": "test",
                "LORAPLEX_ADMIN_KEY": ADMIN_KEY, "LORAPLEX_SECRET_KEY": "test-secret-key-0123456789",
                "LORAPLEX_DATABASE_URL": pg_url, "LORAPLEX_BLOB_BACKEND": "s3",
                "LORAPLEX_S3_ENDPOINT_URL": moto.endpoint, "LORAPLEX_S3_BUCKET": bucket,
                "LORAPLEX_S3_ACCESS_KEY_ID": "testing", "LORAPLEX_S3_SECRET_ACCESS_KEY": "testing",
                "LORAPLEX_S3_PART_SIZE": "4096", "LORAPLEX_BASE_MODEL_PATH": base_model_dir,
                "LORAPLEX_BASE_MODEL_NAME": BASE_NAME, "LORAPLEX_ENGINE_MODE": "none", "LORAPLEX_MAX_RANK": "16",
                "LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_SPOOL_DIR": str(tmp_path / "spool"),
                "LORAPLEX_UPLOAD_STALE_AFTER_S": str(STALE_S), "LORAPLEX_JANITOR_INTERVAL_S": "1",
                "LORAPLEX_CRASH_FILE": str(tmp_path / "crash")})
    server = Serve(str(tmp_path), env)
    yield server, bucket
    server.stop()
    from loraplex.platform.db.session import make_engine

    engine = make_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} CASCADE"))
    engine.dispose()


def sql(pg_url: str, query: str, **params):
    from loraplex.platform.db.session import make_engine

    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(query), params).all()
    finally:
        engine.dispose()


def state(pg_url: str, moto, bucket: str, spool_root: str, live_pid: int | None) -> dict:
    """What is in the registry, the bucket and the spool root, against what may be there."""
    rows = sql(pg_url, "SELECT status, blob_key FROM adapter_versions")
    s3 = moto.client()
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}
    ready = {k for st, k in rows if st == "ready"}
    leftovers = []
    for name in (os.listdir(spool_root) if os.path.isdir(spool_root) else []):
        folder = os.path.join(spool_root, name)
        try:
            owner = json.load(open(os.path.join(folder, "owner.json")))
        except (OSError, ValueError):
            owner = {}
        uploads = [n for n in os.listdir(folder) if n.startswith("upload-")]
        if owner.get("pid") != live_pid:
            leftovers.append(name)
        leftovers += uploads
    return {"in_progress": sum(st in ("uploading", "validating") for st, _ in rows),
            "orphan_blobs": len(keys - ready), "ready_without_blob": len(ready - keys),
            "incomplete_multipart": len(s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])),
            "spool_leftovers": len(leftovers),
            "spool_bytes": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(spool_root)
                               for f in fs if f.startswith("part-"))}


CLEAN = {"in_progress": 0, "orphan_blobs": 0, "ready_without_blob": 0, "incomplete_multipart": 0,
         "spool_leftovers": 0, "spool_bytes": 0}


def new_tenant(url: str) -> dict:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    tid = httpx.post(url + "/admin/tenants", json={"name": f"t-{uuid.uuid4().hex[:8]}"}, headers=admin).json()["id"]
    key = httpx.post(f"{url}/admin/tenants/{tid}/keys", json={"name": "k"}, headers=admin).json()["key"]
    return {"Authorization": f"Bearer {key}"}


def upload(url: str, auth: dict, idem: str, files: dict[str, bytes]) -> httpx.Response:
    return httpx.post(url + "/v1/adapters", data={"name": idem}, headers={**auth, "Idempotency-Key": idem},
                      files=[("files", (n, b)) for n, b in files.items()], timeout=60)


def half_send(url: str, auth: dict, idem: str, files: dict[str, bytes]) -> socket.socket:
    """Sends the request line, headers and about 60 % of the multipart body, then stops (the server waits)."""
    req = httpx.Request("POST", url + "/v1/adapters", data={"name": idem}, headers={**auth, "Idempotency-Key": idem},
                        files=[("files", (n, b)) for n, b in files.items()])
    body = req.read()
    u = urlsplit(url)
    head = f"POST /v1/adapters HTTP/1.1\r\nHost: {u.netloc}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in req.headers.items() if k.lower() != "host") + "\r\n"
    sock = socket.create_connection((u.hostname, u.port))
    sock.sendall(head.encode() + body[: int(len(body) * 0.6)])
    return sock


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


@pytest.mark.slow
def test_kill_at_every_upload_step_then_the_janitor_leaves_nothing(stack, pg_url, moto, adapter_dir, tmp_path):
    server, bucket = stack
    spool_root = str(tmp_path / "spool")
    crash_file = tmp_path / "crash"
    files = read_files(adapter_dir(seed=5, r=8))
    assert len(files["adapter_model.safetensors"]) > 8 * 4096      # several 4 KiB parts
    server.start()
    auth = new_tenant(server.url)
    for step in STEPS:
        idem = f"crash-{step}"           # also the adapter's name: one adapter per step, so no blob is shared
        last = step == STEPS[-1]
        if step == "spooling":
            sock = half_send(server.url, auth, idem, files)
            wait_for(lambda: state(pg_url, moto, bucket, spool_root, server.proc.pid)["spool_bytes"] > 0, 20,
                     "part of the body in the spool folder")
            server.proc.send_signal(signal.SIGKILL)
        else:
            crash_file.write_text(step)
            with pytest.raises(httpx.HTTPError):       # the connection dies with the process
                upload(server.url, auth, idem, files)
        assert server.wait_killed() == -signal.SIGKILL, step
        if step == "spooling":
            sock.close()
        crash_file.write_text("")
        dirty = state(pg_url, moto, bucket, spool_root, None)
        expected = {"spooling": ("spool_bytes",), "upload.validated": ("spool_bytes",),
                    "upload.recorded": ("in_progress",), "blob.part_stored": ("in_progress", "incomplete_multipart"),
                    "blob.completed": ("in_progress", "orphan_blobs"),
                    "upload.committing": ("in_progress", "orphan_blobs")}[step]
        assert all(dirty[k] > 0 for k in expected), (step, dirty)
        row = sql(pg_url, "SELECT status, blob_key FROM adapter_versions WHERE idempotency_key = :k", k=idem)
        assert (row == []) == (step in ("spooling", "upload.validated")), (step, row)
        if row:
            assert row[0][0] == "uploading" and row[0][1].startswith("adapters/"), row
        # restart; the janitor expires the row once its heartbeat is STALE_S old
        t0 = time.monotonic()
        if last:   # the CronJob way: in-process janitor off, one `loraplex db janitor` pass
            server.start(LORAPLEX_JANITOR_INTERVAL_S="0")
            time.sleep(STALE_S)
            out = subprocess.run([sys.executable, "-m", "loraplex.cli", "db", "janitor"], env=server.env, cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr
            report = json.loads(out.stdout.strip().splitlines()[-1])
            assert report["uploads_expired"] == 1 and report["blobs_removed"] == 1, report
            after = state(pg_url, moto, bucket, spool_root, server.proc.pid)
        else:
            server.start()
            after = wait_for(lambda: (lambda s: s if s == CLEAN else None)(
                state(pg_url, moto, bucket, spool_root, server.proc.pid)), 30 + STALE_S, f"clean after {step}")
        cleaned_s = time.monotonic() - t0
        assert after == CLEAN, (step, after)
        r = upload(server.url, auth, idem, files)
        assert r.status_code == 201, (step, r.text)
        replay = upload(server.url, auth, idem, files)
        assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true", replay.text
        assert r.json()["number"] == (1 if step in ("spooling", "upload.validated") else 2)   # v1 failed
        assert state(pg_url, moto, bucket, spool_root, server.proc.pid) == CLEAN
        MATRIX.append({"step": step, "left": {k: v for k, v in dirty.items() if v}, "after": "clean",
                       "restart_to_clean_s": round(cleaned_s, 1), "retry": f"{r.status_code} v{r.json()['number']}"})
    print("\n" + "\n".join(json.dumps(m) for m in MATRIX))
    ready = sql(pg_url, "SELECT count(*) FROM adapter_versions WHERE status = 'ready'")[0][0]
    assert ready == len(STEPS)
