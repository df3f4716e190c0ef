"""A 1 GB adapter through a real server process (uvicorn, PostgreSQL, moto's S3): its peak RSS (VmHWM) grows by
less than 100 MB, because every stage streams: multipart intake, header check, NaN scan + sha256, multipart S3."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import httpx
import pytest

from tests.platform.conftest import ADMIN_KEY, TABLES
from tests.utils.adapters import lora_tensors, write_safetensors
from tests.utils.services import free_port, wait_for_port

# A llama-shaped base (config.json only: validation needs the dimensions, not the weights).
BIG_BASE = dict(model_type="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=48, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=14336, max_position_embeddings=4096)
RANK = 64


def vm_hwm_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def multipart_stream(boundary: str, name: str, files: list[tuple[str, str]], chunk: int = 1 << 20):
    yield f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\n{name}\r\n'.encode()
    for filename, path in files:
        yield (f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{filename}"\r\n'
               f"Content-Type: application/octet-stream\r\n\r\n").encode()
        with open(path, "rb") as f:
            while data := f.read(chunk):
                yield data
        yield b"\r\n"
    yield f"--{boundary}--\r\n".encode()


@pytest.mark.slow
def test_1gb_upload_peak_rss(tmp_path, pg_url, moto):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(BIG_BASE))
    h, q, kv, i = 4096, 32 * 128, 8 * 128, 14336
    dims = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}
    weights = str(tmp_path / "adapter_model.safetensors")
    size = write_safetensors(weights, lora_tensors(48, dims, RANK), fill=b"\x00\x00\x80\x3f")  # 1.0f
    assert size > 10**9
    config = tmp_path / "adapter_config.json"
    config.write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 16, "bias": "none",
                                  "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"], "base_model_name_or_path": "big-base"}))
    small = str(tmp_path / "small.safetensors")
    write_safetensors(small, lora_tensors(1, dims, 4))
    small_config = tmp_path / "small_config.json"
    small_config.write_text(config.read_text().replace(f'"r": {RANK}', '"r": 4'))

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    moto.client().create_bucket(Bucket=bucket)
    port = free_port()
    env = dict(os.environ, LORAPLEX_ENVIRONMENT="test", LORAPLEX_ADMIN_KEY=ADMIN_KEY, LORAPLEX_SECRET_KEY="s" * 20,
               LORAPLEX_DATABASE_URL=pg_url, LORAPLEX_BLOB_BACKEND="s3", LORAPLEX_S3_ENDPOINT_URL=moto.endpoint,
               LORAPLEX_S3_BUCKET=bucket, LORAPLEX_S3_ACCESS_KEY_ID="testing", LORAPLEX_S3_SECRET_ACCESS_KEY="testing",
               LORAPLEX_BASE_MODEL_PATH=str(base), LORAPLEX_BASE_MODEL_NAME="big-base",
               LORAPLEX_MAX_UPLOAD_BYTES=str(2 * 1024**3), LORAPLEX_MAX_RANK=str(RANK),
               LORAPLEX_SPOOL_DIR=str(tmp_path), LORAPLEX_S3_PART_SIZE=str(16 * 1024 * 1024))
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "loraplex.platform.main:create_app",
                               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], env=env)
    try:
        wait_for_port(port, timeout=60, proc=server)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=600) as c:
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            tid = c.post("/admin/tenants", json={"name": "big"}, headers=admin).json()["id"]
            key = c.post(f"/admin/tenants/{tid}/keys", json={}, headers=admin).json()["key"]
            auth = {"Authorization": f"Bearer {key}"}

            def upload(name, files):
                boundary = uuid.uuid4().hex
                return c.post("/v1/adapters", content=multipart_stream(boundary, name, files),
                              headers={**auth, "Content-Type": f"multipart/form-data; boundary={boundary}"})

            warm = upload("warm", [("adapter_config.json", str(small_config)), ("adapter_model.safetensors", small)])
            assert warm.status_code == 201, warm.text
            before = vm_hwm_kb(server.pid)
            r = upload("big", [("adapter_config.json", str(config)), ("adapter_model.safetensors", weights)])
            after = vm_hwm_kb(server.pid)
        assert r.status_code == 201, r.text
        assert r.json()["size_bytes"] == size and r.json()["rank"] == RANK
        [obj] = moto.client().list_objects_v2(Bucket=bucket, Prefix=f"adapters/{tid}/big/")["Contents"]
        assert obj["Key"].endswith(f"/{r.json()['sha256']}.safetensors") and obj["Size"] == size
        grown_mb = (after - before) / 1024
        print(f"server VmHWM {before / 1024:.0f} MB -> {after / 1024:.0f} MB (+{grown_mb:.1f} MB) for {size / 1e9:.2f} GB")
        assert grown_mb < 100, f"peak RSS grew by {grown_mb:.0f} MB uploading {size / 1e9:.2f} GB"
    finally:
        server.terminate()
        server.wait(30)
        from loraplex.platform.db.session import make_engine
        from sqlalchemy import text

        engine = make_engine(pg_url)
        with engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {TABLES} CASCADE"))
        engine.dispose()
