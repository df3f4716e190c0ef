"""Liveness and readiness."""
from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from loraplex.platform.api.deps import SessionDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: answered on the event loop itself (no thread, no database), so it measures exactly whether the
    loop is free."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(session: SessionDep) -> dict[str, str]:
    session.execute(text("SELECT 1"))
    return {"status": "ready"}
