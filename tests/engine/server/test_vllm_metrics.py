"""The engine's ``/metrics`` under the vLLM names the Gateway API Inference Extension's endpoint picker reads
(``LORAPLEX_ENGINE_VLLM_METRICS=1``), on a real tiny engine after a request with an adapter; absent by default."""
from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.server.metrics import render_metrics
from loraplex.engine.stats import empty_stats
from loraplex.platform.engines.http_client import HttpEngineClient
from loraplex.platform.engines.messages import EngineRequest
from tests.engine.server.test_engine_http import GREEDY, PROMPT, _ref, _wait_idle


def _samples(text: str) -> dict:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_inference_extension_names_on_a_lora_engine(engine_server, llama_adapter, monkeypatch):
    service, server = engine_server
    ref = _ref(llama_adapter, "tenant-v/epp-bot/1")

    async def run():
        http = HttpEngineClient(server.url)
        try:
            return [c async for c in http.generate(EngineRequest("r-epp", "tenant-v", PROMPT, GREEDY, ref))]
        finally:
            await http.close()

    assert asyncio.run(run())[-1].finished
    assert _wait_idle(service) == 0
    plain = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "vllm:" not in plain
    monkeypatch.setenv("LORAPLEX_ENGINE_VLLM_METRICS", "1")
    before = time.time()
    v = _samples(httpx.get(f"{server.url}/metrics", timeout=10).text)
    model = {("model_name", "tiny-llama")}
    assert v[("vllm:num_requests_waiting", frozenset(model))] == 0
    assert v[("vllm:num_requests_running", frozenset(model))] == 0
    assert v[("vllm:kv_cache_usage_perc", frozenset(model))] == v[("vllm:gpu_cache_usage_perc", frozenset(model))] == 0
    (labels, stamp), = [(dict(k[1]), val) for k, val in v.items() if k[0] == "vllm:lora_requests_info"]
    assert labels["max_lora"] == "2" and ref.adapter_id in labels["running_lora_adapters"].split(",")
    assert labels["waiting_lora_adapters"] == "" and stamp >= before - 1


def test_inference_extension_names_follow_the_stats():
    stats = {**empty_stats(), "queue_length": 5, "requests_running": 3, "kv_usage": 0.25, "lora_enabled": True,
             "adapters": {"gpu": ["t/a/1", "t/b/2"], "loading": ["t/c/3"], "max_loras": 4}}
    v = _samples(render_metrics(stats, model="m", vllm_names=True).decode())
    assert v[("vllm:num_requests_waiting", frozenset({("model_name", "m")}))] == 5
    assert v[("vllm:num_requests_running", frozenset({("model_name", "m")}))] == 3
    assert v[("vllm:kv_cache_usage_perc", frozenset({("model_name", "m")}))] == 0.25
    info = {k[1]: val for k, val in v.items() if k[0] == "vllm:lora_requests_info"}
    assert frozenset({("max_lora", "4"), ("running_lora_adapters", "t/a/1,t/b/2"),
                      ("waiting_lora_adapters", "t/c/3")}) in info
    assert "vllm:lora_requests_info" not in render_metrics({**stats, "lora_enabled": False}, model="m",
                                                           vllm_names=True).decode()
