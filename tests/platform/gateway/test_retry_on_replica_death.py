"""A whole (non-streamed) request whose engine replica dies mid-generation is run again on another replica, unseen
by the client: 200 with the full answer, one usage record of the run that answered, the quota lease released once.
A stream that already sent tokens is not retried (SSE error event, as before); engine refusals (4xx) are never
retried; the retry is bounded to one.

The kill tests run two real ``loraplex engine serve --null`` processes (fixed tokens " tok", DELAY_MS apart) behind
the gateway, quotas in the real Redis (``LORAPLEX_TEST_REDIS``, as the quota tests), and SIGKILL the replica that
holds the request while it generates."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from loraplex.platform.engines.errors import EngineRequestError, EngineUnavailableError
from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import settings_for
from tests.platform.gateway.test_disconnect import wait_until
from tests.utils.services import free_port, wait_for_port

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS", "redis://127.0.0.1:6379/0")
DELAY_MS, MAX_TOKENS = 25, 40        # ~1 s of generation: time to kill the holder while it runs


@pytest.fixture
def redis_prefix():
    """(url, key prefix) in the real Redis; the prefix's keys are deleted afterwards. Missing Redis fails."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as e:
        pytest.fail(f"Redis is required at {REDIS_URL} (start redis-server or set LORAPLEX_TEST_REDIS): {e}")
    prefix = f"loraplex-test:{uuid.uuid4().hex[:12]}"
    yield REDIS_URL, prefix
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def null_fleet():
    """Two ``loraplex engine serve --null`` processes: {url: Popen}; killed after the test."""
    procs: dict[str, subprocess.Popen] = {}
    try:
        for _ in range(2):
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "engine", "serve", "--null",
                                     "--null-delay-ms", str(DELAY_MS), "--port", str(port), "--log-level", "warning"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            procs[f"http://127.0.0.1:{port}"] = proc
            wait_for_port(port, timeout=30, proc=proc)
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def start(serve, tmp_path, tiny_base, adapters, fleet, redis_prefix):
    """The gateway over ``fleet`` with Redis quotas; a tenant with max_concurrency 1 and adapter "bot":
    (server, tenant id, key, lease key)."""
    url, prefix = redis_prefix
    server = serve(settings_for(tmp_path, tiny_base, engine_urls=list(fleet), redis_url=url,
                                quota_key_prefix=prefix))
    tid, key = server.new_tenant({"max_concurrency": 1, "tokens_per_minute": 100_000})
    server.upload(key, "bot", adapters["a"])
    return server, tid, key, f"{prefix}:{{{tid}}}:leases"


