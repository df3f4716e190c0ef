"""End-to-end fixtures: real PostgreSQL, Redis and moto's S3 server, a tiny qwen3_moe checkpoint with a
tokenizer, PEFT adapters of it, two ``loraplex engine serve`` processes with LoRA on, and the platform (uvicorn,
in a thread so tests can read the router) pointed at all of them. Missing services are errors, never skips."""
from __future__ import annotations

import os
import uuid

import pytest

from load_tests.stack import EngineProcess
from tests.platform.gateway.conftest import ADMIN_KEY, LiveServer
from tests.utils.services import MotoServer, create_database, drop_database, free_port

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS", "redis://127.0.0.1:6379/0")
FAMILY = "qwen3_moe"


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> str:
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(FAMILY, str(tmp_path_factory.mktemp("models") / "tiny-moe"))


def make_moe_adapter(base: str, out_dir: str, *, seed: int) -> str:
    """PEFT LoRA with random non-zero weights on attention and the fused experts (``target_parameters``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    get_peft_model(model, cfg).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def moe_adapters(tiny_moe, tmp_path_factory) -> dict[str, str]:
    return {name: make_moe_adapter(tiny_moe, str(tmp_path_factory.mktemp(f"lora-{name}")), seed=seed)
            for name, seed in (("a", 11), ("b", 12))}


@pytest.fixture(scope="session")
def pg():
    url, name = create_database()
    from loraplex.commands.db import run

    run("upgrade", "head", url=url)
    yield url
    drop_database(name)


@pytest.fixture(scope="session")
def redis_url():
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.exceptions.ConnectionError as e:
        pytest.fail(f"the end-to-end tests need Redis at {REDIS_URL} (or LORAPLEX_TEST_REDIS): {e}")
    return REDIS_URL


@pytest.fixture(scope="session")
def s3():
    server = MotoServer()
    yield server
    server.stop()


class Fleet:
    """Two engines and the platform in front of them."""

    def __init__(self, engines: list[EngineProcess], server: LiveServer, key_prefix: str) -> None:
        self.engines, self.server, self.key_prefix = engines, server, key_prefix

    def engine_of(self, replica_id: str) -> EngineProcess:
        return next(e for e in self.engines if e.url == replica_id)


def start_fleet(tmp_path, model: str, pg: str, redis_url: str, s3: MotoServer) -> Fleet:
    from loraplex.platform.core.config import Settings
    from loraplex.platform.main import create_app

    engines = [EngineProcess(model, s3.endpoint, str(tmp_path / f"cache-{i}"), port=free_port(), max_loras=2)
               for i in range(2)]
    for engine in engines:
        engine.start()
    for e in engines:
        e.wait_ready()
    bucket = f"e2e-{uuid.uuid4().hex[:10]}"
    s3.client().create_bucket(Bucket=bucket)
    prefix = f"loraplex-e2e:{uuid.uuid4().hex[:10]}"
    settings = Settings(environment="test", admin_key=ADMIN_KEY, secret_key="e2e-secret-key-0123456789",
                        data_dir=str(tmp_path / "data"), database_url=pg, redis_url=redis_url,
                        quota_key_prefix=prefix, quota_timeout_s=3.0, blob_backend="s3",
                        s3_endpoint_url=s3.endpoint, s3_bucket=bucket, s3_access_key_id="testing",
                        s3_secret_access_key="testing", s3_part_size=64 * 1024, base_model_path=model,
                        engine_urls=[e.url for e in engines], residency_poll_s=0.5, max_rank=16)
    return Fleet(engines, LiveServer(create_app(settings)), prefix)


def stop_fleet(fleet: Fleet, redis_url: str) -> None:
    import redis

    fleet.server.stop()
    for e in fleet.engines:
        e.stop()
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{fleet.key_prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_moe, pg, redis_url, s3):
    f = start_fleet(tmp_path_factory.mktemp("fleet"), tiny_moe, pg, redis_url, s3)
    yield f
    stop_fleet(f, redis_url)
