"""Browser sessions for the admin dashboard. The admin key is typed once (login form, or a ``?key=`` link); the
server answers with an HttpOnly cookie holding a signed expiry, never the key:

    cookie loraplex_dashboard = "<expires epoch s>.<hex HMAC-SHA256(admin key, 'loraplex-dashboard:<expires>')>"

A one-time login link (``POST /admin/dashboard/links`` with the admin key; ``loraplex demo`` prints one) carries
no key either: ``?login=<expires>.<nonce>.<HMAC(admin key, 'loraplex-dashboard-link:<expires>:<nonce>')>``, valid
``LINK_TTL_S`` and once (``LinkRedeemer`` remembers used nonces until they expire; per process, so behind several
platform replicas a link could be used once on each within its few minutes).

Changing ``LORAPLEX_ADMIN_KEY`` invalidates every session and link. The cookie is ``SameSite=Strict`` (no cross-site use),
``Path=/admin/dashboard`` and ``Secure`` on HTTPS. API clients may send ``Authorization: Bearer <admin key>``
instead: ``DashboardAdmin`` falls back to the admin API's own check (``require_admin``).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from typing import Annotated

from fastapi import Depends, Request, Response

from loraplex.platform.api.deps import Credentials, SettingsDep, require_admin
from loraplex.platform.core.config import Settings
from loraplex.platform.core.security import same_secret

COOKIE = "loraplex_dashboard"
COOKIE_PATH = "/admin/dashboard"
SESSION_S = 12 * 3600
LINK_TTL_S = 600


def _signature(settings: Settings, expires: int) -> str:
    key = settings.admin_key.get_secret_value().encode()
    return hmac.new(key, f"loraplex-dashboard:{expires}".encode(), hashlib.sha256).hexdigest()


def session_token(settings: Settings, now: float | None = None, ttl_s: int = SESSION_S) -> str:
    expires = int((time.time() if now is None else now) + ttl_s)
    return f"{expires}.{_signature(settings, expires)}"


def valid_session(settings: Settings, token: str | None, now: float | None = None) -> bool:
    """True for an unexpired token signed with the current admin key."""
    if not token or "." not in token:
        return False
    expires_text, signature = token.split(".", 1)
    if not _epoch(expires_text) or int(expires_text) < (time.time() if now is None else now):
        return False
    return same_secret(signature, _signature(settings, int(expires_text)))


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
    """Accepts each valid login-link token once (thread-safe; used nonces are forgotten when they expire)."""

    def __init__(self) -> None:
        self._used: dict[str, int] = {}
        self._lock = threading.Lock()

    def redeem(self, settings: Settings, token: str | None, now: float | None = None) -> bool:
        parts = (token or "").split(".")
        if len(parts) != 3 or not _epoch(parts[0]):
            return False
        expires, nonce, signature = int(parts[0]), parts[1], parts[2]
        now = time.time() if now is None else now
        if expires < now or not same_secret(signature, _link_signature(settings, expires, nonce)):
            return False
        with self._lock:
            for old in [n for n, e in self._used.items() if e < now]:
                del self._used[old]
            if nonce in self._used:
                return False
            self._used[nonce] = expires
        return True


def valid_admin_key(settings: Settings, key: str | None) -> bool:
    return bool(key) and same_secret(key, settings.admin_key.get_secret_value())


def set_session_cookie(response: Response, request: Request, settings: Settings) -> None:
    response.set_cookie(COOKIE, session_token(settings), max_age=SESSION_S, path=COOKIE_PATH, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")


def clear_session_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")


def has_session(request: Request, settings: Settings) -> bool:
    return valid_session(settings, request.cookies.get(COOKIE))


def dashboard_admin(request: Request, settings: SettingsDep, credentials: Credentials) -> None:
    """The dashboard session cookie, else the admin key as a bearer token (401 otherwise)."""
    if has_session(request, settings):
        return
    require_admin(settings, credentials)


DashboardAdmin = Annotated[None, Depends(dashboard_admin)]
