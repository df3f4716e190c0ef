"""Tenant adapter API on PostgreSQL and moto's S3: upload, dedupe, versions, aliases, delete, idempotency,
tenant isolation (the lifecycle routes: test_adapter_lifecycle.py)."""
from __future__ import annotations

import hashlib
import json
import threading

from tests.platform.conftest import read_files


def test_upload_ready_with_metadata(platform, adapter_dir):
    tid, auth = platform.new_tenant()
    files = read_files(adapter_dir(r=4, alpha=8))
    r = platform.upload(auth, "support-bot", files)
    assert r.status_code == 201, r.text
    v = r.json()
    sha = hashlib.sha256(files["adapter_model.safetensors"]).hexdigest()
    assert v["status"] == "ready" and v["number"] == 1 and v["adapter"] == "support-bot"
    assert v["sha256"] == sha and v["size_bytes"] == len(files["adapter_model.safetensors"])
    assert v["rank"] == 4 and v["alpha"] == 8 and v["dtype"] == "F32" and v["base_model"] == "tiny-base"
    assert set(v["targets"]) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                 "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    [(vid,)] = platform.sql("SELECT id FROM adapter_versions")
    key = f"adapters/{tid}/support-bot/{vid}/{sha}.safetensors"
    assert platform.store.list_keys() == [key]
    assert b"".join(platform.store.iter_chunks(key)) == files["adapter_model.safetensors"]
    row = platform.sql("SELECT status, blob_uri, adapter_config FROM adapter_versions")[0]
    assert row[0] == "ready" and row[1] == f"s3://{platform.settings.s3_bucket}/{key}"
    cfg = row[2] if isinstance(row[2], dict) else json.loads(row[2])
    assert cfg["r"] == 4
    got = platform.client.get("/v1/adapters/support-bot", headers=auth).json()
    assert got["aliases"] == {"latest": 1} and [x["status"] for x in got["versions"]] == ["ready"]


def test_same_content_is_the_existing_version_and_versions_increase(platform, adapter_dir):
    _, auth = platform.new_tenant()
    puts = []
    real_put = platform.store.put_file
    platform.store.put_file = lambda *a, **k: puts.append(a[0]) or real_put(*a, **k)
    a, b = read_files(adapter_dir(seed=1)), read_files(adapter_dir(seed=2))
    first = platform.upload(auth, "m", a)
    assert first.status_code == 201 and first.json()["number"] == 1
    second = platform.upload(auth, "m", a)
    assert second.status_code == 200 and second.headers["Loraplex-Deduplicated"] == "true"
    assert second.json()["number"] == 1 and second.json()["sha256"] == first.json()["sha256"]
    assert len(puts) == 1 and len(platform.store.list_keys()) == 1
    assert platform.sql("SELECT count(*) FROM adapter_versions")[0][0] == 1
    third = platform.upload(auth, "m", b).json()
    assert third["number"] == 2 and len(puts) == 2 and len(platform.store.list_keys()) == 2
    assert platform.client.get("/v1/adapters/m", headers=auth).json()["aliases"] == {"latest": 2}


