"""Platform fixtures: a fresh PostgreSQL database per session (migrated with Alembic, truncated between tests),
moto's S3 server in its own process (a fresh bucket per test), a tiny qwen3_moe base model and real PEFT adapters.
PostgreSQL missing is an error, never a skip."""
from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass, field

import pytest
from sqlalchemy import text

from tests.utils.adapters import make_peft_adapter
from tests.utils.services import MotoServer, create_database, drop_database
from tests.utils.tiny_models import make_tiny_base

ADMIN_KEY = "admin-test-key-0123456789"
BASE_NAME = "tiny-base"
MAX_UPLOAD = 4 * 1024 * 1024
MAX_RANK = 16
TABLES = "usage_records, adapter_aliases, adapter_versions, adapters, api_keys, tenants"


@pytest.fixture(scope="session")
def pg_url():
    from loraplex.commands.db import run

    url, name = create_database()
    run("upgrade", "head", url=url)
    yield url
    drop_database(name)


@pytest.fixture(scope="session")
def moto():
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory):
    return make_tiny_base("qwen3_moe", str(tmp_path_factory.mktemp("base-qwen3_moe")))


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory):
    """``adapter_dir(**make_peft_adapter kwargs) -> folder`` for the qwen3_moe base, cached per session."""
    cache: dict = {}

    def make(**kw) -> str:
        key = repr(sorted(kw.items()))
        if key not in cache:
            kw.setdefault("base_model_name", BASE_NAME)
            cache[key] = make_peft_adapter("qwen3_moe", str(tmp_path_factory.mktemp("adapter")), **kw)
        return cache[key]
    return make


def read_files(folder: str) -> dict[str, bytes]:
    return {n: open(os.path.join(folder, n), "rb").read()
            for n in ("adapter_config.json", "adapter_model.safetensors")}


def make_settings(**kw):
    from loraplex.platform.core.config import Settings

    base = dict(environment="test", admin_key=ADMIN_KEY, secret_key="test-secret-key-0123456789",
                base_model_name=BASE_NAME, max_upload_bytes=MAX_UPLOAD, max_rank=MAX_RANK,
                s3_access_key_id="testing", s3_secret_access_key="testing", s3_part_size=64 * 1024,
                s3_max_attempts=2, s3_connect_timeout_s=1.0, s3_read_timeout_s=5.0)
    base.update(kw)
    return Settings(**base)


@dataclass
class Platform:
    """One app under test with handles on everything it writes to."""

    client: object
    settings: object
    store: object
    notifier: object
    session_factory: object
    headers: dict = field(default_factory=dict)

    def admin(self) -> dict:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    def new_tenant(self, name: str | None = None) -> tuple[str, dict]:
        """Creates a tenant and a key; returns (tenant id, auth headers)."""
        r = self.client.post("/admin/tenants", json={"name": name or f"t-{uuid.uuid4().hex[:8]}"},
                             headers=self.admin())
        assert r.status_code == 201, r.text
        tid = r.json()["id"]
        r = self.client.post(f"/admin/tenants/{tid}/keys", json={"name": "test"}, headers=self.admin())
        assert r.status_code == 201, r.text
        return tid, {"Authorization": f"Bearer {r.json()['key']}"}

    def upload(self, headers: dict, name: str, files: dict[str, bytes] | list, **kw):
        parts = files if isinstance(files, list) else [("files", (n, io.BytesIO(b))) for n, b in files.items()]
        return self.client.post("/v1/adapters", data={"name": name}, files=parts, headers=headers, **kw)

    def sql(self, query: str, **params):
        with self.session_factory() as s:
            return s.execute(text(query), params).all()

    def ready_rows(self) -> int:
        return self.sql("SELECT count(*) FROM adapter_versions WHERE status = 'ready'")[0][0]

    def assert_nothing_stored(self) -> None:
        assert self.ready_rows() == 0
        assert self.store.list_keys() == []


def _platform(settings, store=None):
    from fastapi.testclient import TestClient

    from loraplex.platform.engines.notifier import InMemoryNotifier
    from loraplex.platform.main import create_app

    notifier = InMemoryNotifier()
    app = create_app(settings, blob_store=store, notifier=notifier)
    return Platform(client=TestClient(app), settings=settings, store=app.state.blob_store, notifier=notifier,
                    session_factory=app.state.sessionmaker)


@pytest.fixture
def platform(pg_url, moto, base_model_dir):
    """The app on PostgreSQL and moto's S3 (fresh bucket)."""
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    moto.client().create_bucket(Bucket=bucket)
    settings = make_settings(database_url=pg_url, blob_backend="s3", s3_endpoint_url=moto.endpoint, s3_bucket=bucket,
                             base_model_path=base_model_dir)
    p = _platform(settings)
    yield p
    with p.session_factory() as s:
        s.execute(text(f"TRUNCATE {TABLES} CASCADE"))
        s.commit()
    p.session_factory.kw["bind"].dispose()


@pytest.fixture
def embedded(tmp_path, base_model_dir):
    """The app on the embedded defaults: a SQLite file and a local blob folder."""
    from loraplex.commands.db import run

    settings = make_settings(data_dir=str(tmp_path / "data"), base_model_path=base_model_dir)
    run("upgrade", "head", url=settings.sqlalchemy_url)
    p = _platform(settings)
    yield p
    p.session_factory.kw["bind"].dispose()
