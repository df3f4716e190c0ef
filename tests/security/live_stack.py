"""The whole app on the production backends: PostgreSQL (a fresh database), Redis (a key prefix of its own) for
quotas, moto's S3 server for blobs, the null engine reporting the serving limits of the tiny llama it stands in
for (``LORAPLEX_ENGINE_MAX_LORA_RANK``), served by uvicorn on a loopback port. Shared by the hostile-input, pattern,
limits and generated-request tests of this folder (one stack per test session).

    stack.server.http.post(...)            httpx against the live server
    stack.upload(key, name, files)         the raw response of a multipart upload
    lora_files(base, r=2, **config)        an adapter's two files, built by hand (any rank, any config change)
"""
from __future__ import annotations

import json
import struct
import uuid
from dataclasses import dataclass

import pytest

from tests.platform.gateway.conftest import ADMIN_KEY, LiveServer, settings_for
from tests.utils.services import MotoServer, create_database, drop_database

# Imports may only name a host that never resolves (RFC 6761 ".invalid") and no S3 bucket: generated requests stay
# off the network (an unreachable source is an honest 503, which the generated-request checks count as a failure).
NO_NETWORK_IMPORTS = {"import_allowed_hosts": ["imports.invalid"], "import_s3_buckets": []}

REDIS_URL = "redis://127.0.0.1:6379/0"
ENGINE_MAX_RANK = 8            # what the (null) engine reports: uploads above it are refused
UPLOAD_MAX_RANK = 64           # the settings' own cap, above the engine's: the engine's limit must win
MAX_UPLOAD_BYTES = 512 * 1024


def lora_files(base: str, *, r: int = 2, layers: tuple[int, ...] | None = None, names: list[str] | None = None,
               header: dict | None = None, raw_header: bytes | None = None, config: dict | None = None,
               config_bytes: bytes | None = None, value: float = 0.01) -> dict[str, bytes]:
    """A q_proj LoRA of ``base`` at rank ``r`` (every layer, or ``layers``); ``config`` entries replace the PEFT
    config's, ``header`` entries are added to the safetensors header, ``raw_header`` / ``config_bytes`` replace
    them whole (hostile files)."""
    from loraplex.engine.config import ModelConfig

    m = ModelConfig.from_pretrained(base)
    entries, offset = {}, 0
    for i in (range(m.num_layers) if layers is None else layers):
        for part, shape in (("lora_A", (r, m.hidden_size)), ("lora_B", (m.q_size, r))):
            n = shape[0] * shape[1] * 4
            entries[f"base_model.model.model.layers.{i}.self_attn.q_proj.{part}.weight"] = {
                "dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
    entries.update(header or {})
    raw = raw_header if raw_header is not None else json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0,
           "target_modules": ["q_proj"], "bias": "none", "use_dora": False, "use_rslora": False,
           "modules_to_save": None, "base_model_name_or_path": None, **(config or {})}
    return {"adapter_config.json": config_bytes if config_bytes is not None else json.dumps(cfg).encode(),
            "adapter_model.safetensors": struct.pack("<Q", len(raw)) + raw + struct.pack("<f", value) * (offset // 4)}


@dataclass
class Stack:
    server: LiveServer
    base: str
    bucket: str
    owner_id: str
    owner_key: str
    other_key: str
    adapter: str              # the owner's adapter (version 1, rank 2)
    other_adapter: str        # the other tenant's

    def auth(self, key: str | None = None) -> dict:
        return {"Authorization": f"Bearer {key or self.owner_key}"}

    def upload(self, key: str, name: str, files: dict[str, bytes]):
        return self.server.http.post("/v1/adapters", data={"name": name},
                                     files=[("files", (n, b)) for n, b in files.items()],
                                     headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    import redis

    from loraplex.commands.db import run
    from loraplex.engine.testing.tiny import make_tiny_checkpoint
    from loraplex.platform.main import create_app

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.exceptions.ConnectionError as e:
        pytest.fail(f"these tests need Redis at {REDIS_URL}: {e}")
    tmp = tmp_path_factory.mktemp("stack")
    base = make_tiny_checkpoint("llama", str(tmp / "tiny-llama"))
    url, db_name = create_database()
    run("upgrade", "head", url=url)
    moto = MotoServer()
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    moto.client().create_bucket(Bucket=bucket)
    prefix = f"loraplex-test:{uuid.uuid4().hex[:12]}"
    settings = settings_for(tmp, base, database_url=url, blob_backend="s3", s3_endpoint_url=moto.endpoint,
                            s3_bucket=bucket, s3_access_key_id="testing", s3_secret_access_key="testing",
                            s3_part_size=64 * 1024, s3_max_attempts=2, redis_url=REDIS_URL, quota_key_prefix=prefix,
                            quota_timeout_s=5.0, max_rank=UPLOAD_MAX_RANK, engine_max_lora_rank=ENGINE_MAX_RANK,
                            max_upload_bytes=MAX_UPLOAD_BYTES, max_request_bytes=256 * 1024,
                            **NO_NETWORK_IMPORTS)
    server = LiveServer(create_app(settings))
    try:
        owner_id, owner_key = server.new_tenant()
        _, other_key = server.new_tenant()
        for key, name in ((owner_key, "owned"), (other_key, "theirs")):
            r = server.http.post("/v1/adapters", data={"name": name}, headers={"Authorization": f"Bearer {key}"},
                                 files=[("files", (n, b)) for n, b in lora_files(base).items()])
            assert r.status_code == 201, r.text
        yield Stack(server, base, bucket, owner_id, owner_key, other_key, "owned", "theirs")
    finally:
        server.stop()
        moto.stop()
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
        drop_database(db_name)


def assert_openai_error(r, status: int | tuple[int, ...] | None = None) -> dict:
    """The answer is a 4xx in OpenAI's error shape with an x-request-id; returns its ``error``."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if status is not None:
        assert r.status_code in ((status,) if isinstance(status, int) else status), (r.status_code, r.text[:500])
    assert r.headers.get("x-request-id"), dict(r.headers)
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and len(error["message"]) > 10, error
    assert isinstance(error["type"], str) and error["type"], error
    return error


__all__ = ["ADMIN_KEY", "ENGINE_MAX_RANK", "Stack", "assert_openai_error", "lora_files", "stack"]
