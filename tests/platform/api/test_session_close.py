"""The database dropping a request's connection while the request's session is closed (after the handler answered)
must neither replace the answer nor break the connection the client holds: the dead connection leaves the pool
and the next request gets a fresh one. Real PostgreSQL; the backend is terminated with ``pg_terminate_backend``
right before the session's closing ROLLBACK, which is where a database restart mid-request lands."""
from __future__ import annotations

import time

import psycopg
from sqlalchemy import event


def terminate(pg_url: str, pid: int) -> None:
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
        deadline = time.monotonic() + 10
        while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0]:
            assert time.monotonic() < deadline, f"backend {pid} still alive 10 s after pg_terminate_backend"
            time.sleep(0.02)


def test_connection_lost_at_session_close_keeps_the_answer(platform, pg_url):
    _, auth = platform.new_tenant()
    engine = platform.session_factory.kw["bind"]
    killed = []

    def before_rollback(conn):
        if not killed:
            pid = conn.connection.dbapi_connection.info.backend_pid
            terminate(pg_url, pid)
            killed.append(pid)

    event.listen(engine, "rollback", before_rollback)
    try:
        r = platform.client.get("/v1/adapters", headers=auth)
    finally:
        event.remove(engine, "rollback", before_rollback)
    assert killed, "the session was closed without a ROLLBACK: the fault was never injected"
    assert r.status_code == 200, r.text
    assert (r.json()["data"], r.json()["count"]) == ([], 0), r.json()
    again = platform.client.get("/v1/adapters", headers=auth)
    assert again.status_code == 200, again.text
    assert again.json()["count"] == 0
