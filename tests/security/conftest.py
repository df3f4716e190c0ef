"""Security fixtures: the whole app under uvicorn (SQLite, local blobs, null engine, the tiny llama's tokenizer)
with two tenants: ``owner`` holds adapters (two versions, an alias), ``other`` holds one adapter of its own."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from load_tests.adapters import rank1_adapter
from tests.platform.gateway.conftest import ADMIN_KEY, LiveServer, settings_for
from tests.security.live_stack import NO_NETWORK_IMPORTS

__all__ = ["ADMIN_KEY", "NO_NETWORK_IMPORTS", "bearer", "upload_files"]      # used by the tests of this folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("models") / "tiny-llama"))


@dataclass
class Tenants:
    server: LiveServer
    owner_id: str
    owner_key: str
    other_id: str
    other_key: str
    adapter: str                 # the owner's adapter: versions 1 and 2, alias "prod" → 1
    version_ids: list[str]       # the owner's version ids
    adapter_id: str              # the owner's adapter row id
    other_adapter: str           # the other tenant's own adapter


def upload_files(server: LiveServer, key: str, name: str, files: dict[str, bytes]) -> dict:
    r = server.http.post("/v1/adapters", data={"name": name}, files=[("files", (n, b)) for n, b in files.items()],
                         headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture(scope="module")
def tenants(tmp_path_factory, tiny_llama) -> Tenants:
    from loraplex.commands.db import run
    from loraplex.platform.main import create_app

    tmp = tmp_path_factory.mktemp("security")
    settings = settings_for(tmp, tiny_llama, max_upload_bytes=256 * 1024, **NO_NETWORK_IMPORTS)
    run("upgrade", "head", url=settings.sqlalchemy_url)
    server = LiveServer(create_app(settings))
    owner_id, owner_key = server.new_tenant()
    other_id, other_key = server.new_tenant()
    upload_files(server, owner_key, "secret-bot", rank1_adapter(tiny_llama, value=0.01))
    upload_files(server, owner_key, "secret-bot", rank1_adapter(tiny_llama, value=0.02))
    auth = {"Authorization": f"Bearer {owner_key}"}
    r = server.http.put("/v1/adapters/secret-bot/aliases/prod", json={"version": 1}, headers=auth)
    assert r.status_code == 200, r.text
    upload_files(server, other_key, "mine", rank1_adapter(tiny_llama, value=0.04))
    with server.gateway.sessions() as s:
        from sqlalchemy import text

        adapter_id = s.execute(text("SELECT id FROM adapters WHERE tenant_id = :t"), {"t": owner_id}).scalar_one()
        version_ids = list(s.execute(text("SELECT id FROM adapter_versions WHERE tenant_id = :t ORDER BY number"),
                                     {"t": owner_id}).scalars())
    yield Tenants(server, owner_id, owner_key, other_id, other_key, "secret-bot", version_ids, adapter_id, "mine")
    server.stop()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


from tests.security.live_stack import stack  # noqa: E402,F401  (PostgreSQL + Redis + S3 stack, one per session)
