"""API shapes of usage: ``GET /v1/usage`` (one tenant) and ``GET /admin/usage`` (every tenant)."""
from __future__ import annotations

from datetime import date

from pydantic import BaseModel


class UsageRow(BaseModel):
    day: date
    adapter: str | None  # None: the base model
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TenantUsageRow(UsageRow):
    tenant_id: str
    tenant: str


class UsageTotals(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, rows: list[dict]) -> "UsageTotals":
        return cls(**{k: sum(r[k] for r in rows) for k in ("requests", "prompt_tokens", "completion_tokens",
                                                          "total_tokens")})


class UsagePublic(BaseModel):
    object: str = "usage"
    data: list[UsageRow]
    totals: UsageTotals


class AdminUsagePublic(BaseModel):
    object: str = "usage"
    data: list[TenantUsageRow]
    totals: UsageTotals
