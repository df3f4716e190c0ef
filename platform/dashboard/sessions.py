"""Server-side dashboard sessions: where sign-ins and used one-time links are kept (hashed), so sign-out revokes a
cookie everywhere and expiry is enforced by the server, not by the browser.

    SqlSessionStore(sessionmaker)   the registry's ``dashboard_sessions`` table (the platform: every replica sees it)
    MemorySessionStore()            one process's dict (an app without a registry, e.g. the dashboard's own tests)
    session_store_of(app)           the app's store (``app.state.dashboard_sessions``), made on first use
"""
from __future__ import annotations

import hashlib
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class SessionStore(Protocol):
    def add(self, kind: str, token_hash: str, key_id: str, ttl_s: float) -> bool:
        """Stores a row valid ``ttl_s``; False when that hash is stored already (a link used twice)."""

    def is_valid(self, token_hash: str, key_id: str) -> bool:
        """A stored, unrevoked, unexpired session made under the admin key ``key_id``."""

    def revoke(self, token_hash: str) -> None:
        ...


class SqlSessionStore:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def add(self, kind: str, token_hash: str, key_id: str, ttl_s: float) -> bool:
        from loraplex.platform.crud import dashboard_sessions as crud

        expires = datetime.now(timezone.utc) + timedelta(seconds=ttl_s)
        with self.sessions() as session:
            try:
                crud.add(session=session, token_hash=token_hash, kind=kind, key_id=key_id, expires_at=expires)
                session.commit()
            except IntegrityError:
                session.rollback()
                return False
        return True

    def is_valid(self, token_hash: str, key_id: str) -> bool:
        from loraplex.platform.crud import dashboard_sessions as crud

        with self.sessions() as session:
            return crud.is_valid(session=session, token_hash=token_hash, key_id=key_id)

    def revoke(self, token_hash: str) -> None:
        from loraplex.platform.crud import dashboard_sessions as crud

        with self.sessions() as session:
            crud.revoke(session=session, token_hash=token_hash)
            session.commit()


class MemorySessionStore:
    def __init__(self, clock=time.time) -> None:
        self._rows: dict[str, tuple[str, str, float, bool]] = {}   # hash -> (kind, key id, expires, revoked)
        self._lock = threading.Lock()
        self._clock = clock

    def add(self, kind: str, token_hash: str, key_id: str, ttl_s: float) -> bool:
        now = self._clock()
        with self._lock:
            for h in [h for h, row in self._rows.items() if row[2] < now]:
                del self._rows[h]
            if token_hash in self._rows:
                return False
            self._rows[token_hash] = (kind, key_id, now + ttl_s, False)
        return True

    def is_valid(self, token_hash: str, key_id: str) -> bool:
        row = self._rows.get(token_hash)
        return row is not None and row[0] == "session" and row[1] == key_id and row[2] > self._clock() and not row[3]

    def revoke(self, token_hash: str) -> None:
        with self._lock:
            row = self._rows.get(token_hash)
            if row is not None:
                self._rows[token_hash] = (*row[:3], True)


def session_store_of(app: Any) -> SessionStore:
    store = getattr(app.state, "dashboard_sessions", None)
    if store is None:
        sessions = getattr(app.state, "sessionmaker", None)
        store = SqlSessionStore(sessions) if sessions is not None else MemorySessionStore()
        app.state.dashboard_sessions = store
    return store
