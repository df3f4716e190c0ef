"""The same upload flow on the embedded defaults: a SQLite file and a local blob folder."""
from __future__ import annotations

import hashlib
import io
import os

from tests.platform.conftest import read_files


def test_upload_flow_on_sqlite_and_local_folder(embedded, adapter_dir):
    p = embedded
    assert p.settings.sqlalchemy_url.startswith("sqlite:///") and p.settings.blob_backend == "local"
    tid, auth = p.new_tenant()
    a, b = read_files(adapter_dir(seed=1)), read_files(adapter_dir(seed=2))
    r = p.upload(auth, "m", a)
    assert r.status_code == 201 and r.json()["status"] == "ready"
    sha = hashlib.sha256(a["adapter_model.safetensors"]).hexdigest()
    [(vid, key)] = p.sql("SELECT id, blob_key FROM adapter_versions")
    assert key == f"adapters/{tid}/m/{vid}/{sha}.safetensors"        # recorded before the blob was written
    assert p.store.list_keys() == [key]
    path = os.path.join(p.settings.blob_path, key)
    assert open(path, "rb").read() == a["adapter_model.safetensors"]
    assert p.sql("SELECT blob_uri FROM adapter_versions")[0][0] == "file://" + path
    again = p.upload(auth, "m", a)                                     # identical: version 1 again
    assert again.status_code == 200 and again.json()["number"] == 1 and len(p.store.list_keys()) == 1
    assert p.upload(auth, "m", b).json()["number"] == 2 and len(p.store.list_keys()) == 2
    c = read_files(adapter_dir(seed=3))
    assert p.upload(auth, "m", c).json()["number"] == 3 and len(p.store.list_keys()) == 3
    assert p.client.put("/v1/adapters/m/aliases/prod", json={"version": 1}, headers=auth).status_code == 200
    assert p.client.get("/v1/adapters/m", headers=auth).json()["aliases"] == {"latest": 3, "prod": 1}
    _, other = p.new_tenant()
    assert p.client.get("/v1/adapters/m", headers=other).status_code == 404
    assert p.client.delete("/v1/adapters/m/versions/3", headers=auth).status_code == 204
    assert p.client.get("/v1/adapters/m", headers=auth).json()["aliases"] == {"latest": 2, "prod": 1}
    assert p.client.delete("/v1/adapters/m", headers=auth).status_code == 204
    assert p.store.list_keys() == [] and p.sql("SELECT count(*) FROM adapters")[0][0] == 0
    assert os.listdir(p.settings.blob_path) == []                     # emptied folders pruned


def test_hostile_upload_on_embedded_defaults(embedded, adapter_dir):
    p = embedded
    _, auth = p.new_tenant()
    files = read_files(adapter_dir(r=32))
    r = p.upload(auth, "m", files)
    assert r.status_code == 422 and "retrain with r <= 16" in r.json()["error"]["message"]
    r = p.client.post("/v1/adapters", data={"name": "m"}, headers=auth,
                      files=[("files", ("adapter_model.safetensors", io.BytesIO(b"\x80\x04junk")))])
    assert r.status_code == 422 and "missing adapter_config.json" in r.json()["error"]["message"]
    p.assert_nothing_stored()
    assert os.listdir(p.settings.blob_path) == []
