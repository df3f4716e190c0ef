"""ORM models of the registry (Pydantic schemas for the API live apart, in ``schemas/``).

    tenants ─┬─< api_keys
             ├─< adapters ─┬─< adapter_versions ──> api_keys (who uploaded / deleted it; set null)
             │             └─< adapter_aliases ──> adapter_versions, api_keys (who moved it; set null)
             ├─< adapter_imports ──> adapter_versions (the version an import made; set null)
             └─< usage_records ──> adapter_versions (set null when the version row goes)
    dashboard_sessions (admin dashboard sign-ins and used one-time login links; no foreign keys)
"""
from __future__ import annotations

import enum
from datetime import date, datetime
from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, Date, DateTime, Enum, Float, ForeignKey, Index, Integer, String,
                        Text, UniqueConstraint)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from loraplex.platform.db.base import Base, new_id, utcnow


class AdapterStatus(str, enum.Enum):
    """Lifecycle of an adapter version. Uploads validate before a row exists, so a row starts at ``uploading``
    (blob being written); ``validating`` is for versions whose checks run after the row is written (imports).
    An ``uploading`` row whose ``updated_at`` (the uploader's heartbeat) is older than
    ``UPLOAD_STALE_AFTER_S`` is expired to ``failed`` by the janitor (``uploads/janitor.py``)."""

    uploading = "uploading"
    validating = "validating"
    ready = "ready"
    failed = "failed"
    deleted = "deleted"


def _ts(**kw) -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), default=utcnow, **kw)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = _ts()
    # quotas (None = the deployment default); enforced by the gateway
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_concurrency: Mapped[int | None] = mapped_column(Integer)
    tokens_per_day: Mapped[int | None] = mapped_column(BigInteger)
    # the engine's tenant-fair scheduling: share of a contended engine relative to other tenants (None = default)
    scheduling_weight: Mapped[float | None] = mapped_column(Float)

    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant", cascade="all, delete-orphan",
                                              passive_deletes=True)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100), default="")
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = _ts()
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    tenant: Mapped[Tenant] = relationship(back_populates="keys")


class Adapter(Base):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = _ts()
    updated_at: Mapped[datetime] = _ts(onupdate=utcnow)

    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="adapter", cascade="all, delete-orphan", passive_deletes=True,
        order_by="AdapterVersion.number")
    aliases: Mapped[list[AdapterAlias]] = relationship(
        back_populates="adapter", cascade="all, delete-orphan", passive_deletes=True, order_by="AdapterAlias.name")


class AdapterVersion(Base):
    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("adapter_id", "number"), UniqueConstraint("tenant_id", "idempotency_key"),
                      Index("ix_adapter_versions_status_updated_at", "status", "updated_at"))

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    status: Mapped[AdapterStatus] = mapped_column(
        Enum(AdapterStatus, native_enum=False, length=16, create_constraint=True, name="adapter_status",
             values_callable=lambda e: [m.value for m in e]), default=AdapterStatus.uploading)
    sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    rank: Mapped[int | None] = mapped_column(Integer)
    alpha: Mapped[float | None] = mapped_column(Float)
    targets: Mapped[list[str]] = mapped_column(JSON, default=list)
    dtype: Mapped[str | None] = mapped_column(String(8))
    base_model: Mapped[str | None] = mapped_column(String(300))
    adapter_config: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # as uploaded; the engine reads scaling here
    blob_uri: Mapped[str | None] = mapped_column(String(1024))
    # the store key of this version's blob, recorded (status uploading) before any byte goes to the store, so a
    # crash at any later point leaves a row that names what to remove; unique per version unless it reuses the
    # blob of a ready version of the same adapter with the same sha256
    blob_key: Mapped[str | None] = mapped_column(String(1024), index=True)
    error: Mapped[str | None] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = _ts()
    updated_at: Mapped[datetime] = _ts(onupdate=utcnow)
    # history: the API key that uploaded (or imported) the version and the one that deleted it
    created_by_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    deleted_by_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    source: Mapped[str | None] = mapped_column(String(2048))  # an import's source URI (no credentials); None: upload

    adapter: Mapped[Adapter] = relationship(back_populates="versions")
    created_by: Mapped[ApiKey | None] = relationship(foreign_keys=[created_by_key_id])
    deleted_by: Mapped[ApiKey | None] = relationship(foreign_keys=[deleted_by_key_id])


class AdapterAlias(Base):
    __tablename__ = "adapter_aliases"

    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    version_id: Mapped[str] = mapped_column(ForeignKey("adapter_versions.id", ondelete="CASCADE"))
    updated_at: Mapped[datetime] = _ts(onupdate=utcnow)
    updated_by_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))

    adapter: Mapped[Adapter] = relationship(back_populates="aliases")
    version: Mapped[AdapterVersion] = relationship()


class ImportStatus(str, enum.Enum):
    """An import by reference: ``running`` (fetching, validating, storing; ``updated_at`` is its heartbeat) until
    ``succeeded`` (``version_id`` names the version) or ``failed`` (``error_*``). A ``running`` row without a
    heartbeat for ``UPLOAD_STALE_AFTER_S`` was interrupted and reads as ``failed``."""

    running = "running"
    succeeded = "succeeded"
    failed = "failed"


class AdapterImport(Base):
    """``POST /v1/adapters/import``: one fetch of a PEFT folder from the tenant's S3 bucket or an HTTPS URL."""

    __tablename__ = "adapter_imports"
    __table_args__ = (UniqueConstraint("tenant_id", "idempotency_key"),
                      Index("ix_adapter_imports_tenant_created", "tenant_id", "created_at"))

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    adapter_name: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(2048))              # as given, never with credentials
    status: Mapped[ImportStatus] = mapped_column(
        Enum(ImportStatus, native_enum=False, length=16, create_constraint=True, name="import_status",
             values_callable=lambda e: [m.value for m in e]), default=ImportStatus.running)
    bytes_received: Mapped[int] = mapped_column(BigInteger, default=0)
    version_id: Mapped[str | None] = mapped_column(ForeignKey("adapter_versions.id", ondelete="SET NULL"))
    deduplicated: Mapped[bool] = mapped_column(Boolean, default=False)
    error_status: Mapped[int | None] = mapped_column(Integer)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    created_by_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = _ts()
    updated_at: Mapped[datetime] = _ts(onupdate=utcnow)

    version: Mapped[AdapterVersion | None] = relationship()


class UsageRecord(Base):
    """Tokens used by one request (written by the gateway's buffered usage writer, in batches). ``day`` is the
    UTC day of ``created_at``; ``adapter_name`` survives the version row's deletion (None = the base model)."""

    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_tenant_day", "tenant_id", "day"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    adapter_version_id: Mapped[str | None] = mapped_column(ForeignKey("adapter_versions.id", ondelete="SET NULL"))
    model: Mapped[str] = mapped_column(String(200))  # what the request named: adapter[:version], or the base model
    request_id: Mapped[str] = mapped_column(String(64))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = _ts(index=True)
    day: Mapped[date | None] = mapped_column(Date)
    adapter_name: Mapped[str | None] = mapped_column(String(64))


class DashboardSession(Base):
    """A dashboard sign-in (``kind`` "session": the cookie's token, hashed) or a one-time login link already used
    (``kind`` "link": its nonce, hashed). ``key_id`` fingerprints the admin key it was made under, so a new admin key
    ends every session. Rows past ``expires_at`` are removed by the janitor."""

    __tablename__ = "dashboard_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8))
    key_id: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = _ts()
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
