"""One-time dashboard login links: minted with the admin key, opened once (cookie + redirect), then refused; expired,
tampered or old-admin-key links are refused too."""
from __future__ import annotations

import time

from fastapi.testclient import TestClient

from loraplex.platform.core.config import Settings
from loraplex.platform.dashboard.auth import COOKIE, LinkRedeemer, login_link_token
from loraplex.platform.dashboard.sessions import MemorySessionStore
from tests.platform.dashboard.conftest import ADMIN_KEY

USED = "That login link has expired or was already used"


def test_a_link_opens_the_dashboard_once(app):
    with TestClient(app) as c:
        r = c.post("/admin/dashboard/links")
        assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
        r = c.post("/admin/dashboard/links", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 201
        url = r.json()["url"]
        assert url.startswith("/admin/dashboard?login=") and ADMIN_KEY not in url
        assert r.json()["expires_at"] > time.time() + 500
        r = c.get(url, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/admin/dashboard"
        assert "HttpOnly" in r.headers["set-cookie"] and COOKIE in c.cookies
        assert c.get("/admin/dashboard/data").status_code == 200
        c.cookies.clear()
        r = c.get(url, follow_redirects=False)
        assert r.status_code == 401 and USED in r.text and COOKIE not in c.cookies
        assert c.get("/admin/dashboard/data").status_code == 401


def test_expired_tampered_and_other_key_tokens_are_refused(clock):
    settings = Settings(environment="test", admin_key=ADMIN_KEY, secret_key="secret-" * 4)
    other = Settings(environment="test", admin_key="another-admin-key-0123456789", secret_key="secret-" * 4)
    now = clock.t
    store = MemorySessionStore(clock=clock)
    redeemer = LinkRedeemer(store)
    token, expires = login_link_token(settings, now=now, ttl_s=60)
    assert expires == int(now + 60)
    assert not redeemer.redeem(settings, token, now=now + 61)                   # expired
    assert not redeemer.redeem(other, token, now=now)                           # a new admin key kills it
    head, sig = token.rsplit(".", 1)
    assert not redeemer.redeem(settings, f"{head}.{'0' * len(sig)}", now=now)    # tampered
    assert not redeemer.redeem(settings, "not-a-token", now=now)
    assert not redeemer.redeem(settings, "²." + token.split(".", 1)[1], now=now)     # not ASCII digits
    assert not redeemer.redeem(settings, "9" * 5000 + "." + token.split(".", 1)[1], now=now)
    assert redeemer.redeem(settings, token, now=now) and not redeemer.redeem(settings, token, now=now + 1)
    assert not LinkRedeemer(store).redeem(settings, token, now=now + 1)         # another replica: the same store
    clock.t += 100
    fresh, _ = login_link_token(settings, now=clock.t, ttl_s=60)
    assert redeemer.redeem(settings, fresh, now=clock.t)
    assert len(store._rows) == 1                                                # the used, expired nonce was dropped


def test_a_link_is_used_once_across_replicas_sharing_the_registry(tmp_path):
    """Two platform apps on one registry: a link redeemed on one is refused on the other."""
    from loraplex.commands.db import run
    from loraplex.platform.db.session import make_sessionmaker
    from loraplex.platform.dashboard.sessions import SqlSessionStore

    settings = Settings(environment="test", admin_key=ADMIN_KEY, secret_key="secret-" * 4,
                        data_dir=str(tmp_path))
    run("upgrade", "head", url=settings.sqlalchemy_url)
    sessions = make_sessionmaker(settings)
    token, _ = login_link_token(settings)
    assert LinkRedeemer(SqlSessionStore(sessions)).redeem(settings, token)
    assert not LinkRedeemer(SqlSessionStore(sessions)).redeem(settings, token)
    sessions.kw["bind"].dispose()