def test_alias_moves_atomically(platform, adapter_dir):
    _, auth = platform.new_tenant()
    for seed in (1, 2, 3):
        assert platform.upload(auth, "m", read_files(adapter_dir(seed=seed))).status_code == 201
    c = platform.client
    r = c.put("/v1/adapters/m/aliases/prod", json={"version": 2}, headers=auth)
    assert r.status_code == 200 and r.json() == {"adapter": "m", "alias": "prod", "version": 2, "previous_version": None}
    assert c.get("/v1/adapters/m", headers=auth).json()["aliases"] == {"latest": 3, "prod": 2}
    r = c.put("/v1/adapters/m/aliases/prod", json={"version": 9}, headers=auth)
    assert r.status_code == 404 and "has no version 9" in r.json()["error"]["message"]
    r = c.put("/v1/adapters/m/aliases/latest", json={"version": 1}, headers=auth)
    assert r.status_code == 200 and r.json()["previous_version"] == 3
    assert c.get("/v1/adapters/m", headers=auth).json()["aliases"] == {"latest": 1, "prod": 2}
    # many concurrent moves: one row, pointing at one of the requested versions
    errors = []

    def move(n):
        resp = c.put("/v1/adapters/m/aliases/prod", json={"version": n}, headers=auth)
        if resp.status_code != 200:
            errors.append(resp.text)
    threads = [threading.Thread(target=move, args=(1 + i % 3,)) for i in range(12)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []
    rows = platform.sql("SELECT count(*) FROM adapter_aliases WHERE name = 'prod'")
    assert rows[0][0] == 1
    assert c.get("/v1/adapters/m", headers=auth).json()["aliases"]["prod"] in (1, 2, 3)


def test_delete_version_and_adapter(platform, adapter_dir):
    _, auth = platform.new_tenant()
    c = platform.client
    for seed in (1, 2):
        platform.upload(auth, "m", read_files(adapter_dir(seed=seed)))
    c.put("/v1/adapters/m/aliases/prod", json={"version": 2}, headers=auth)
    assert len(platform.store.list_keys()) == 2
    r = c.delete("/v1/adapters/m/versions/2", headers=auth)
    assert r.status_code == 204
    got = c.get("/v1/adapters/m", headers=auth).json()
    assert got["aliases"] == {"latest": 1}
    assert [v["status"] for v in got["versions"]] == ["ready", "deleted"]
    assert len(platform.store.list_keys()) == 1
    assert [e.version_id for e in platform.notifier.evicted] == [
        platform.sql("SELECT id FROM adapter_versions WHERE number = 2")[0][0]]
    r = c.put("/v1/adapters/m/aliases/prod", json={"version": 2}, headers=auth)
    assert r.status_code == 409 and "only ready versions" in r.json()["error"]["message"]
    assert c.delete("/v1/adapters/m", headers=auth).status_code == 204
    assert platform.store.list_keys() == []
    assert len(platform.notifier.evicted) == 2
    r = c.get("/v1/adapters/m", headers=auth)
    assert r.status_code == 404 and "adapter 'm' not found" in r.json()["error"]["message"]
    assert platform.sql("SELECT count(*) FROM adapter_versions")[0][0] == 0


def test_shared_blob_survives_deleting_one_version(platform, adapter_dir):
    """The same weights under another config (here lora_alpha) are another version that shares the blob."""
    _, auth = platform.new_tenant()
    files = read_files(adapter_dir(seed=1))
    config = json.loads(files["adapter_config.json"])
    other = {**files, "adapter_config.json": json.dumps({**config, "lora_alpha": config["lora_alpha"] * 2}).encode()}
    assert platform.upload(auth, "m", files).status_code == 201
    r = platform.upload(auth, "m", other)
    assert r.status_code == 201 and r.json()["number"] == 2 and r.json()["alpha"] == config["lora_alpha"] * 2
    assert len(platform.store.list_keys()) == 1
    assert platform.client.delete("/v1/adapters/m/versions/1", headers=auth).status_code == 204
    assert len(platform.store.list_keys()) == 1
    assert platform.client.delete("/v1/adapters/m/versions/2", headers=auth).status_code == 204
    assert platform.store.list_keys() == []


def test_idempotency_key_replays(platform, adapter_dir):
    _, auth = platform.new_tenant()
    files = read_files(adapter_dir(seed=1))
    hdr = {**auth, "Idempotency-Key": "upload-42"}
    first = platform.upload(hdr, "m", files)
    again = platform.upload(hdr, "m", files)
    assert first.status_code == 201 and again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true" and again.json()["number"] == first.json()["number"]
    assert platform.sql("SELECT count(*) FROM adapter_versions")[0][0] == 1
    other = platform.upload(hdr, "other", files)
    assert other.status_code == 422 and "use a new key" in other.json()["error"]["message"]


def test_list_is_paginated(platform, adapter_dir):
    _, auth = platform.new_tenant()
    files = read_files(adapter_dir(seed=1))
    for n in ("a", "b", "c"):
        platform.upload(auth, n, files)
    page = platform.client.get("/v1/adapters?offset=1&limit=1", headers=auth).json()
    assert page["count"] == 3 and [a["name"] for a in page["data"]] == ["b"]
    assert page["data"][0]["latest_version"] == 1
    r = platform.client.get("/v1/adapters?limit=500", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


def test_tenant_isolation_is_404(platform, adapter_dir):
    _, auth_a = platform.new_tenant("alpha")
    _, auth_b = platform.new_tenant("beta")
    files = read_files(adapter_dir(seed=1))
    assert platform.upload(auth_a, "secret", files).status_code == 201
    c = platform.client
    assert c.get("/v1/adapters", headers=auth_b).json() == {"data": [], "count": 0}
    for method, url, kw in [("get", "/v1/adapters/secret", {}),
                            ("put", "/v1/adapters/secret/aliases/prod", {"json": {"version": 1}}),
                            ("delete", "/v1/adapters/secret/versions/1", {}),
                            ("delete", "/v1/adapters/secret", {})]:
        r = getattr(c, method)(url, headers=auth_b, **kw)
        assert r.status_code == 404, (method, url, r.text)
        assert r.json()["error"]["message"] == "adapter 'secret' not found"
    # B's own adapter of the same name is separate, and A's is untouched
    assert platform.upload(auth_b, "secret", files).json()["number"] == 1
    assert c.get("/v1/adapters/secret", headers=auth_a).json()["aliases"] == {"latest": 1}
    assert len(platform.store.list_keys()) == 2
    # B's Idempotency-Key space is its own
    assert platform.upload({**auth_a, "Idempotency-Key": "k"}, "x", files).status_code == 201
    assert platform.upload({**auth_b, "Idempotency-Key": "k"}, "y", files).status_code == 201


def test_openapi_documents_the_upload(platform):
    spec = platform.client.get("/openapi.json").json()
    body = spec["paths"]["/v1/adapters"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert set(body["schema"]["properties"]) == {"name", "files"}
    assert "example" in str(spec["paths"]["/v1/adapters"]["post"]["responses"]["422"])
