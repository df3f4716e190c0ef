"""One source of truth for serving limits: the engines report them (``GET /health`` ``"limits"``), uploads are
validated against the deployment's (the engines' limit wins over a looser upload setting), ``/v1/models`` marks
versions that no engine can serve once the limits change, and inference refuses them with a clear 400."""
from __future__ import annotations

import pytest

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.format import ATTENTION_TARGETS, EXPERT_TARGETS, serving_targets
from loraplex.engine.server.protocol import limits_dict
from loraplex.platform.engines.limits import EngineLimits, deployment_limits, unservable_reason
from loraplex.platform.engines.messages import EngineHealth
from tests.security.live_stack import ENGINE_MAX_RANK, UPLOAD_MAX_RANK, assert_openai_error, lora_files


def test_engine_limits_travel_and_combine(stack):
    model = ModelConfig.from_pretrained(stack.base)
    wire = limits_dict(model, lora=True, max_lora_rank=16, max_loras=4, max_model_len=256, quantization=None)
    health = EngineHealth.from_wire({"ready": True, "limits": wire})
    assert health.limits.max_lora_rank == 16 and health.limits.targets == serving_targets(model)
    assert not set(EXPERT_TARGETS) & set(health.limits.targets)          # a dense llama has no experts
    narrow = EngineLimits(lora=True, max_lora_rank=8, targets=ATTENTION_TARGETS, dtypes=("BF16", "F32"),
                          max_adapter_bytes=10**6, max_model_len=128)
    both = deployment_limits([health.limits, narrow, None])
    assert both.max_lora_rank == 8 and both.targets == ATTENTION_TARGETS and both.dtypes == ("F32", "BF16")
    assert both.max_model_len == 128 and both.max_adapter_bytes == 10**6
    assert unservable_reason(both, rank=8, targets=["self_attn.q_proj"], dtype="F32") is None
    assert "rank 16" in unservable_reason(both, rank=16, targets=["self_attn.q_proj"])
    assert "mlp.down_proj" in unservable_reason(both, rank=2, targets=["mlp.down_proj"])
    assert "F16" in unservable_reason(both, rank=2, dtype="F16")
    assert deployment_limits([None, None]) is None and EngineHealth.from_wire({"ready": True}).limits is None


def test_the_engines_rank_limit_wins_over_the_upload_setting(stack):
    assert stack.server.gateway.serving_limits.max_lora_rank == ENGINE_MAX_RANK < UPLOAD_MAX_RANK
    r = stack.upload(stack.owner_key, "too-wide", lora_files(stack.base, r=ENGINE_MAX_RANK * 2))
    error = assert_openai_error(r, 422)
    assert error["code"] == "rank_too_high" and f"limit of {ENGINE_MAX_RANK}" in error["message"]
    r = stack.upload(stack.owner_key, "just-fits", lora_files(stack.base, r=ENGINE_MAX_RANK))
    assert r.status_code == 201, r.text


def test_a_change_of_limits_shows_in_models_and_inference(stack):
    assert stack.upload(stack.owner_key, "rank-four", lora_files(stack.base, r=4)).status_code == 201
    http = stack.server.http

    def cards() -> dict[str, dict]:
        r = http.get("/v1/models", headers=stack.auth())
        assert r.status_code == 200, r.text
        return {c["id"]: c for c in r.json()["data"]}

    assert cards()["rank-four"]["servable"] is True and "unservable_reason" not in cards()["rank-four"]
    request = {"model": "rank-four", "prompt": "hi", "max_tokens": 1}
    assert http.post("/v1/completions", json=request, headers=stack.auth()).status_code == 200
    with _lowered(stack):
        now = cards()
        for name in ("rank-four", "rank-four:1", "rank-four:latest"):
            assert now[name]["servable"] is False and "rank 4 exceeds the engines' limit of 2" in \
                now[name]["unservable_reason"], now[name]
        assert now[stack.adapter]["servable"] is True                # rank 2 still fits
        card = http.get("/v1/models/rank-four:1", headers=stack.auth()).json()
        assert card["servable"] is False
        r = http.post("/v1/completions", json=request, headers=stack.auth())
        error = assert_openai_error(r, 400)
        assert error["code"] == "adapter_not_servable" and error["param"] == "model"
        r = stack.upload(stack.owner_key, "rank-four", lora_files(stack.base, r=4))
        assert assert_openai_error(r, 422)["code"] == "rank_too_high"
    assert cards()["rank-four"]["servable"] is True


class _lowered:
    """The engine restarted with max_lora_rank 2 (its health now says so), then back to what it was."""

    def __init__(self, stack) -> None:
        self.stack = stack

    def __enter__(self):
        server = self.stack.server
        self.service = next(iter(server.gateway.router.replicas.values())).client.service
        self.before = dict(self.service.limits)
        self.service.limits = {**self.before, "max_lora_rank": 2}
        server.call(server.gateway.limits_watcher.refresh())

    def __exit__(self, *exc):
        self.service.limits = self.before
        self.stack.server.call(self.stack.server.gateway.limits_watcher.refresh())


def test_openai_client_retrieves_models(stack):
    import openai

    client = stack.server.openai(stack.owner_key)
    assert client.models.retrieve(stack.adapter).id == stack.adapter
    assert client.models.retrieve(f"{stack.adapter}:1").id == f"{stack.adapter}:1"
    base = stack.server.gateway.model_name
    assert client.models.retrieve(base).owned_by == "loraplex"
    for missing in ("nope", stack.other_adapter, f"{stack.adapter}:99"):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(missing)
        assert e.value.code == "model_not_found" and e.value.response.headers.get("x-request-id")
