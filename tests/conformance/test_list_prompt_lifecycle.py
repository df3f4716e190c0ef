"""A list-prompt completion is one request to quotas and usage: its reservation covers every prompt, a client that
drops the stream aborts every prompt's engine request and gets its lease back, usage records what was generated."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import serve, settings_for  # noqa: F401  (fixture)
from tests.platform.gateway.conftest import tiny_base  # noqa: F401  (fixture)


def wait_until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_dropped_list_stream_aborts_every_prompt_and_frees_the_lease(serve, tmp_path, tiny_base):
    engine = NullEngineClient(num_tokens=8, token_delay_s=0.02)
    server = serve(settings_for(tmp_path, tiny_base), replicas=[Replica("null", engine)])
    _, key = server.new_tenant({"max_concurrency": 1})
    body = {"model": server.gateway.model_name, "prompt": ["one", "two", "three"], "max_tokens": 200, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            seen = set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.add(line.split('"index":')[1].split(",")[0])
                    if len(seen) == 3:     # every prompt is running
                        break
    wait_until(lambda: engine.service.in_flight == 0, what="every prompt's engine request to be aborted")
    r = server.openai(key).completions.create(model=server.gateway.model_name, prompt=["a", "b"], max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 6   # the lease came back
    usage = server.http.get("/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert usage["totals"]["requests"] == 2
    assert 6 + 3 <= usage["totals"]["completion_tokens"] < 6 + 3 * 200   # the dropped stream: only what it got


def test_the_reservation_covers_every_prompt(serve, tmp_path, tiny_base):
    server = serve(settings_for(tmp_path, tiny_base), replicas=[Replica("null", NullEngineClient())])
    _, key = server.new_tenant({"tokens_per_minute": 100})
    client = server.openai(key)
    assert client.completions.create(model=server.gateway.model_name, prompt="a", max_tokens=40).choices
    with pytest.raises(openai.BadRequestError) as e:   # 3 x 40 can never fit a burst of 100
        client.completions.create(model=server.gateway.model_name, prompt=["a", "b", "c"], max_tokens=40)
    assert e.value.code == "request_too_large" and e.value.param == "prompt" and "3 prompts" in e.value.message


class DiesOnce(NullEngineClient):
    """An in-process replica whose first ``dies`` requests are cut after two chunks (the replica "died")."""

    def __init__(self, dies: int) -> None:
        super().__init__(num_tokens=8)
        self.dies, self.calls = dies, 0

    async def generate(self, request):
        from loraplex.platform.engines.errors import EngineUnavailableError

        self.calls += 1
        cut = self.calls <= self.dies
        n = 0
        async for chunk in super().generate(request):
            if cut and n == 2:
                raise EngineUnavailableError("stream cut before its last chunk")
            n += 1
            yield chunk


def test_each_prompt_of_a_whole_request_is_retried_on_its_own(serve, tmp_path, tiny_base):
    dying, healthy = DiesOnce(dies=2), DiesOnce(dies=0)   # whichever prompts go to "a" die there
    server = serve(settings_for(tmp_path, tiny_base), replicas=[Replica("a", dying), Replica("b", healthy)])
    _, key = server.new_tenant({"max_concurrency": 1})
    body = {"model": server.gateway.model_name, "prompt": [[1, 2], [3, 4]], "max_tokens": 8}
    r = server.http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [" tok" * 8] * 2
    assert r.json()["usage"]["completion_tokens"] == 16          # only the runs that answered
    assert dying.calls >= 1 and healthy.calls == 2                # every prompt the dead replica held ran again
