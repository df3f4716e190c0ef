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

TABLES = {"tenants", "api_keys", "adapters", "adapter_versions", "adapter_aliases", "usage_records",
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
