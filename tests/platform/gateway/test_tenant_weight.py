"""A tenant's scheduling weight (its quota record's ``scheduling_weight``, else DEFAULT_SCHEDULING_WEIGHT) is sent
to the engine with every request as ``tenant_weight``, beside the tenant id; a change through the admin API
applies to the next request."""
from __future__ import annotations

from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import settings_for


class Recording(NullEngineClient):
    """The null engine, keeping every EngineRequest it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        async for chunk in super().generate(request):
            yield chunk


def test_scheduling_weight_reaches_the_engine(serve, tmp_path):
    engine = Recording()
    server = serve(settings_for(tmp_path, None, default_scheduling_weight=1.5), replicas=[Replica("one", engine)])
    heavy, heavy_key = server.new_tenant({"scheduling_weight": 4.0})
    plain, plain_key = server.new_tenant()
    for key in (heavy_key, plain_key):
        server.openai(key).completions.create(model="null", prompt=[1, 2], max_tokens=2)
    sent = {(r.tenant_id, r.tenant_weight) for r in engine.requests}
    assert sent == {(heavy, 4.0), (plain, 1.5)}  # its own weight; the deployment default when null
    assert all(r.to_wire()["tenant_weight"] == r.tenant_weight for r in engine.requests)
    r = server.http.put(f"/admin/tenants/{plain}/quotas", json={"scheduling_weight": 0.5}, headers=server.admin())
    assert r.status_code == 200, r.text
    server.openai(plain_key).chat.completions.create(model="null", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2)
    assert (engine.requests[-1].tenant_id, engine.requests[-1].tenant_weight) == (plain, 0.5)
