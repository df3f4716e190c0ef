"""The adapter lifecycle over the tenant API on PostgreSQL and moto's S3: dedupe of identical uploads and how it
meets the Idempotency-Key, rollback (the route and ``latest`` through the alias route), alias deletion, an adapter
that goes with its last version (or stays when kept), deleting a whole adapter with failed versions, and the version
history with who and when."""
from __future__ import annotations

import hashlib

from tests.platform.conftest import ADMIN_KEY, read_files


def _key(platform, tid: str, name: str) -> tuple[dict, dict]:
    r = platform.client.post(f"/admin/tenants/{tid}/keys", json={"name": name},
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['key']}"}, r.json()


def test_identical_upload_is_the_existing_version(platform, adapter_dir):
    _, auth = platform.new_tenant()
    a, b = read_files(adapter_dir(seed=1)), read_files(adapter_dir(seed=2))
    c = platform.client
    assert platform.upload(auth, "m", a).status_code == 201
    assert platform.upload(auth, "m", b).status_code == 201
    keys_before = platform.store.list_keys()
    r = platform.upload(auth, "m", a)           # v1's bytes again: v1, latest stays on v2
    assert r.status_code == 200 and r.headers["Loraplex-Deduplicated"] == "true", r.text
    assert r.json()["number"] == 1 and r.json()["sha256"] == hashlib.sha256(a["adapter_model.safetensors"]).hexdigest()
    assert platform.store.list_keys() == keys_before
    assert platform.sql("SELECT count(*) FROM adapter_versions")[0][0] == 2
    assert c.get("/v1/adapters/m", headers=auth).json()["aliases"] == {"latest": 2}
    # another adapter's name is another adapter: its own version 1 and its own blob
    r = platform.upload(auth, "other", a)
    assert r.status_code == 201 and "Loraplex-Deduplicated" not in r.headers
    # with an Idempotency-Key: a key that made v3 replays v3 even for other bytes; a new key on known bytes is the
    # dedupe answer (nothing recorded under that key, so repeating it answers the same)
    c3 = read_files(adapter_dir(seed=3))
    first = platform.upload({**auth, "Idempotency-Key": "k-1"}, "m", c3)
    assert first.status_code == 201 and first.json()["number"] == 3
    replay = platform.upload({**auth, "Idempotency-Key": "k-1"}, "m", a)
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["number"] == 3
    for _ in range(2):
        dup = platform.upload({**auth, "Idempotency-Key": "k-2"}, "m", a)
        assert dup.status_code == 200 and dup.headers["Loraplex-Deduplicated"] == "true" and dup.json()["number"] == 1
    assert platform.sql("SELECT count(*) FROM adapter_versions WHERE idempotency_key = 'k-2'")[0][0] == 0
    # a deleted version is no duplicate: the same bytes make a new version
    assert c.delete("/v1/adapters/m/versions/1", headers=auth).status_code == 204
    again = platform.upload(auth, "m", a)
    assert again.status_code == 201 and again.json()["number"] == 4


