"""Admin dashboard sign-ins and used one-time login links (``DashboardSession`` rows; tokens stored hashed)."""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from loraplex.platform.db.base import utcnow
from loraplex.platform.db.models import DashboardSession


def add(*, session: Session, token_hash: str, kind: str, key_id: str, expires_at: datetime) -> None:
    """Stores a sign-in or a used link; raises ``IntegrityError`` at flush if that hash is stored already."""
    session.add(DashboardSession(token_hash=token_hash, kind=kind, key_id=key_id, expires_at=expires_at))
    session.flush()


def is_valid(*, session: Session, token_hash: str, key_id: str, kind: str = "session") -> bool:
    """A stored, unrevoked, unexpired row of ``kind`` made under the admin key ``key_id``."""
    return session.scalar(select(DashboardSession.token_hash).where(
        DashboardSession.token_hash == token_hash, DashboardSession.kind == kind,
        DashboardSession.key_id == key_id, DashboardSession.revoked_at.is_(None),
        DashboardSession.expires_at > utcnow())) is not None


def revoke(*, session: Session, token_hash: str) -> bool:
    result = session.execute(update(DashboardSession).where(
        DashboardSession.token_hash == token_hash, DashboardSession.revoked_at.is_(None)).values(revoked_at=utcnow())
        .execution_options(synchronize_session=False))
    return result.rowcount == 1


def remove_expired(*, session: Session, now: datetime | None = None) -> int:
    result = session.execute(delete(DashboardSession).where(DashboardSession.expires_at < (now or utcnow()))
                             .execution_options(synchronize_session=False))
    return result.rowcount or 0
