"""Nothing tenant-identifying or secret leaks from a real ``loraplex serve`` (PostgreSQL, Redis, moto's S3 behind a
cuttable proxy, the embedded engine on the tiny llama, a metrics port and a metrics token):

- ``GET /metrics`` on the API port without auth (or with a wrong token) is a 401 naming no tenant or adapter; with
  the admin key or the metrics token it carries the tenant labels; the metrics port serves them without auth,
  bound to 127.0.0.1 only.
- The admin key appears nowhere in the process's captured output (access log included) after a form login, a
  ``?key=`` attempt, a one-time link, admin API calls and a logout.
- Engine and S3 failures reaching a tenant (a blob gone from the bucket, the store unreachable; streamed and not)
  name no endpoint, bucket or key and carry the request id, under which the platform log has the detail.
- Sign-out revokes the session server-side: the same cookie replayed afterwards is a 401.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest

from load_tests.adapters import rank1_adapter
from tests.utils.faults import FaultProxy
from tests.utils.services import MotoServer, create_database, drop_database, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADMIN_KEY = "leak-test-admin-key-9f3c2a7d51"
METRICS_TOKEN = "leak-test-metrics-token-77aa01"
REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS", "redis://127.0.0.1:6379/0")


class Platform:
    def __init__(self, url: str, metrics_url: str, log_path: str, bucket: str, moto: MotoServer,
                 proxy: FaultProxy, base: str) -> None:
        self.url, self.metrics_url, self.log_path, self.bucket, self.base = url, metrics_url, log_path, bucket, base
        self.moto, self.proxy = moto, proxy
        self.http = httpx.Client(base_url=url, timeout=60)

    def admin(self) -> dict:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    def tenant(self, name: str) -> tuple[str, str]:
        r = self.http.post("/admin/tenants", json={"name": name}, headers=self.admin())
        assert r.status_code == 201, r.text
        tid = r.json()["id"]
        key = self.http.post(f"/admin/tenants/{tid}/keys", json={"name": "k"}, headers=self.admin()).json()["key"]
        return tid, key

    def upload(self, key: str, name: str, files: dict[str, bytes]) -> None:
        r = self.http.post("/v1/adapters", data={"name": name}, files=[("files", (n, b)) for n, b in files.items()],
                           headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 201, r.text

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_llama):
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.exceptions.ConnectionError as e:
        pytest.fail(f"the leak tests need Redis at {REDIS_URL} (or LORAPLEX_TEST_REDIS): {e}")
    tmp = tmp_path_factory.mktemp("leaks")
    db_url, db_name = create_database()
    from loraplex.commands.db import run

    run("upgrade", "head", url=db_url)
    moto = MotoServer()
    proxy = FaultProxy(moto.port)
    bucket = f"leak-{uuid.uuid4().hex[:10]}"
    moto.client().create_bucket(Bucket=bucket)
    port, metrics_port = free_port(), free_port()
    prefix = f"loraplex-leak:{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update({"PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LORAPLEX_ENVIRONMENT": "test",
                "LORAPLEX_ADMIN_KEY": ADMIN_KEY, "LORAPLEX_SECRET_KEY": "leak-secret-key-0123456789",
                "LORAPLEX_METRICS_TOKEN": METRICS_TOKEN, "LORAPLEX_METRICS_PORT": str(metrics_port),
                "LORAPLEX_DATABASE_URL": db_url, "LORAPLEX_REDIS_URL": REDIS_URL,
                "LORAPLEX_QUOTA_KEY_PREFIX": prefix, "LORAPLEX_QUOTA_TIMEOUT_S": "3",
                "LORAPLEX_BLOB_BACKEND": "s3", "LORAPLEX_S3_ENDPOINT_URL": proxy.endpoint,
                "LORAPLEX_S3_BUCKET": bucket, "LORAPLEX_S3_ACCESS_KEY_ID": "testing",
                "LORAPLEX_S3_SECRET_ACCESS_KEY": "testing", "LORAPLEX_S3_MAX_ATTEMPTS": "1",
                "LORAPLEX_S3_CONNECT_TIMEOUT_S": "1", "LORAPLEX_BASE_MODEL_PATH": tiny_llama,
                "LORAPLEX_ENGINE_MODE": "embedded", "LORAPLEX_ENGINE_DEVICE": "cpu",
                "LORAPLEX_ENGINE_DTYPE": "float32", "LORAPLEX_DATA_DIR": str(tmp / "data"),
                "LORAPLEX_SPOOL_DIR": str(tmp / "spool")})
    log_path = str(tmp / "serve.log")
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port)], env=env, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"loraplex serve exited: {open(log_path).read()[-3000:]}"
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "loraplex serve did not start"
            time.sleep(0.3)
        yield Platform(url, f"http://127.0.0.1:{metrics_port}", log_path, bucket, moto, proxy, tiny_llama)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        proxy.close()
        moto.stop()
        drop_database(db_name)
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if int(hexport, 16) == port and state == "0A":        # LISTEN
                out.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(addr) == 8 else addr)
    return out


def test_metrics_name_tenants_only_behind_auth_or_on_the_metrics_port(live):
    tenant_name, adapter = f"acme-{uuid.uuid4().hex[:6]}", "secret-adapter"
    _, key = live.tenant(tenant_name)
    live.upload(key, adapter, rank1_adapter(live.base, value=0.02))
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)
    client.completions.create(model=adapter, prompt="hello", max_tokens=2)
    for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": f"Bearer {key}"}):
        r = live.http.get("/metrics", headers=headers)
        assert r.status_code == 401, (headers, r.text[:200])
        assert tenant_name not in r.text and adapter not in r.text and "tenant=" not in r.text
        assert "loraplex_requests_total" not in r.text
    for token in (ADMIN_KEY, METRICS_TOKEN):
        r = live.http.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and f'tenant="{tenant_name}"' in r.text and f'adapter="{adapter}"' in r.text
    r = httpx.get(live.metrics_url + "/metrics", timeout=10)
    assert r.status_code == 200 and f'tenant="{tenant_name}"' in r.text
    port = int(live.metrics_url.rsplit(":", 1)[1])
    assert _listening_addresses(port) == {"127.0.0.1"}
    assert httpx.get(live.metrics_url + "/v1/models", timeout=10).status_code == 404    # the scrape only


def test_the_admin_key_is_in_no_log_line(live):
    c = httpx.Client(base_url=live.url, timeout=30)
    r = c.get("/admin/dashboard", params={"key": ADMIN_KEY})                       # a bootstrap link: refused
    assert r.status_code == 400 and ADMIN_KEY not in r.text
    r = c.get(f"/admin/dashboard?login=1.2.3&KEY={ADMIN_KEY}&token={ADMIN_KEY}")    # any spelling, any param
    assert r.status_code == 401
    r = c.post("/admin/dashboard/login", data={"key": ADMIN_KEY + "-wrong"})
    assert r.status_code == 401
    r = c.post("/admin/dashboard/login", data={"key": ADMIN_KEY}, follow_redirects=False)
    assert r.status_code == 303
    assert c.get("/admin/dashboard/data").status_code == 200
    link = c.post("/admin/dashboard/links", headers=live.admin()).json()["url"]
    assert httpx.get(live.url + link, follow_redirects=False).status_code == 303
    assert c.get("/admin/tenants", headers=live.admin()).status_code == 200
    assert c.post("/admin/dashboard/logout", follow_redirects=False).status_code == 303
    time.sleep(0.5)                                                                 # the access log is flushed
    log = live.log()
    assert "GET /admin/dashboard?key=[REDACTED]" in log and "KEY=[REDACTED]&token=[REDACTED]" in log
    assert ADMIN_KEY not in log
    assert link.split("login=")[1] not in log                                      # the link's token either


def _assert_sanitised(live, message: str, request_id: str) -> None:
    for secret in (live.bucket, live.proxy.endpoint, f"127.0.0.1:{live.proxy.port}", "s3://", "adapters/",
                   str(live.moto.port)):
        assert secret not in message, (secret, message)
    assert request_id and request_id in message, message
    log = live.log()
    assert request_id in log
    detail = [line for line in log.splitlines() if request_id in line and "engine error" in line]
    assert detail and f"s3://{live.bucket}/adapters/" in detail[0], detail


def test_engine_and_s3_failures_reach_tenants_without_internal_details(live):
    _, key = live.tenant(f"t-{uuid.uuid4().hex[:6]}")
    live.upload(key, "gone", rank1_adapter(live.base, value=0.03))
    live.upload(key, "cold", rank1_adapter(live.base, value=0.05))
    s3 = live.moto.client()
    [obj] = [o["Key"] for o in s3.list_objects_v2(Bucket=live.bucket)["Contents"] if "/gone/" in o["Key"]]
    s3.delete_object(Bucket=live.bucket, Key=obj)                   # the engine's fetch will get NoSuchKey
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="gone", prompt="hi", max_tokens=2)
    assert e.value.status_code == 422 and e.value.code == "adapter_load_error"
    _assert_sanitised(live, e.value.message, e.value.response.headers["x-request-id"])
    r = live.http.post("/v1/chat/completions", json={"model": "gone", "stream": True, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]},
                       headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 422
    _assert_sanitised(live, r.json()["error"]["message"], r.headers["x-request-id"])
    live.proxy.down()                                               # the store unreachable for a cold adapter
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="cold", prompt="hi", max_tokens=2)
    finally:
        live.proxy.up()
    assert e.value.status_code == 503 and e.value.code == "adapter_fetch_unavailable"
    assert e.value.response.headers["retry-after"] == "2"
    _assert_sanitised(live, e.value.message, e.value.response.headers["x-request-id"])
    assert client.completions.create(model="cold", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_sign_out_revokes_the_session_on_the_server(live):
    c = httpx.Client(base_url=live.url, timeout=30)
    assert c.post("/admin/dashboard/login", data={"key": ADMIN_KEY}, follow_redirects=False).status_code == 303
    cookie = c.cookies["loraplex_dashboard"]
    assert c.get("/admin/dashboard/data").status_code == 200
    stolen = httpx.Client(base_url=live.url, timeout=30, cookies={"loraplex_dashboard": cookie})
    assert stolen.get("/admin/dashboard/data").status_code == 200
    assert c.post("/admin/dashboard/logout", follow_redirects=False).status_code == 303
    r = stolen.get("/admin/dashboard/data")
    assert r.status_code == 401, r.text
    assert stolen.get("/admin/dashboard").status_code == 401 and "Admin key" in stolen.get("/admin/dashboard").text