def kill_holder(fleet: dict[str, subprocess.Popen]) -> str:
    """SIGKILL the replica that is running a request (its /health reports it in flight); returns its URL."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for url, proc in fleet.items():
            if httpx.get(f"{url}/health", timeout=5).json()["in_flight"]:
                time.sleep(4 * DELAY_MS / 1000)     # a few tokens out: it dies mid-generation
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                return url
        time.sleep(0.01)
    raise AssertionError("no replica ran the request")


def held_adapters(url: str) -> list[str]:
    return httpx.get(f"{url}/v1/adapters", timeout=5).json()["cpu"]


def usage_rows(server, request_id: str):
    from sqlalchemy import select

    from loraplex.platform.db.models import UsageRecord

    with server.gateway.sessions() as session:
        return session.execute(select(UsageRecord).where(UsageRecord.request_id == request_id)).scalars().all()


def test_whole_completion_is_retried_on_another_replica_when_its_replica_is_killed(
        serve, tmp_path, tiny_base, adapters, null_fleet, redis_prefix, caplog):
    import redis

    server, tid, key, leases = start(serve, tmp_path, tiny_base, adapters, null_fleet, redis_prefix)
    assert [held_adapters(u) for u in null_fleet] == [[], []]   # the adapter is cold everywhere
    out: dict = {}

    def ask():
        try:
            out["r"] = server.http.post("/v1/completions", json={"model": "bot", "prompt": "hello there",
                                                                 "max_tokens": MAX_TOKENS},
                                        headers={"Authorization": f"Bearer {key}"})
        except Exception as e:  # noqa: BLE001 - reported below
            out["e"] = e

    with caplog.at_level("WARNING", logger="loraplex.platform.gateway.pipeline"):
        t = threading.Thread(target=ask)
        t.start()
        dead = kill_holder(null_fleet)
        t.join(30)
    r = out["r"]
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == " tok" * MAX_TOKENS and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == MAX_TOKENS and body["id"] == r.headers["x-request-id"]
    died = [m for m in caplog.messages if body["id"] in m and "retrying the whole request" in m]
    assert len(died) == 1 and " 0 engine chunks" not in died[0], caplog.messages   # it died mid-generation
    (survivor,) = set(null_fleet) - {dead}
    assert any("/bot/" in a for a in held_adapters(survivor))         # loaded there as for any cold request
    assert not server.gateway.router.replicas[dead].is_up(time.monotonic())
    assert redis.Redis.from_url(redis_prefix[0]).zcard(leases) == 0   # released (once: no error logged)
    wait_until(lambda: usage_rows(server, body["id"]), what="the usage record")
    time.sleep(0.5)   # two more usage flushes: a second record would show
    rows = usage_rows(server, body["id"])
    assert [(u.prompt_tokens, u.completion_tokens) for u in rows] == [(body["usage"]["prompt_tokens"], MAX_TOKENS)]
    # the lease is free: the tenant's one concurrent request goes through again
    again = server.openai(key).completions.create(model="bot", prompt="hi", max_tokens=2)
    assert again.choices[0].text == " tok" * 2


def test_stream_that_sent_tokens_is_not_retried(serve, tmp_path, tiny_base, adapters, null_fleet, redis_prefix):
    import redis

    server, tid, key, leases = start(serve, tmp_path, tiny_base, adapters, null_fleet, redis_prefix)
    # ~5 s of generation (the tiny model's context is 256): the holder is still running when this client, maybe
    # descheduled on a loaded machine for a while after its second event, looks for it (the kill ends the stream at
    # once, so the test stays short)
    max_tokens = 5 * MAX_TOKENS
    body = {"model": "bot", "prompt": "hello there", "max_tokens": max_tokens, "stream": True}
    events: list[str] = []
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 2:
                        dead = kill_holder(null_fleet)
    assert events[-1] == "data: [DONE]" and '"engine_unavailable"' in events[-2], events[-3:]
    assert sum('" tok"' in e for e in events) < max_tokens       # cut, not completed elsewhere
    (survivor,) = set(null_fleet) - {dead}
    assert held_adapters(survivor) == []                          # never sent there
    wait_until(lambda: redis.Redis.from_url(redis_prefix[0]).zcard(leases) == 0, what="the lease release")


class Scripted(NullEngineClient):
    """An in-process replica that yields ``chunks`` tokens, then raises ``error`` (None: ends normally). Once it
    has raised ``EngineUnavailableError`` it is dead: the gateway's probe (its residency poll) and health checks
    fail too, so the router never puts it back in the rotation, however long the test takes."""

    def __init__(self, chunks: int, error: Exception | None) -> None:
        super().__init__(num_tokens=8)
        self.chunks, self.error, self.calls, self.dead = chunks, error, 0, False

    async def generate(self, request):
        self.calls += 1
        n = 0
        async for chunk in super().generate(request):
            if self.error is not None and n == self.chunks:
                self.dead = isinstance(self.error, EngineUnavailableError)
                raise self.error
            n += 1
            yield chunk

    async def residency(self):
        if self.dead:
            raise EngineUnavailableError("the replica died")
        return await super().residency()

    async def health(self):
        if self.dead:
            raise EngineUnavailableError("the replica died")
        return await super().health()


@pytest.mark.parametrize("chunks", [0, 2])
def test_engine_refusal_is_not_retried(serve, tmp_path, tiny_base, chunks):
    a, b = Scripted(chunks, EngineRequestError("max_tokens is too large")), Scripted(0, None)
    server = serve(settings_for(tmp_path, tiny_base), replicas=[Replica("a", a), Replica("b", b)])
    _, key = server.new_tenant({"max_concurrency": 1})
    body = {"model": server.gateway.model_name, "prompt": [1, 2], "max_tokens": 8}   # base model: "a" is tried first
    r = server.http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    assert (a.calls, b.calls) == (1, 0)


def test_retry_is_bounded_to_one(serve, tmp_path, tiny_base):
    dying = [Scripted(2, EngineUnavailableError("stream cut before its last chunk")) for _ in range(2)]
    healthy = Scripted(0, None)
    server = serve(settings_for(tmp_path, tiny_base), replicas=[Replica("a", dying[0]), Replica("b", dying[1]),
                                                                Replica("c", healthy)])
    _, key = server.new_tenant({"max_concurrency": 1})
    body = {"model": server.gateway.model_name, "prompt": [1, 2], "max_tokens": 8}
    headers = {"Authorization": f"Bearer {key}"}
    r = server.http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
    assert [d.calls for d in dying] + [healthy.calls] == [1, 1, 0]   # a died, b (the retry) died, c untouched
    time.sleep(0.5)  # a few health-probe rounds (residency_poll_s 0.2): dead replicas stay out of the rotation
    r = server.http.post("/v1/completions", json=body, headers=headers)   # a and b are down; the lease was freed
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " tok" * 8, r.text