def test_rollback_and_alias_routes(platform, adapter_dir):
    _, auth = platform.new_tenant()
    c = platform.client
    for seed in (1, 2, 3):
        assert platform.upload(auth, "m", read_files(adapter_dir(seed=seed))).status_code == 201
    ids = dict(platform.sql("SELECT number, id FROM adapter_versions"))
    r = c.post("/v1/adapters/m/rollback", json={"version": 1}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json() == {"adapter": "m", "alias": "latest", "version": 1, "previous_version": 3}
    assert c.get("/v1/adapters/m", headers=auth).json()["aliases"] == {"latest": 1}
    [p] = platform.notifier.promoted
    assert (p.alias, p.version_id, p.previous_version_id) == ("latest", ids[1], ids[3])
    # the alias route sets latest too (forward again), and any other alias; no move, no promotion
    r = c.put("/v1/adapters/m/aliases/latest", json={"version": 3}, headers=auth)
    assert r.status_code == 200 and r.json()["previous_version"] == 1
    r = c.put("/v1/adapters/m/aliases/prod", json={"version": 2}, headers=auth)
    assert r.status_code == 200 and r.json()["previous_version"] is None
    assert len(platform.notifier.promoted) == 3
    c.put("/v1/adapters/m/aliases/prod", json={"version": 2}, headers=auth)
    assert len(platform.notifier.promoted) == 3
    # the next upload takes latest again
    assert platform.upload(auth, "m", read_files(adapter_dir(seed=4))).json()["number"] == 4
    assert c.get("/v1/adapters/m", headers=auth).json()["aliases"] == {"latest": 4, "prod": 2}
    # refusals
    r = c.post("/v1/adapters/m/rollback", json={"version": 9}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found"
    assert c.delete("/v1/adapters/m/versions/2", headers=auth).status_code == 204
    r = c.post("/v1/adapters/m/rollback", json={"version": 2}, headers=auth)
    assert r.status_code == 409 and r.json()["error"]["code"] == "version_not_ready"
    assert "only ready versions can be rolled back to" in r.json()["error"]["message"]
    r = c.post("/v1/adapters/m/rollback", json={"version": 0}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "version"
    # deleting aliases: prod went with v2; a new one, then removed; latest cannot be removed
    assert c.put("/v1/adapters/m/aliases/canary", json={"version": 1}, headers=auth).status_code == 200
    assert c.delete("/v1/adapters/m/aliases/canary", headers=auth).status_code == 204
    assert c.get("/v1/adapters/m", headers=auth).json()["aliases"] == {"latest": 4}
    r = c.delete("/v1/adapters/m/aliases/canary", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "alias_not_found"
    r = c.delete("/v1/adapters/m/aliases/latest", headers=auth)
    assert r.status_code == 422 and r.json()["error"]["code"] == "reserved_alias"
    assert "rollback" in r.json()["error"]["message"]


def test_adapter_goes_with_its_last_version_unless_kept(platform, adapter_dir):
    _, auth = platform.new_tenant()
    c = platform.client
    assert platform.upload(auth, "gone", read_files(adapter_dir(seed=1))).status_code == 201
    assert platform.upload(auth, "kept", read_files(adapter_dir(seed=2))).status_code == 201
    assert c.delete("/v1/adapters/gone/versions/1", headers=auth).status_code == 204
    assert c.get("/v1/adapters/gone", headers=auth).status_code == 404
    assert [a["name"] for a in c.get("/v1/adapters", headers=auth).json()["data"]] == ["kept"]
    assert c.delete("/v1/adapters/kept/versions/1?keep_adapter=true", headers=auth).status_code == 204
    page = c.get("/v1/adapters", headers=auth).json()
    assert page["data"][0]["name"] == "kept" and page["data"][0]["latest_version"] is None
    assert platform.store.list_keys() == []
    # the kept adapter keeps its numbering; the freed name starts again
    assert platform.upload(auth, "kept", read_files(adapter_dir(seed=3))).json()["number"] == 2
    assert platform.upload(auth, "gone", read_files(adapter_dir(seed=3))).json()["number"] == 1


def test_delete_adapter_removes_failed_versions_blobs(platform, adapter_dir, tmp_path):
    """A version that failed after its blob was written (the registry lost the final commit) left a blob the janitor
    would find later; deleting the adapter removes it at once, with every row."""
    from sqlalchemy import text

    tid, auth = platform.new_tenant()
    assert platform.upload(auth, "m", read_files(adapter_dir(seed=1))).status_code == 201
    key = f"adapters/{tid}/m/stray/{'0' * 64}.safetensors"
    (tmp_path / "stray").write_bytes(b"left behind")
    platform.store.put_file(key, str(tmp_path / "stray"), sha256=hashlib.sha256(b"left behind").hexdigest())
    [(aid,)] = platform.sql("SELECT id FROM adapters")
    with platform.session_factory() as s:
        s.execute(text("INSERT INTO adapter_versions (id, adapter_id, tenant_id, number, status, targets, blob_key, "
                       "created_at, updated_at) VALUES ('failedv', :a, :t, 2, 'failed', '[]', :k, now(), now())"),
                  {"a": aid, "t": tid, "k": key})
        s.commit()
    assert len(platform.store.list_keys()) == 2
    assert platform.client.delete("/v1/adapters/m", headers=auth).status_code == 204
    assert platform.store.list_keys() == []
    assert platform.sql("SELECT count(*) FROM adapter_versions")[0][0] == 0
    assert platform.sql("SELECT count(*) FROM adapters")[0][0] == 0


def test_version_history_says_who_and_when(platform, adapter_dir):
    tid, ci = platform.new_tenant()
    alice, alice_row = _key(platform, tid, "alice")
    c = platform.client
    a = read_files(adapter_dir(seed=1))
    assert platform.upload(ci, "m", a).status_code == 201
    assert platform.upload(alice, "m", read_files(adapter_dir(seed=2))).status_code == 201
    assert c.put("/v1/adapters/m/aliases/prod", json={"version": 1}, headers=alice).status_code == 200
    assert platform.upload(ci, "m", read_files(adapter_dir(seed=3))).status_code == 201
    assert c.delete("/v1/adapters/m/versions/3", headers=alice).status_code == 204
    r = c.get("/v1/adapters/m/versions", headers=ci)
    assert r.status_code == 200, r.text
    h = r.json()
    assert h["adapter"] == "m" and [v["number"] for v in h["data"]] == [3, 2, 1]
    v3, v2, v1 = h["data"]
    assert v1["created_by"]["name"] == "test" and v2["created_by"] == {"id": alice_row["id"], "name": "alice",
                                                                       "prefix": alice_row["prefix"]}
    assert v1["sha256"] == hashlib.sha256(a["adapter_model.safetensors"]).hexdigest()
    assert v1["size_bytes"] == len(a["adapter_model.safetensors"]) and v1["status"] == "ready"
    assert v1["aliases"] == ["prod"] and v2["aliases"] == ["latest"] and v3["aliases"] == []
    assert v3["status"] == "deleted" and v3["deleted_by"]["name"] == "alice" and v3["deleted_at"]
    assert v1["deleted_at"] is None and v1["source"] is None and v1["created_at"] <= v2["created_at"]
    aliases = {x["alias"]: x for x in h["aliases"]}
    assert aliases["prod"]["version"] == 1 and aliases["prod"]["updated_by"]["name"] == "alice"
    assert aliases["latest"]["version"] == 2 and aliases["latest"]["updated_by"]["name"] == "alice"  # her delete
    # another tenant: 404 like a missing adapter
    _, other = platform.new_tenant()
    r = c.get("/v1/adapters/m/versions", headers=other)
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
