"""UploadMetricsMiddleware: real uploads through the platform app are counted by tenant, outcome and reason and
named (tenant, adapter, version) in the recent list, and an upload's progress (bytes of Content-Length, stage) is
visible while the route runs."""
from __future__ import annotations

import io

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from loraplex.platform.metrics import install_metrics
from tests.platform.conftest import read_files
from tests.platform.metrics.conftest import parse_scrape, sample


def test_platform_uploads_are_counted_by_outcome_and_reason(embedded, adapter_dir):
    p = embedded
    metrics = p.client.app.state.metrics   # create_app installs the metrics and the upload middleware
    _, auth = p.new_tenant("acme")
    good, other = read_files(adapter_dir(seed=3)), read_files(adapter_dir(seed=4))
    assert p.upload(auth, "m", good).status_code == 201
    r = p.upload({**auth, "Idempotency-Key": "k1"}, "m", other)
    assert r.status_code == 201
    r = p.upload({**auth, "Idempotency-Key": "k1"}, "m", other)
    assert r.status_code == 200 and r.headers["Idempotent-Replayed"] == "true"
    r = p.upload(auth, "m", good)
    assert r.status_code == 200 and r.headers["Loraplex-Deduplicated"] == "true"
    r = p.upload(auth, "m", read_files(adapter_dir(r=32)))
    assert r.status_code == 422 and "retrain with r <= 16" in r.json()["error"]["message"]
    code = r.json()["error"]["code"]
    r = p.client.post("/v1/adapters", data={"name": "m"}, headers=auth,
                      files=[("files", ("adapter_model.safetensors", io.BytesIO(b"\x80\x04junk")))])
    assert r.status_code == 422
    code2 = r.json()["error"]["code"]
    v = parse_scrape(p.client.get("/metrics", headers=p.admin()).text)
    assert sample(v, "loraplex_uploads_total", tenant="acme", outcome="ready", reason="ok") == 2
    assert sample(v, "loraplex_uploads_total", tenant="acme", outcome="replayed", reason="ok") == 1
    assert sample(v, "loraplex_uploads_total", tenant="acme", outcome="deduplicated", reason="ok") == 1
    if code == code2:
        assert sample(v, "loraplex_uploads_total", outcome="rejected", reason=code) == 2
    else:
        assert sample(v, "loraplex_uploads_total", outcome="rejected", reason=code) == 1
        assert sample(v, "loraplex_uploads_total", outcome="rejected", reason=code2) == 1
    recent = metrics.uploads.snapshot()["recent"]
    assert [u["outcome"] for u in recent] == ["rejected", "rejected", "deduplicated", "replayed", "ready", "ready"]
    assert all(u["stage"] == "done" and u["fraction"] == 1.0 for u in recent)
    assert [(u["tenant"], u["adapter"], u["version"]) for u in recent[2:]] == [
        ("acme", "m", 1), ("acme", "m", 2), ("acme", "m", 2), ("acme", "m", 1)]
    assert metrics.uploads.snapshot()["active"] == []


def test_progress_is_visible_while_the_upload_is_handled():
    app = FastAPI()
    metrics = install_metrics(app)
    seen = {}

    @app.post("/v1/adapters")
    async def upload(request: Request):
        body = await request.body()
        seen["during"] = metrics.uploads.snapshot()["active"]
        if len(body) > 1000:
            return JSONResponse({"detail": "too big", "code": "too_large"}, status_code=413)
        raise RuntimeError("boom")

    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/adapters", content=b"x" * 5000)
        assert r.status_code == 413
        [active] = seen["during"]
        assert active["received_bytes"] == 5000 and active["total_bytes"] == 5000
        assert active["stage"] == "validating" and active["fraction"] == 1.0
        assert client.post("/v1/adapters", content=b"x" * 10).status_code == 500
        assert client.get("/v1/other").status_code == 404   # other paths are not counted
    assert metrics.upload_counts == {("rejected", "too_large"): 1, ("failed", "internal_error"): 1}
