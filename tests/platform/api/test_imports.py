"""Imports by reference on PostgreSQL with moto's S3 server as the platform's blob store and as the tenant's bucket,
and loopback HTTP servers allow-listed for the test: success (S3 and HTTP), dedupe, Idempotency-Key replay, the
history's source, oversize, a disallowed host / bucket / endpoint / address, a redirect to 127.0.0.1 refused unless
allow-listed, S3 down (503 with Retry-After), refused credentials (403), 202 and polling, an interrupted import."""
from __future__ import annotations

import http.server
import threading
import time
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import text

from tests.platform.conftest import MAX_UPLOAD, _platform, make_settings, read_files
from tests.utils.services import free_port

FILES = ("adapter_config.json", "adapter_model.safetensors")


class Folder(http.server.ThreadingHTTPServer):
    """Serves ``files`` under ``/a/``; ``/moved/<f>`` redirects to ``redirect_to + f``; ``delay_s`` slows bodies."""

    def __init__(self, files: dict[str, bytes], redirect_to: str | None = None, delay_s: float = 0.0) -> None:
        self.files, self.redirect_to, self.delay_s, self.hits = files, redirect_to, delay_s, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.hits.append((self.path, self.headers.get("Host"), self.headers.get("Authorization")))
                name = self.path.rsplit("/", 1)[-1]
                if self.path.startswith("/moved/") and outer.redirect_to:
                    self.send_response(302)
                    self.send_header("Location", outer.redirect_to + name)
                    self.end_headers()
                    return
                body = outer.files.get(name) if self.path.startswith("/a/") else None
                if body is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if outer.delay_s:
                    time.sleep(outer.delay_s)
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()


