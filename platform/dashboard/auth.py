"""Browser sessions for the admin dashboard. The admin key is typed once, in the login form (POSTed, never in a URL),
or replaced by a one-time link; the server answers with an HttpOnly cookie holding a random session token:

    cookie loraplex_dashboard = "<random token>"      the server keeps sha256(token) in its session store
                                                      (sessions.py: the registry's dashboard_sessions table)

A session is valid while its row exists, is not revoked and has not expired (``LORAPLEX_DASHBOARD_SESSION_S``, 12 h),
and was made under the current admin key (rows carry a fingerprint of it: a new admin key ends every session).
Sign-out revokes the row, so a copy of the cookie stops working at once, on every replica.

A one-time login link (``POST /admin/dashboard/links`` with the admin key; ``loraplex demo`` prints one) carries no
key: ``?login=<expires>.<nonce>.<HMAC(admin key, 'loraplex-dashboard-link:<expires>:<nonce>')>``, valid
``LINK_TTL_S`` and once: redeeming stores its nonce (hashed) in the same store, which refuses it a second time on
any replica.

The cookie is ``SameSite=Strict`` (no cross-site use), ``Path=/admin/dashboard`` and ``Secure`` on HTTPS. API
clients may send ``Authorization: Bearer <admin key>`` instead: ``DashboardAdmin`` falls back to the admin API's
own check (``require_admin``).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Annotated

from fastapi import Depends, Request, Response

from loraplex.platform.api.deps import Credentials, SettingsDep, require_admin
from loraplex.platform.core.config import Settings
from loraplex.platform.core.security import same_secret
from loraplex.platform.dashboard.sessions import SessionStore, session_store_of, token_hash

COOKIE = "loraplex_dashboard"
COOKIE_PATH = "/admin/dashboard"
LINK_TTL_S = 600


def key_id(settings: Settings) -> str:
    """A fingerprint of the admin key (not reversible), stored with each session."""
    key = settings.admin_key.get_secret_value().encode()
    return hmac.new(key, b"loraplex-dashboard-session", hashlib.sha256).hexdigest()[:16]


def new_session(store: SessionStore, settings: Settings) -> str:
    """A fresh session token, stored (hashed) for ``settings.dashboard_session_s``."""
    token = secrets.token_urlsafe(32)
    store.add("session", token_hash(token), key_id(settings), settings.dashboard_session_s)
    return token


def valid_session(store: SessionStore, settings: Settings, token: str | None) -> bool:
    return bool(token) and len(token) <= 256 and store.is_valid(token_hash(token), key_id(settings))


def end_session(store: SessionStore, token: str | None) -> None:
    if token and len(token) <= 256:
        store.revoke(token_hash(token))


def _epoch(text: str) -> bool:
    """An epoch-seconds field: ASCII digits only ('²'.isdigit() is true) and short (int() has a digit limit)."""
    return text.isascii() and text.isdigit() and len(text) <= 12


def _link_signature(settings: Settings, expires: int, nonce: str) -> str:
    key = settings.admin_key.get_secret_value().encode()
    return hmac.new(key, f"loraplex-dashboard-link:{expires}:{nonce}".encode(), hashlib.sha256).hexdigest()


def login_link_token(settings: Settings, now: float | None = None, ttl_s: int = LINK_TTL_S) -> tuple[str, int]:
    """A fresh one-time login token and its expiry (epoch s)."""
    expires, nonce = int((time.time() if now is None else now) + ttl_s), secrets.token_urlsafe(16)
    return f"{expires}.{nonce}.{_link_signature(settings, expires, nonce)}", expires


class LinkRedeemer:
    """Accepts each valid login-link token once: its nonce goes into the session store, which refuses a repeat."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    def redeem(self, settings: Settings, token: str | None, now: float | None = None) -> bool:
        parts = (token or "").split(".")
        if len(parts) != 3 or not _epoch(parts[0]):
            return False
        expires, nonce, signature = int(parts[0]), parts[1], parts[2]
        now = time.time() if now is None else now
        if expires < now or not same_secret(signature, _link_signature(settings, expires, nonce)):
            return False
        return self.store.add("link", token_hash(f"link:{nonce}"), key_id(settings), max(1.0, expires - now))


def valid_admin_key(settings: Settings, key: str | None) -> bool:
    return bool(key) and same_secret(key, settings.admin_key.get_secret_value())


def set_session_cookie(response: Response, request: Request, settings: Settings, token: str) -> None:
    response.set_cookie(COOKIE, token, max_age=settings.dashboard_session_s, path=COOKIE_PATH, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")


def clear_session_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")


def has_session(request: Request, settings: Settings) -> bool:
    """Blocking (the store may be the registry): call from a worker thread in async code."""
    return valid_session(session_store_of(request.app), settings, request.cookies.get(COOKIE))


def dashboard_admin(request: Request, settings: SettingsDep, credentials: Credentials) -> None:
    """The dashboard session cookie, else the admin key as a bearer token (401 otherwise). A sync dependency:
    FastAPI runs it in a worker thread."""
    if has_session(request, settings):
        return
    require_admin(settings, credentials)


DashboardAdmin = Annotated[None, Depends(dashboard_admin)]
