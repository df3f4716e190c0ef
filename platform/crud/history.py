"""An adapter's version history as the API shows it (tenant route and admin dashboard): every version with who
uploaded and deleted it and when, and every alias with who moved it last."""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform.crud import adapters as crud
from loraplex.platform.db.models import Adapter, AdapterStatus, ApiKey
from loraplex.platform.schemas.adapters import AliasHistoryEntry, KeyRef, VersionHistory, VersionHistoryEntry


def key_ref(key: ApiKey | None) -> KeyRef | None:
    return KeyRef(id=key.id, name=key.name, prefix=key.prefix) if key is not None else None


def version_history(*, session: Session, adapter: Adapter) -> VersionHistory:
    """Every version of ``adapter``, newest first, and its aliases."""
    alias_rows = crud.alias_rows(session=session, adapter=adapter)
    naming: dict[int, list[str]] = {}
    for alias, number in alias_rows:
        naming.setdefault(number, []).append(alias.name)
    keys = {k.id: k for k in session.scalars(select(ApiKey).where(ApiKey.tenant_id == adapter.tenant_id))}
    entries = [VersionHistoryEntry(number=v.number, status=v.status, sha256=v.sha256, size_bytes=v.size_bytes,
                                   rank=v.rank, created_at=v.created_at,
                                   created_by=key_ref(keys.get(v.created_by_key_id)), source=v.source,
                                   aliases=naming.get(v.number, []) if v.status == AdapterStatus.ready else [],
                                   deleted_at=v.deleted_at, deleted_by=key_ref(keys.get(v.deleted_by_key_id)),
                                   error=v.error)
               for v in sorted(adapter.versions, key=lambda v: -v.number)]
    aliases = [AliasHistoryEntry(alias=a.name, version=n, updated_at=a.updated_at,
                                 updated_by=key_ref(keys.get(a.updated_by_key_id))) for a, n in alias_rows]
    return VersionHistory(adapter=adapter.name, data=entries, aliases=aliases)
