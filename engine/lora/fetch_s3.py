"""S3Fetcher: ``s3://bucket/key.safetensors#config=<base64url JSON>`` → a PEFT folder (boto3, imported lazily).

The platform's blob store keeps only ``adapter_model.safetensors`` (content-addressed, shared by identical
uploads); the adapter's ``adapter_config.json`` lives in the registry and travels inline in the reference's URI
fragment, base64url-encoded (``adapter_config_fragment``). The fetcher downloads the object and writes the config
beside it, so the folder is exactly what PEFT's ``save_pretrained`` writes.

    manager.register_fetcher("s3", S3Fetcher())        # endpoint/credentials: arguments, LORAPLEX_S3_*, or boto3's
                                                       # own chain (AWS_* env vars, instance profile)
"""
from __future__ import annotations

import base64
import json
import os
from urllib.parse import unquote, urlparse

from loraplex.engine.lora.fetch_errors import AdapterFetchError, AdapterFetchUnavailableError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def adapter_config_fragment(config: dict) -> str:
    """The URI fragment carrying ``config`` (append to ``s3://bucket/key``)."""
    raw = json.dumps(config, separators=(",", ":"), sort_keys=True).encode()
    return "config=" + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def config_from_fragment(fragment: str, uri: str) -> dict:
    """Decode the fragment ``adapter_config_fragment`` wrote; raises ``AdapterFetchError`` naming the URI."""
    params = dict(p.split("=", 1) for p in fragment.split("&") if "=" in p)
    data = params.get("config")
    if not data:
        raise AdapterFetchError(f"adapter URI {uri[:120]!r} carries no '#config=' fragment with the adapter's "
                                "adapter_config.json; the platform must send the config inline")
    try:
        config = json.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
    except ValueError as e:
        raise AdapterFetchError(f"the '#config=' fragment of {uri[:120]!r} is not base64url JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterFetchError(f"the '#config=' fragment of {uri[:120]!r} is not a JSON object")
    return config


class S3Fetcher:
    """Fetches ``s3://`` adapter references from S3 or any S3-compatible server (MinIO, moto)."""

    def __init__(self, *, endpoint_url: str | None = None, region: str | None = None,
                 access_key_id: str | None = None, secret_access_key: str | None = None,
                 max_attempts: int = 4) -> None:
        env = os.environ.get
        self.endpoint_url = endpoint_url or env("LORAPLEX_S3_ENDPOINT_URL")
        self.region = region or env("LORAPLEX_S3_REGION") or "us-east-1"
        self.access_key_id = access_key_id or env("LORAPLEX_S3_ACCESS_KEY_ID")
        self.secret_access_key = secret_access_key or env("LORAPLEX_S3_SECRET_ACCESS_KEY")
        self.max_attempts = max_attempts
        self._client = None

    def _s3(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3", endpoint_url=self.endpoint_url, region_name=self.region,
                aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key,
                config=Config(retries={"max_attempts": self.max_attempts, "mode": "standard"}))
        return self._client

    def fetch(self, uri: str, dest_dir: str) -> str:
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc or not parsed.path.strip("/"):
            raise AdapterFetchError(f"S3Fetcher handles s3://bucket/key URIs, got {uri[:120]!r}")
        config = config_from_fragment(parsed.fragment, uri)
        bucket, key = parsed.netloc, unquote(parsed.path.lstrip("/"))
        try:
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError as e:  # pragma: no cover - the GPU image has boto3; say what is missing if not
            raise AdapterFetchError(f"fetching s3:// adapters needs boto3 ({e}); pip install boto3") from None
        try:
            self._s3().download_file(bucket, key, os.path.join(dest_dir, WEIGHTS_FILE))
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code in ("404", "NoSuchKey", "NoSuchBucket", "403", "AccessDenied") or 400 <= status < 500:
                raise AdapterFetchError(f"could not download s3://{bucket}/{key}: {e}") from None
            raise AdapterFetchUnavailableError(f"the blob store failed serving s3://{bucket}/{key}: {e}") from None
        except BotoCoreError as e:  # connection refused, timeouts, ... : transient
            raise AdapterFetchUnavailableError(f"the blob store is unreachable for s3://{bucket}/{key}: {e}") from None
        with open(os.path.join(dest_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f)
        return dest_dir
