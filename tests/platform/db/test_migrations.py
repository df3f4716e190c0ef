"""Alembic: upgrade head then downgrade base on PostgreSQL and SQLite; the migrations match the ORM models."""
from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from loraplex.commands.db import run
from loraplex.platform.db.base import Base
from loraplex.platform.db.session import make_engine
from tests.utils.services import create_database, drop_database

TABLES = {"tenants", "api_keys", "adapters", "adapter_versions", "adapter_aliases", "usage_records", "adapter_imports",
          "dashboard_sessions"}


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/m.db"
        return
    url, name = create_database()
    yield url
    drop_database(name)


def tables(url):
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_head_then_downgrade_base(url):
    run("upgrade", "head", url=url)
    assert tables(url) >= TABLES | {"alembic_version"}
    engine = make_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == [], f"models and migrations differ: {diff}"
    run("downgrade", "base", url=url)
    assert tables(url) & TABLES == set()
    run("upgrade", "head", url=url)  # and back up again, clean
    assert tables(url) >= TABLES


def test_cli_db_upgrade(tmp_path):
    from loraplex.cli import main

    url = f"sqlite:///{tmp_path}/cli.db"
    assert main(["db", "upgrade", "--url", url]) == 0
    assert tables(url) >= TABLES
    assert main(["db", "downgrade", "base", "--url", url]) == 0
    assert tables(url) & TABLES == set()


def test_blob_keys_of_existing_versions_are_backfilled(url):
    """Versions written before 0003 get the key of their URI, so deletes and the janitor can find their blobs."""
    from sqlalchemy import text

    run("upgrade", "0002", url=url)
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, disabled, created_at) VALUES ('t1', 'a', false, "
                          "CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO adapters (id, tenant_id, name, created_at, updated_at) VALUES ('a1', 't1', "
                          "'bot', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        for vid, number, uri in (("v1", 1, "s3://bucket/adapters/t1/bot/abc.safetensors"),
                                 ("v2", 2, "file:///data/blobs/adapters/t1/bot/def.safetensors"), ("v3", 3, None)):
            conn.execute(text("INSERT INTO adapter_versions (id, adapter_id, tenant_id, number, status, targets, "
                              "blob_uri, created_at, updated_at) VALUES (:i, 'a1', 't1', :n, 'ready', '[]', :u, "
                              "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"), {"i": vid, "n": number, "u": uri})
    run("upgrade", "head", url=url)
    with engine.connect() as conn:
        keys = dict(conn.execute(text("SELECT id, blob_key FROM adapter_versions")).all())
    engine.dispose()
    assert keys == {"v1": "adapters/t1/bot/abc.safetensors", "v2": "adapters/t1/bot/def.safetensors", "v3": None}
    run("downgrade", "base", url=url)
