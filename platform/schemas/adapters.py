"""Adapters, versions and aliases, as the tenant API sees them."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from loraplex.platform.db.models import AdapterStatus
from loraplex.platform.schemas.types import MAX_INT32, UtcDatetime

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
ALIAS_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"


class AdapterVersionPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True, json_schema_extra={"examples": [{
        "adapter": "support-bot", "number": 3, "status": "ready", "sha256": "9f86d081884c7d65...",
        "size_bytes": 83886080, "rank": 16, "alpha": 32.0, "dtype": "BF16",
        "targets": ["self_attn.q_proj", "self_attn.v_proj", "mlp.experts.gate_up_proj"],
        "base_model": "Qwen/Qwen3-30B-A3B", "error": None,
        "created_at": "2026-11-29T17:00:00Z", "updated_at": "2026-11-29T17:00:02Z"}]})

    adapter: str
    number: int
    status: AdapterStatus
    sha256: str | None
    size_bytes: int | None
    rank: int | None
    alpha: float | None
    dtype: str | None
    targets: list[str]
    base_model: str | None
    error: str | None
    created_at: UtcDatetime
    updated_at: UtcDatetime


class AdapterSummary(BaseModel):
    name: str
    created_at: UtcDatetime
    latest_version: int | None = Field(description="the version the `latest` alias names; null if none is ready")
    aliases: dict[str, int]


class AdaptersPublic(BaseModel):
    data: list[AdapterSummary]
    count: int


class AdapterPublic(BaseModel):
    name: str
    created_at: UtcDatetime
    aliases: dict[str, int] = Field(examples=[{"latest": 3, "prod": 2}])
    versions: list[AdapterVersionPublic]


class AliasUpdate(BaseModel):
    version: int = Field(ge=1, le=MAX_INT32, examples=[2])


class AliasPublic(BaseModel):
    adapter: str
    alias: str
    version: int
