"""Alembic environment: the registry's metadata and the URL from the settings (or ``-x url=...``, or a
connection handed in by ``loraplex db`` / the tests through ``config.attributes["connection"]``)."""
from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from loraplex.platform.core.config import get_settings
from loraplex.platform.db import models  # noqa: F401  (registers the tables)
from loraplex.platform.db.base import Base
from loraplex.platform.db.session import make_engine

config = context.config
if config.config_file_name and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)
target_metadata = Base.metadata


def _url() -> str:
    return context.get_x_argument(as_dictionary=True).get("url") or get_settings().sqlalchemy_url


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


def _run(connection) -> None:  # noqa: ANN001
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                      compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
