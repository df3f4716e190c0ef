"""Tenants, their quotas and API keys, as the admin API sees them."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from loraplex.platform.schemas.types import MAX_INT32, MAX_INT64, Text, UtcDatetime


class Quotas(BaseModel):
    """Per-tenant limits enforced by the gateway, and the tenant's scheduling weight in the engines; null means
    the deployment default. A limit is at least 1: to stop
    a tenant's traffic, disable the tenant (0 would be ambiguous between "nothing" and "unlimited")."""

    requests_per_minute: int | None = Field(default=None, ge=1, le=MAX_INT32, examples=[600])
    tokens_per_minute: int | None = Field(default=None, ge=1, le=MAX_INT32, examples=[200_000])
    max_concurrency: int | None = Field(default=None, ge=1, le=MAX_INT32, examples=[16])
    tokens_per_day: int | None = Field(default=None, ge=1, le=MAX_INT64, examples=[50_000_000])
    scheduling_weight: float | None = Field(
        default=None, gt=0, le=1e6, examples=[2.0],
        description="The tenant's share of a busy engine relative to other tenants' (engines serve backlogged "
                    "tenants tokens in proportion to their weights); null: DEFAULT_SCHEDULING_WEIGHT (1)")

    @field_validator("requests_per_minute", "tokens_per_minute", "max_concurrency", "tokens_per_day", mode="before")
    @classmethod
    def _not_zero(cls, value):
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"a quota is at least 1, got {value}; send null for the deployment default, or disable "
                             "the tenant (POST /admin/tenants/{id}/disable) to stop its traffic")
        return value


class TenantCreate(BaseModel):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", examples=["acme"])
    quotas: Quotas = Field(default_factory=Quotas)


class TenantPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    disabled: bool
    created_at: UtcDatetime
    quotas: Quotas


class TenantsPublic(BaseModel):
    data: list[TenantPublic]
    count: int


class ApiKeyCreate(BaseModel):
    name: Text = Field(default="", max_length=100, examples=["ci"])


class ApiKeyPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    prefix: str
    created_at: UtcDatetime
    last_used_at: UtcDatetime | None
    revoked_at: UtcDatetime | None


class ApiKeyCreated(ApiKeyPublic):
    """Returned once, when the key is issued: ``key`` is never shown again."""

    key: str = Field(examples=["lpx_3f9a1c0b2d_5mX...Q"])


class ApiKeysPublic(BaseModel):
    data: list[ApiKeyPublic]
    count: int
