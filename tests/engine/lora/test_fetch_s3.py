"""S3Fetcher against moto's S3 server: the PEFT folder it writes (weights + inline config), and its errors."""
from __future__ import annotations

import json
import os

import pytest

from loraplex.engine.lora.fetch import AdapterFetchError
from loraplex.engine.lora.fetch_s3 import S3Fetcher, adapter_config_fragment, config_from_fragment
from tests.utils.services import MotoServer


@pytest.fixture(scope="module")
def moto():
    server = MotoServer()
    yield server
    server.stop()


def test_fetch_writes_weights_and_inline_config(moto, tmp_path):
    s3 = moto.client()
    s3.create_bucket(Bucket="adapters")
    s3.put_object(Bucket="adapters", Key="adapters/t/a/abc.safetensors", Body=b"weights-bytes")
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
    fetcher = S3Fetcher(endpoint_url=moto.endpoint, access_key_id="testing", secret_access_key="testing")
    uri = "s3://adapters/adapters/t/a/abc.safetensors#" + adapter_config_fragment(config)
    folder = fetcher.fetch(uri, str(tmp_path))
    assert open(os.path.join(folder, "adapter_model.safetensors"), "rb").read() == b"weights-bytes"
    assert json.load(open(os.path.join(folder, "adapter_config.json"))) == config

    with pytest.raises(AdapterFetchError, match="could not download s3://adapters/adapters/t/a/missing"):
        fetcher.fetch("s3://adapters/adapters/t/a/missing.safetensors#" + adapter_config_fragment(config),
                      str(tmp_path / "x"))
    with pytest.raises(AdapterFetchError, match="carries no '#config=' fragment"):
        fetcher.fetch("s3://adapters/adapters/t/a/abc.safetensors", str(tmp_path))
    with pytest.raises(AdapterFetchError, match="handles s3://bucket/key"):
        fetcher.fetch("file:///tmp/x", str(tmp_path))


def test_fragment_round_trip_and_garbage():
    config = {"r": 8, "alpha_pattern": {"layers.0": 4}, "base_model_name_or_path": "Qwen/Qwen3-8B"}
    assert config_from_fragment(adapter_config_fragment(config), "s3://b/k") == config
    with pytest.raises(AdapterFetchError, match="not base64url JSON"):
        config_from_fragment("config=%%%notbase64", "s3://b/k")
