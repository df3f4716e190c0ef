"""Gateway ↔ engine replicas: residency polled into the router (affinity), deleted versions evicted from every
replica, failover when a replica is unreachable."""
from __future__ import annotations

import time

from loraplex.platform.engines.errors import EngineUnavailableError
from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import settings_for


class Dead(NullEngineClient):
    """A replica whose process is gone: every call is a connection error."""

    async def generate(self, request):
        raise EngineUnavailableError("connection refused")
        yield  # pragma: no cover

    async def residency(self):
        raise EngineUnavailableError("connection refused")


def test_residency_affinity_eviction_and_failover(serve, tmp_path, tiny_base, adapters):
    one, two = NullEngineClient(), NullEngineClient()
    server = serve(settings_for(tmp_path, tiny_base),
                   replicas=[Replica("one", one), Replica("two", two), Replica("dead", Dead())])
    tid, key = server.new_tenant()
    server.upload(key, "bot", adapters["a"])
    client = server.openai(key)
    for _ in range(6):
        assert client.completions.create(model="bot", prompt=[1], max_tokens=1).choices[0].text == " tok"
    held = [name for name, c in (("one", one), ("two", two)) if c.service.residency()["cpu"]]
    assert len(held) == 1  # every request for the adapter went to one replica (affinity); none failed
    adapter_id = one.service.residency()["cpu"] or two.service.residency()["cpu"]
    router = server.gateway.router
    deadline = time.monotonic() + 3
    while set(adapter_id) - router.replicas[held[0]].resident and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(adapter_id) <= router.replicas[held[0]].resident  # polled residency reached the router
    assert not router.replicas["dead"].is_up(time.monotonic())   # the poller marked the dead replica down
    r = server.http.delete("/v1/adapters/bot", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 204, r.text
    assert one.service.residency()["cpu"] == [] and two.service.residency()["cpu"] == []
    assert (held[0], adapter_id[0]) in server.gateway.notifier.evicted


class Flaky(NullEngineClient):
    """A replica whose generate and residency each fail while their flag is set; counts generate calls. With
    ``crash`` set, a failing generate takes residency down with it (the process died under the request), so no
    residency poll can see the replica down before a request has."""

    def __init__(self) -> None:
        super().__init__()
        self.generate_down = self.residency_down = self.crash = False
        self.generates = 0

    async def generate(self, request):
        self.generates += 1
        if self.generate_down:
            self.residency_down = self.residency_down or self.crash
            raise EngineUnavailableError("connection refused")
        async for chunk in super().generate(request):
            yield chunk

    async def residency(self):
        if self.residency_down:
            raise EngineUnavailableError("connection refused")
        return await super().residency()


def test_replica_marked_down_by_a_request_waits_for_a_residency_poll(serve, tmp_path, tiny_base):
    flaky, steady = Flaky(), NullEngineClient()
    server = serve(settings_for(tmp_path, tiny_base), replicas=[Replica("a", flaky), Replica("b", steady)])
    _, key = server.new_tenant()
    client = server.openai(key)
    router = server.gateway.router
    router.config.cooldown_s = 0.001     # a cool-down would let the next request retry it at once

    def ask():
        return client.completions.create(model="tiny-llama", prompt=[1], max_tokens=1).choices[0].text

    assert ask() == " tok" and flaky.generates == 1           # base model: the least-loaded, "a" first
    flaky.generate_down = flaky.crash = True                  # the next request to "a" finds it gone
    assert ask() == " tok" and flaky.generates == 2           # failed over to "b"; "a" is down
    assert flaky.residency_down
    flaky.generate_down = False                               # it would answer now, but no poll has said so
    polls = server.gateway.poller.polls
    for _ in range(5):
        assert ask() == " tok"
    deadline = time.monotonic() + 10
    while server.gateway.poller.polls < polls + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.gateway.poller.polls >= polls + 2
    assert ask() == " tok" and flaky.generates == 2           # still out of the rotation: polls keep failing
    assert not router.replicas["a"].is_up(time.monotonic())
    flaky.residency_down = False
    deadline = time.monotonic() + 10
    while not router.replicas["a"].is_up(time.monotonic()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert router.replicas["a"].is_up(time.monotonic())       # a poll succeeded: back in the rotation
    assert ask() == " tok" and flaky.generates == 3


def test_engine_that_cannot_load_leaves_the_control_plane_up(serve, tmp_path):
    from tests.utils.tiny_models import tiny_config

    base = tmp_path / "weightless"
    tiny_config("llama").save_pretrained(base)  # config.json only: the embedded engine cannot load it
    server = serve(settings_for(tmp_path, str(base), engine_mode="embedded"))
    _, key = server.new_tenant()
    r = server.http.post("/v1/completions", json={"model": "weightless", "prompt": "hi", "max_tokens": 1},
                         headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    message = r.json()["error"]["message"]      # the cause (no model.safetensors in <path>) is in the log only
    assert "the operator must fix the engine settings" in message and r.headers["x-request-id"] in message
    assert "safetensors" not in message and str(base) not in message
    assert server.http.get("/v1/adapters", headers={"Authorization": f"Bearer {key}"}).status_code == 200


class CannotLoad(NullEngineClient):
    """A replica whose adapter fetch fails (e.g. the blob is gone); ``delete_first`` marks the version deleted in
    the registry just before failing, as a DELETE racing the request would."""

    def __init__(self, sessions=None) -> None:
        super().__init__()
        self.sessions = sessions

    async def generate(self, request):
        from sqlalchemy import update

        from loraplex.platform.db.models import AdapterStatus, AdapterVersion
        from loraplex.platform.engines.errors import AdapterLoadFailedError

        if request.adapter is not None:
            if self.sessions is not None:
                version_id = request.adapter.adapter_id.rsplit("/", 1)[-1]
                with self.sessions() as session:
                    session.execute(update(AdapterVersion).where(AdapterVersion.id == version_id)
                                    .values(status=AdapterStatus.deleted))
                    session.commit()
            raise AdapterLoadFailedError("could not download s3://bucket/key: NoSuchKey")
        async for chunk in super().generate(request):
            yield chunk


def test_adapter_deleted_while_its_request_was_in_flight_is_a_404_not_a_load_error(serve, tmp_path, tiny_base,
                                                                                   adapters):
    failing = CannotLoad()
    server = serve(settings_for(tmp_path, tiny_base), replicas=[Replica("one", failing)])
    _, key = server.new_tenant()
    server.upload(key, "bot", adapters["a"])
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "bot", "prompt": "hi", "max_tokens": 1}
    r = server.http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 422 and r.json()["error"]["code"] == "adapter_load_error"   # version still exists
    failing.sessions = server.gateway.sessions
    r = server.http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
