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


class KeyRef(BaseModel):
    """The API key that did something (its id, name and the prefix shown in key lists); null fields when the
    key's row is gone."""

    id: str
    name: str
    prefix: str


class VersionHistoryEntry(BaseModel):
    """One version in an adapter's history: who uploaded (or imported) it and when, what it is, and what became
    of it."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "number": 2, "status": "ready", "sha256": "9f86d081884c7d65...", "size_bytes": 83886080,
        "created_at": "2026-11-29T17:00:00Z", "created_by": {"id": "0f3c...", "name": "ci", "prefix": "3f9a1c0b2d"},
        "source": None, "aliases": ["latest", "prod"], "deleted_at": None, "deleted_by": None, "error": None}]})

    number: int
    status: AdapterStatus
    sha256: str | None
    size_bytes: int | None
    rank: int | None
    created_at: UtcDatetime
    created_by: KeyRef | None = Field(description="the API key that uploaded or imported it (null: unknown)")
    source: str | None = Field(description="the URI it was imported from; null for an upload")
    aliases: list[str] = Field(description="the aliases that name it now")
    deleted_at: UtcDatetime | None
    deleted_by: KeyRef | None
    error: str | None


class AliasHistoryEntry(BaseModel):
    alias: str
    version: int
    updated_at: UtcDatetime
    updated_by: KeyRef | None


class VersionHistory(BaseModel):
    object: str = "list"
    adapter: str
    data: list[VersionHistoryEntry] = Field(description="every version, newest first")
    aliases: list[AliasHistoryEntry] = Field(description="each alias, with when and by which key it last moved")


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
    previous_version: int | None = Field(default=None, description="the version the alias named before (null: "
                                                                   "it is new)")


class RollbackRequest(BaseModel):
    version: int = Field(ge=1, le=MAX_INT32, examples=[2], description="the ready version `latest` (and so the "
                                                                       "bare adapter name) should serve")
