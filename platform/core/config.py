"""The control plane's settings: one pydantic-settings ``Settings``, read from ``LORAPLEX_*`` env vars (or a
``.env`` file). Defaults are the embedded deployment: a SQLite file and a local blob folder under ``data_dir``.

    LORAPLEX_DATABASE_URL=postgresql+psycopg://user@db/loraplex
    LORAPLEX_BLOB_BACKEND=s3  LORAPLEX_S3_BUCKET=adapters  LORAPLEX_S3_ENDPOINT_URL=http://minio:9000
"""
from __future__ import annotations

import os
import tempfile
from functools import lru_cache
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_SECRET = "changethis"


class Settings(BaseSettings):
    """Every knob of the control plane. Outside ``environment="development"`` the default secrets are refused."""

    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", env_file=".env", extra="ignore")

    environment: Literal["development", "test", "production"] = "development"
    data_dir: str = "./loraplex-data"

    # registry
    database_url: str | None = None  # default: sqlite:///<data_dir>/loraplex.db
    database_echo: bool = False

    # blobs
    blob_backend: Literal["local", "s3"] = "local"
    blob_dir: str | None = None  # default: <data_dir>/blobs
    s3_endpoint_url: str | None = None
    s3_bucket: str = "loraplex-adapters"
    s3_region: str = "us-east-1"
    s3_access_key_id: str | None = None
    s3_secret_access_key: SecretStr | None = None
    s3_part_size: int = Field(default=16 * 1024 * 1024, ge=1024)  # AWS S3 needs >= 5 MiB (all parts but the last)
    s3_max_attempts: int = Field(default=4, ge=1)
    s3_connect_timeout_s: float = 5.0
    s3_read_timeout_s: float = 60.0

    # quotas (enforced by the gateway through Redis; None = in-process store)
    redis_url: str | None = None
    default_requests_per_minute: int | None = Field(default=None, ge=1)   # null: unlimited
    default_tokens_per_minute: int | None = Field(default=None, ge=1)
    default_max_concurrency: int | None = Field(default=None, ge=1)
    default_tokens_per_day: int | None = Field(default=None, ge=1)
    default_scheduling_weight: float = Field(default=1.0, gt=0, le=1e6)  # tenants whose scheduling_weight is null

    # a request without max_tokens reserves min(this, the context left) per choice against tokens/minute (and the
    # day's budget) instead of the whole context; tokens it uses past that are charged when it ends
    default_max_tokens_reservation: int = Field(default=512, ge=1)

    quota_fail_open: bool = False  # Redis unreachable: admit without checks (True) or answer 503 (False)
    quota_timeout_s: float = Field(default=0.5, gt=0)
    quota_key_prefix: str = "loraplex:quota"  # Redis keys: <prefix>:{<tenant id>}:rpm|tpm|leases|day
    # concurrency leases: a release that failed (Redis stalled or down) is retried in the background; every
    # QUOTA_LEASE_REAP_S each process releases its own leases whose request is gone and those of processes that
    # stopped refreshing their heartbeat key (it expires after QUOTA_INSTANCE_TTL_S)
    quota_lease_reap_s: float = Field(default=10.0, gt=0)
    quota_instance_ttl_s: float = Field(default=30.0, gt=0)

    # gateway: engine replicas (ENGINE_URLS: separate `loraplex engine serve` processes; else ENGINE_MODE)
    engine_urls: list[str] = []
    engine_mode: Literal["embedded", "null", "none"] = "embedded"  # embedded: in-process engine on BASE_MODEL_PATH
    engine_device: str = "auto"
    engine_dtype: str = "auto"
    engine_max_loras: int | None = Field(default=None, ge=1)   # null: no cap, the adapter memory budget decides
    engine_max_lora_rank: int = Field(default=16, ge=1)
    engine_max_num_seqs: int | None = Field(default=None, ge=1)  # null: the engine's default (256 CUDA, 64 CPU)
    engine_null_tokens: int = Field(default=8, ge=1)
    # the embedded engine's speculative decoding (None: off); combinations are checked by gateway/speculation.py
    engine_speculative_method: Literal["ngram", "draft", "eagle", "eagle3"] | None = None
    engine_num_speculative_tokens: int = Field(default=3, ge=1, le=16)   # k: drafts per sequence per step
    engine_speculative_draft_model: str | None = None   # draft: folder of a small LM sharing the tokenizer
    engine_speculative_draft_head: str | None = None    # eagle / eagle3: folder of the draft head
    max_model_len: int | None = None  # default: the base model's max_position_embeddings, capped at 8192
    residency_poll_s: float = Field(default=2.0, gt=0)  # how often replicas' resident adapters are polled
    engine_limits_poll_s: float = Field(default=30.0, gt=0)  # how often engines' serving limits are re-read
    max_request_bytes: int = Field(default=4 * 1024 * 1024, gt=0)  # inference request body cap (413 above)
    # seconds an idle HTTP keep-alive connection stays open; above the load balancer's / client pool's idle timeout
    keep_alive_s: float = Field(default=75.0, gt=0, le=3600)
    auth_cache_s: float = Field(default=1.0, ge=0)  # API key / adapter lookups are cached this long (0: off)
    adapter_dir: str | None = None  # local blob store: PEFT folders materialised for engines (<DATA_DIR>/peft)

    # usage metering (buffered SQL writer)
    usage_flush_rows: int = Field(default=500, ge=1)
    usage_flush_s: float = Field(default=1.0, gt=0)

    # secrets
    admin_key: SecretStr = SecretStr(DEFAULT_SECRET)
    secret_key: SecretStr = SecretStr(DEFAULT_SECRET)  # HMAC key for tenant API key hashes

    # the base model served (a Hugging Face folder with config.json) and the name adapters must name
    base_model_path: str | None = None
    base_model_name: str | None = None  # default: the folder's name
    base_model_aliases: list[str] = []

    # upload limits
    max_upload_bytes: int = Field(default=2 * 1024**3, gt=0)
    max_rank: int = Field(default=64, gt=0)
    max_header_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    max_archive_members: int = Field(default=64, gt=0)
    upload_validation_threads: int = Field(default=2, ge=1)  # uploads validated at once (CPU-bound, in threads)
    spool_dir: str | None = None  # where uploads are streamed before validation; default <system temp>/loraplex-spool
    spool_lease_s: float = Field(default=60.0, gt=0)  # spool folders of other hosts' processes: gone when untouched

    # imports by reference (POST /v1/adapters/import; uploads/sources.py): where the platform may fetch from
    # (OWASP API7, SSRF). Hosts: "host", "host:port" or "*.domain"; "http://host[:port]" also allows plain HTTP to it.
    # Every redirect hop must match too, and resolve to public addresses only, unless IMPORT_PRIVATE_HOSTS names it
    import_allowed_hosts: list[str] = ["huggingface.co", "*.huggingface.co", "*.hf.co"]
    import_private_hosts: list[str] = []          # hosts that may resolve to private/loopback addresses (mirrors)
    import_s3_buckets: list[str] = ["*"]          # buckets tenants may import from with their own credentials
    import_s3_endpoints: list[str] = []           # S3-compatible endpoints tenants may name (default: AWS only)
    import_s3_operator_buckets: list[str] = []    # buckets the operator's credentials may be used for
    import_s3_profile: str | None = None          # the operator's AWS profile (None: boto3's chain, e.g. a role)
    import_ca_bundle: str | None = None           # CA certificates for HTTPS sources (default: the system's)
    import_wait_s: float = Field(default=10.0, ge=0)      # the POST answers the result if done by then, else 202
    import_timeout_s: float = Field(default=900.0, gt=0)  # a whole import (both files) ends by then
    import_connect_timeout_s: float = Field(default=5.0, gt=0)
    import_read_timeout_s: float = Field(default=30.0, gt=0)   # between two reads of a source
    import_max_redirects: int = Field(default=5, ge=0)

    # janitor (uploads/janitor.py): expires `uploading` versions whose uploader stopped heartbeating for
    # UPLOAD_STALE_AFTER_S, removes their blobs and incomplete multipart uploads, orphan blobs and spool leftovers.
    # Runs in each platform process every JANITOR_INTERVAL_S (0: off, e.g. with the chart's CronJob instead).
    janitor_interval_s: float = Field(default=300.0, ge=0)
    upload_stale_after_s: float = Field(default=900.0, gt=0)

    # metrics: GET /metrics on the API port needs the admin key or METRICS_TOKEN as a bearer token; with
    # METRICS_PORT the same scrape is also served without auth on METRICS_HOST:METRICS_PORT (keep it pod-internal)
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    metrics_host: str = "127.0.0.1"
    metrics_token: SecretStr | None = None

    # admin dashboard sign-ins (server-side sessions in the registry; sign-out revokes)
    dashboard_session_s: int = Field(default=12 * 3600, gt=0)

    @field_validator("engine_speculative_method", mode="before")
    @classmethod
    def _speculative_method(cls, value):
        if isinstance(value, str):
            value = value.strip().lower()
            if value in ("", "none", "off"):
                return None
            if value == "replay":
                raise ValueError("'replay' is for benchmarks only (`loraplex bench`); choose ngram, draft, eagle or "
                                 "eagle3, or none")
        return value

    @model_validator(mode="after")
    def _refuse_default_secrets(self) -> "Settings":
        if self.environment != "development":
            for name in ("admin_key", "secret_key"):
                if getattr(self, name).get_secret_value() == DEFAULT_SECRET:
                    raise ValueError(f"LORAPLEX_{name.upper()} is the default {DEFAULT_SECRET!r}; set a secret "
                                     f"value for environment={self.environment!r}")
        if self.blob_backend == "s3" and not self.s3_bucket:
            raise ValueError("LORAPLEX_S3_BUCKET is required when LORAPLEX_BLOB_BACKEND=s3")
        return self

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{os.path.abspath(os.path.join(self.data_dir, 'loraplex.db'))}"

    @property
    def blob_path(self) -> str:
        return os.path.abspath(self.blob_dir or os.path.join(self.data_dir, "blobs"))

    @property
    def spool_path(self) -> str:
        return os.path.abspath(self.spool_dir or os.path.join(tempfile.gettempdir(), "loraplex-spool"))

    @property
    def upload_heartbeat_s(self) -> float:
        """How often an upload in progress refreshes its row's ``updated_at`` (well inside the stale threshold)."""
        return min(30.0, self.upload_stale_after_s / 6)

    @property
    def adapter_path(self) -> str:
        return os.path.abspath(self.adapter_dir or os.path.join(self.data_dir, "peft"))

    @property
    def served_model_name(self) -> str | None:
        if self.base_model_name:
            return self.base_model_name
        return os.path.basename(os.path.normpath(self.base_model_path)) if self.base_model_path else None


@lru_cache
def get_settings() -> Settings:
    """The process's settings, read once from the environment."""
    return Settings()
