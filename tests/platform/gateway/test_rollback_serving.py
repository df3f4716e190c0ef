"""A rollback over the live app (uvicorn, the null engine as the one replica, the ``openai`` client): the request
right after the move is served by the version ``latest`` now names, and the replica that held the old version was
told to load the new one before any request asked for it."""
from __future__ import annotations

import time

from sqlalchemy import text

from loraplex.platform.gateway.adapters import engine_adapter_id
from tests.platform.gateway.conftest import settings_for


def test_rollback_serves_the_old_version_at_once_and_warms_it(serve, tmp_path, tiny_base, adapters):
    server = serve(settings_for(tmp_path, tiny_base, usage_flush_s=0.05))
    tid, key = server.new_tenant()
    auth = {"Authorization": f"Bearer {key}"}
    v1 = server.upload(key, "bot", adapters["a"])
    v2 = server.upload(key, "bot", adapters["b"])
    assert (v1["number"], v2["number"]) == (1, 2)
    with server.gateway.sessions() as s:
        ids = dict(s.execute(text("SELECT number, id FROM adapter_versions")).all())
    client = server.openai(key)

    def ask() -> str:
        done = client.completions.create(model="bot", prompt=[1, 2, 3], max_tokens=2)
        server.call(server.gateway.usage.flush())
        with server.gateway.sessions() as s:
            return s.execute(text("SELECT adapter_version_id FROM usage_records WHERE request_id = :r"),
                             {"r": done.id}).scalar_one()

    assert ask() == ids[2]
    replica = next(iter(server.gateway.router.replicas.values()))
    old, new = (engine_adapter_id(tid, "bot", ids[n]) for n in (2, 1))
    deadline = time.monotonic() + 10
    while old not in replica.resident:                 # the residency poll has seen v2 on the replica
        assert time.monotonic() < deadline, replica.resident
        time.sleep(0.05)
    assert new not in replica.resident
    r = server.http.post("/v1/adapters/bot/rollback", json={"version": 1}, headers=auth)
    assert r.status_code == 200 and r.json()["previous_version"] == 2, r.text
    deadline = time.monotonic() + 10
    while (replica.replica_id, new) not in server.gateway.notifier.warmed:   # loaded before any request for it
        assert time.monotonic() < deadline, server.gateway.notifier.warmed
        time.sleep(0.02)
    assert ask() == ids[1]                              # the very next request: version 1
    assert client.completions.create(model="bot:2", prompt=[1], max_tokens=1).choices   # v2 is still there
    r = server.http.put("/v1/adapters/bot/aliases/latest", json={"version": 2}, headers=auth)
    assert r.status_code == 200 and ask() == ids[2]     # and forward again through the alias route