class RefusingS3(http.server.ThreadingHTTPServer):
    """An S3 endpoint that refuses the keys as AWS does (403, InvalidAccessKeyId)."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _refuse(self):
                body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code><Message>The '
                        b'AWS Access Key Id you provided does not exist in our records.</Message></Error>')
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
            do_GET = do_HEAD = _refuse

        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def files(adapter_dir):
    return read_files(adapter_dir(seed=21))


@pytest.fixture
def servers(files):
    target = Folder(files)
    origin = Folder(files, redirect_to=f"http://127.0.0.1:{target.port}/a/")
    refusing = RefusingS3()
    yield origin, target, refusing
    for s in (origin, target, refusing):
        s.shutdown()
        s.server_close()


@pytest.fixture
def make(pg_url, moto, base_model_dir, servers):
    """``make(**settings) -> Platform`` on PostgreSQL + moto, the origin server allow-listed as localhost."""
    origin, target, refusing = servers
    made = []
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    moto.client().create_bucket(Bucket=bucket)

    def build(**kw):
        values = dict(database_url=pg_url, blob_backend="s3", s3_endpoint_url=moto.endpoint, s3_bucket=bucket,
                      base_model_path=base_model_dir, import_wait_s=30.0,
                      import_allowed_hosts=[f"http://localhost:{origin.port}", "*.example.org"],
                      import_private_hosts=["localhost"], import_s3_buckets=["src-*"],
                      import_s3_endpoints=[moto.endpoint, f"http://127.0.0.1:{refusing.port}",
                                           f"http://127.0.0.1:{free_port()}"])
        values.update(kw)
        p = _platform(make_settings(**values))
        made.append(p)
        return p
    yield build
    with made[0].session_factory() as s:
        s.execute(text("TRUNCATE adapter_imports, usage_records, adapter_aliases, adapter_versions, adapters, "
                       "api_keys, tenants CASCADE"))
        s.commit()
    for p in made:
        p.session_factory.kw["bind"].dispose()


def _src_bucket(moto, files: dict[str, bytes], prefix: str = "runs/1/") -> str:
    bucket = f"src-{uuid.uuid4().hex[:10]}"
    s3 = moto.client()
    s3.create_bucket(Bucket=bucket)
    for name, data in files.items():
        s3.put_object(Bucket=bucket, Key=prefix + name, Body=data)
    return bucket


def _creds(endpoint: str, **kw) -> dict:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region": "us-east-1",
            "endpoint_url": endpoint, **kw}


def _error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["code"] == code and len(e["message"]) > 20, e
    return e


def test_import_from_s3_then_dedupe_and_replay(make, moto, files):
    p = make()
    _, auth = p.new_tenant()
    bucket = _src_bucket(moto, files)
    body = {"name": "imported", "source": f"s3://{bucket}/runs/1", "credentials": _creds(moto.endpoint)}
    r = p.client.post("/v1/adapters/import", json=body, headers={**auth, "Idempotency-Key": "imp-1"})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "succeeded" and job["source"] == f"s3://{bucket}/runs/1/"
    assert job["version"]["number"] == 1 and job["version"]["status"] == "ready" and job["deduplicated"] is False
    assert job["bytes_received"] == sum(len(b) for b in files.values())
    assert r.headers["location"] == f"/v1/imports/{job['id']}"
    assert "testing" not in r.text                                  # credentials are never echoed ...
    assert p.sql("SELECT count(*) FROM adapter_imports WHERE source LIKE '%testing%'")[0][0] == 0   # ... or stored
    [stored] = p.store.list_keys()
    assert b"".join(p.store.iter_chunks(stored)) == files["adapter_model.safetensors"]
    history = p.client.get("/v1/adapters/imported/versions", headers=auth).json()
    assert history["data"][0]["source"] == f"s3://{bucket}/runs/1/" and history["data"][0]["created_by"]["name"]
    again = p.client.post("/v1/adapters/import", json=body, headers={**auth, "Idempotency-Key": "imp-1"})
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == job["id"]
    dup = p.client.post("/v1/adapters/import", json=body, headers=auth)
    assert dup.status_code == 200 and dup.json()["deduplicated"] is True and dup.json()["version"]["number"] == 1
    assert len(p.store.list_keys()) == 1 and p.sql("SELECT count(*) FROM adapter_versions")[0][0] == 1
    assert p.client.get(f"/v1/imports/{job['id']}", headers=auth).json()["status"] == "succeeded"
    assert [j["id"] for j in p.client.get("/v1/imports", headers=auth).json()["data"]][-1] == job["id"]
    _, other = p.new_tenant()
    _error(p.client.get(f"/v1/imports/{job['id']}", headers=other), 404, "import_not_found")


def test_s3_refusals(make, moto, files, servers, adapter_dir):
    _, _, refusing = servers
    p = make()
    _, auth = p.new_tenant()
    bucket = _src_bucket(moto, files)

    def post(source: str, creds: dict | None):
        return p.client.post("/v1/adapters/import", headers=auth,
                             json={"name": "x", "source": source, **({"credentials": creds} if creds else {})})
    e = _error(post(f"s3://{bucket}/runs/1/", _creds(f"http://127.0.0.1:{refusing.port}")), 403,
               "source_access_denied")
    assert "refused the credentials" in e["message"] and "check the keys" in e["message"]
    down = p.settings.import_s3_endpoints[2]                        # allow-listed, nothing listens there
    r = post(f"s3://{bucket}/runs/1/", _creds(down))
    _error(r, 503, "source_unavailable")
    assert r.headers["retry-after"] == "5" and "retry" in r.json()["error"]["message"]
    _error(post(f"s3://{bucket}/nothing-here/", _creds(moto.endpoint)), 422, "source_not_found")
    _error(post("s3://not-src-bucket/runs/1/", _creds(moto.endpoint)), 403, "source_not_allowed")
    _error(post(f"s3://{bucket}/runs/1/", None), 403, "source_not_allowed")          # no keys, no operator bucket
    _error(post(f"s3://{bucket}/runs/1/", _creds("http://169.254.169.254")), 403, "source_not_allowed")
    _error(post(f"s3://{p.settings.s3_bucket}/adapters/", _creds(moto.endpoint)), 403, "source_not_allowed")
    big = dict(files, **{"adapter_model.safetensors": b"\0" * (MAX_UPLOAD + 1)})
    _error(post(f"s3://{_src_bucket(moto, big)}/runs/1/", _creds(moto.endpoint)), 413, "too_large")
    bad = read_files(adapter_dir(r=32))                               # past MAX_RANK: the upload's own checks
    _error(post(f"s3://{_src_bucket(moto, bad)}/runs/1/", _creds(moto.endpoint)), 422, "rank_too_high")
    _error(post("ftp://host/x/", None), 400, "bad_source")
    _error(post("https://user:pw@host.example.org/x/", None), 400, "bad_source")
    assert p.store.list_keys() == [] and p.sql("SELECT count(*) FROM adapter_versions")[0][0] == 0
    statuses = dict(p.sql("SELECT error_code, count(*) FROM adapter_imports GROUP BY error_code"))
    assert statuses.get("source_access_denied") == 1 and statuses.get("source_unavailable") == 1


def test_http_import_redirects_and_addresses(make, servers, files):
    origin, target, _ = servers
    p = make()
    _, auth = p.new_tenant()
    base = f"http://localhost:{origin.port}"
    r = p.client.post("/v1/adapters/import", headers=auth, json={
        "name": "web", "source": f"{base}/a/", "credentials": {"bearer_token": "hub-token"}})
    assert r.status_code == 201, r.text
    assert r.json()["version"]["sha256"] and r.json()["version"]["adapter"] == "web"
    assert {h[1] for h in origin.hits} == {f"localhost:{origin.port}"}       # the name kept in Host (pinned IP)
    assert {h[2] for h in origin.hits} == {"Bearer hub-token"}
    # a redirect to 127.0.0.1 (not allow-listed) is refused before anything is fetched from it
    r = p.client.post("/v1/adapters/import", headers=auth, json={"name": "moved", "source": f"{base}/moved/"})
    assert "127.0.0.1" in _error(r, 403, "source_not_allowed")["message"] and target.hits == []
    # allow-listed as a host but not for private addresses: its address is refused
    p2 = make(import_allowed_hosts=[f"http://localhost:{origin.port}", f"http://127.0.0.1:{target.port}"])
    _, auth2 = p2.new_tenant()
    r = p2.client.post("/v1/adapters/import", headers=auth2, json={"name": "moved", "source": f"{base}/moved/"})
    assert "non-public address" in _error(r, 403, "source_not_allowed")["message"] and target.hits == []
    # both allowed: the redirect is followed, the bearer token not sent to the second host
    p3 = make(import_allowed_hosts=[f"http://localhost:{origin.port}", f"http://127.0.0.1:{target.port}"],
              import_private_hosts=["localhost", "127.0.0.1"])
    _, auth3 = p3.new_tenant()
    r = p3.client.post("/v1/adapters/import", headers=auth3, json={
        "name": "moved", "source": f"{base}/moved/", "credentials": {"bearer_token": "hub-token"}})
    assert r.status_code == 201, r.text
    assert target.hits and {h[2] for h in target.hits} == {None}
    # not allow-listed, plain HTTP to an HTTPS-only entry, a link-local address
    _error(p.client.post("/v1/adapters/import", headers=auth, json={"name": "w", "source": "https://evil.test/a/"}),
           403, "source_not_allowed")
    _error(p.client.post("/v1/adapters/import", headers=auth, json={"name": "w", "source": "http://x.example.org/a/"}),
           403, "source_not_allowed")
    p4 = make(import_allowed_hosts=["169.254.169.254"])
    _, auth4 = p4.new_tenant()
    r = p4.client.post("/v1/adapters/import", headers=auth4, json={"name": "w", "source": "https://169.254.169.254/x/"})
    assert "non-public" in _error(r, 403, "source_not_allowed")["message"]


def test_slow_import_answers_202_then_succeeds(make, files, servers):
    from fastapi.testclient import TestClient

    origin, _, _ = servers
    origin.delay_s = 0.5
    p = make(import_wait_s=0.0, engine_mode="null")
    with TestClient(p.client.app) as c:                              # one event loop for the background import
        _, auth = p.new_tenant()
        r = c.post("/v1/adapters/import", headers=auth,
                   json={"name": "slow", "source": f"http://localhost:{origin.port}/a/"})
        assert r.status_code == 202 and r.json()["status"] == "running", r.text
        deadline = time.monotonic() + 30
        while (job := c.get(r.headers["location"], headers=auth).json())["status"] == "running":
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
        assert job["status"] == "succeeded" and job["version"]["number"] == 1


def test_interrupted_import_reads_as_failed(make):
    p = make()
    tid, auth = p.new_tenant()
    old = p.settings.upload_stale_after_s + 60
    with p.session_factory() as s:
        s.execute(text("INSERT INTO adapter_imports (id, tenant_id, adapter_name, source, status, bytes_received, "
                       "deduplicated, idempotency_key, created_at, updated_at) VALUES ('stuck', :t, 'x', "
                       "'s3://b/p/', 'running', 10, false, 'k', now() - :age, now() - :age)"),
                  {"t": tid, "age": timedelta(seconds=old)})
        s.commit()
    job = p.client.get("/v1/imports/stuck", headers=auth).json()
    assert job["status"] == "failed" and job["error"]["code"] == "import_interrupted" and job["error"]["status"] == 503
    assert p.sql("SELECT idempotency_key FROM adapter_imports WHERE id = 'stuck'")[0][0] is None
