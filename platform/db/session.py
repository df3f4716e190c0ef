"""Engine and session factory built from the settings."""
from __future__ import annotations

import os

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.core.config import Settings


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """A SQLAlchemy engine; SQLite gets foreign keys on and a folder for its file."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        engine = create_engine(url, echo=echo, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record):  # noqa: ANN001
            cur = conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.close()
        return engine
    return create_engine(url, echo=echo, pool_pre_ping=True)


def make_sessionmaker(settings: Settings) -> sessionmaker[Session]:
    return sessionmaker(make_engine(settings.sqlalchemy_url, echo=settings.database_echo), expire_on_commit=False)
