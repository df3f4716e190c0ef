"""Liveness and readiness.

    GET /healthz   liveness: the process and its event loop answer (no database, no engine)
    GET /readyz    readiness: the registry database answers AND at least one engine replica is ready
                   (the embedded engine loaded; a remote engine's /health says ready); 503 ``not_ready`` saying
                   what is missing otherwise (engine URLs and errors go to the log, not to the answer: the route
                   needs no credentials). A deployment without engines (``LORAPLEX_ENGINE_MODE=none``)
                   needs the database only.

Kubernetes routes traffic to a pod only while /readyz is 200 and restarts it only when /healthz fails, so a
platform pod whose engines are all down (or still loading) leaves the Service's endpoints without being killed.
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from sqlalchemy import text

from loraplex.platform.api.errors import ApiError

router = APIRouter(tags=["health"])
logger = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0      # each check of /readyz (the database, every engine at once) answers within this


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: answered on the event loop itself (no thread, no database), so it measures exactly whether the
    loop is free."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> dict[str, str]:
    """Readiness: the database answers and an engine is ready (both checked at once, each within
    ``PROBE_TIMEOUT_S``); 503 ``not_ready`` saying what is missing."""
    database, engines = await asyncio.gather(_database_problem(request), _engine_problem(request))
    problems = [p for p in (database, engines) if p]
    if problems:
        raise ApiError(503, "not ready: " + "; ".join(problems), code="not_ready")
    return {"status": "ready"}


async def _database_problem(request: Request) -> str | None:
    def ping() -> None:
        with request.app.state.sessionmaker() as session:
            session.execute(text("SELECT 1"))

    try:
        await asyncio.wait_for(asyncio.to_thread(ping), PROBE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return f"the registry database did not answer within {PROBE_TIMEOUT_S:g} s"
    except Exception as e:  # noqa: BLE001 - any failure to answer is "not ready"
        logger.warning("readiness: database unavailable: %s", type(e).__name__)
        return f"the registry database is unavailable ({type(e).__name__})"
    return None


async def _engine_problem(request: Request) -> str | None:
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is None:
        return "the inference gateway is not running (starting or stopping)"
    if gateway.router is None:
        settings = gateway.settings
        if not settings.engine_urls and settings.engine_mode == "none":
            return None     # no engines by configuration: management API only
        return "no engine replica could be built (the platform's log says why)"
    replicas = list(gateway.router.replicas.values())
    tasks = {asyncio.create_task(asyncio.wait_for(r.client.health(), PROBE_TIMEOUT_S)): r.replica_id
             for r in replicas}
    reasons: list[str] = []
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                if error is None and task.result().ready:
                    return None
                reasons.append(f"{tasks[task]}: {_reason(error)}")
    finally:
        for task in pending:
            task.cancel()
    logger.info("readiness: no engine replica is ready: %s", "; ".join(sorted(reasons)))
    return (f"no engine replica is ready (none of {len(replicas)} answered ready within {PROBE_TIMEOUT_S:g} s; "
            "the platform's log names each)")


def _reason(error: BaseException | None) -> str:
    if error is None:
        return "not ready"
    if isinstance(error, asyncio.TimeoutError):
        return f"no answer within {PROBE_TIMEOUT_S:g} s"
    return str(error)[:200] or type(error).__name__
