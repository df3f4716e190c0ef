"""The admin dashboard's routes (``install_dashboard`` mounts them):

    GET  /admin/dashboard            the page with a session cookie (or an admin bearer token), else the login form
    GET  /admin/dashboard?login=T    one-time link: a session cookie + 303 to the bare URL, once per token
    GET  /admin/dashboard?key=K      refused (400, the login form): a key in a URL ends up in logs and history
    POST /admin/dashboard/links      admin key (bearer) -> 201 {"url", "expires_at"}: a one-time login link
    POST /admin/dashboard/login      form field ``key`` -> cookie + 303 to the page; a wrong key -> 401 form
    POST /admin/dashboard/logout     revokes the session server-side and clears the cookie
    GET  /admin/dashboard/data       the JSON the page polls (cookie or bearer; 401 otherwise)
    GET  /admin/dashboard/adapters   the "Adapters" view: the most recently changed adapters (``?tenant=`` a name)
    GET  /admin/dashboard/adapters/{id}/versions   one adapter's version history (who, when, sha256, aliases)
    GET  /admin/dashboard/static/*   the page's script, style and Chart.js (no secrets; no auth)
"""
from __future__ import annotations

import asyncio
import html
import logging
from importlib import resources
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool

from loraplex.platform.api.deps import Credentials, SettingsDep, require_admin
from loraplex.platform.dashboard.auth import (COOKIE, DashboardAdmin, LinkRedeemer, clear_session_cookie,
                                              end_session, has_session, login_link_token, new_session,
                                              set_session_cookie, valid_admin_key)
from loraplex.platform.dashboard.data import dashboard_data, resident_ids
from loraplex.platform.dashboard.names import adapter_history, adapter_list, resident_names
from loraplex.platform.dashboard.sessions import session_store_of

logger = logging.getLogger(__name__)
PAGE = "/admin/dashboard"
MAX_FORM_BYTES = 4096
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
                               "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
}


def _static_text(name: str) -> str:
    return resources.files("loraplex.platform.dashboard").joinpath("static", name).read_text(encoding="utf-8")


def _login(error: str | None, status: int) -> HTMLResponse:
    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    return HTMLResponse(_static_text("login.html").replace("{{error}}", message), status_code=status,
                        headers=SECURITY_HEADERS)


def _page() -> HTMLResponse:
    return HTMLResponse(_static_text("index.html"), headers=SECURITY_HEADERS)


async def _signed_in(request: Request, settings) -> RedirectResponse:
    token = await run_in_threadpool(new_session, session_store_of(request.app), settings)
    response = RedirectResponse(PAGE, status_code=303, headers=SECURITY_HEADERS)
    set_session_cookie(response, request, settings, token)
    return response


router = APIRouter(prefix=PAGE, tags=["dashboard"], include_in_schema=False)


def _redeemer(request: Request) -> LinkRedeemer:
    return LinkRedeemer(session_store_of(request.app))


@router.get("")
async def page(request: Request, settings: SettingsDep, credentials: Credentials,
               key: str | None = Query(default=None, max_length=512),
               login: str | None = Query(default=None, max_length=512)):
    if login is not None:
        if await run_in_threadpool(_redeemer(request).redeem, settings, login):
            return await _signed_in(request, settings)
        return _login("That login link has expired or was already used; sign in with the admin key.", 401)
    if key is not None:
        logger.info("dashboard: refused an admin key in the URL (the access log shows it redacted)")
        return _login("Admin keys are not accepted in URLs (they end up in logs and browser history); type the "
                      "key below, or open a one-time link from POST /admin/dashboard/links.", 400)
    bearer_ok = credentials is not None and valid_admin_key(settings, credentials.credentials)
    if bearer_ok or await run_in_threadpool(has_session, request, settings):
        return _page()
    return _login(None, 401)


@router.post("/login")
async def login(request: Request, settings: SettingsDep, credentials: Credentials):
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        return _login("The login form is too large.", 413)
    key = parse_qs(body.decode("utf-8", "replace")).get("key", [""])[0]
    if not valid_admin_key(settings, key):
        logger.info("dashboard login refused (wrong admin key)")
        return _login("That admin key is not valid; check LORAPLEX_ADMIN_KEY and try again.", 401)
    return await _signed_in(request, settings)


@router.post("/links", status_code=201, dependencies=[Depends(require_admin)])
async def new_link(settings: SettingsDep):
    """A one-time login link (relative URL) for a browser, valid ``LINK_TTL_S`` seconds."""
    token, expires = login_link_token(settings)
    return {"url": f"{PAGE}?login={token}", "expires_at": expires}


@router.post("/logout")
async def logout(request: Request):
    """Revokes the session server-side (a copy of the cookie stops working too) and clears the cookie."""
    await run_in_threadpool(end_session, session_store_of(request.app), request.cookies.get(COOKIE))
    response = RedirectResponse(PAGE, status_code=303, headers=SECURITY_HEADERS)
    clear_session_cookie(response)
    return response


@router.get("/data")
async def data(request: Request, _: DashboardAdmin, bin_s: int = Query(default=5, ge=1, le=60),
               span_s: int = Query(default=300, ge=10, le=900)):
    state = request.app.state
    poller = getattr(state, "engine_stats_poller", None)
    if poller is not None:
        await poller.refresh()
    quotas: dict = {}
    source = getattr(state, "dashboard_quota_source", None)
    if source is not None:
        try:
            quotas = await asyncio.to_thread(source)
        except Exception as e:  # noqa: BLE001 - the registry being down must not blank the dashboard
            logger.warning("dashboard quotas unavailable: %s", type(e).__name__)
    names: dict = {}
    sessionmaker = getattr(state, "sessionmaker", None)
    ids = resident_ids(dict(state.metrics.engines))
    if sessionmaker is not None and ids:
        try:
            names = await asyncio.to_thread(resident_names, sessionmaker, ids)
        except Exception as e:  # noqa: BLE001 - the registry being down must not blank the dashboard
            logger.warning("dashboard names unavailable: %s", type(e).__name__)
    return JSONResponse(dashboard_data(state.metrics, quotas=quotas, bin_s=bin_s, span_s=min(span_s,
                        state.metrics.config.window_horizon_s), names=names), headers={"Cache-Control": "no-store"})


@router.get("/adapters")
async def adapters(request: Request, _: DashboardAdmin,
                   tenant: str | None = Query(default=None, max_length=100)):
    rows = await run_in_threadpool(adapter_list, request.app.state.sessionmaker, tenant=tenant)
    return JSONResponse({"data": rows}, headers={"Cache-Control": "no-store"})


@router.get("/adapters/{adapter_id}/versions")
async def adapter_versions(request: Request, _: DashboardAdmin,
                           adapter_id: str = Path(min_length=1, max_length=64)):
    history = await run_in_threadpool(adapter_history, request.app.state.sessionmaker, adapter_id)
    if history is None:
        return JSONResponse({"error": {"message": f"adapter {adapter_id!r} not found", "type": "invalid_request_error",
                                       "param": None, "code": "adapter_not_found"}}, status_code=404)
    return JSONResponse(history, headers={"Cache-Control": "no-store"})
