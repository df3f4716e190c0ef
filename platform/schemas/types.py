"""Field types shared by the API schemas."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

from fastapi import Path, Query
from pydantic import AfterValidator


def _as_utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes (stored in UTC); the API always answers RFC 3339 with an offset."""
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


UtcDatetime = Annotated[datetime, AfterValidator(_as_utc)]

# Bounds of the registry's integer columns: a number past them is refused with 400 before it reaches SQL.
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1


def _no_lone_surrogates(value: str) -> str:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the text holds a lone surrogate (an unpaired \\ud800-\\udfff escape); send valid "
                             "UTF-8") from None
    return value


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]    # free text stored in the registry

# Paging and ids in paths and queries, bounded so nothing past the registry's columns reaches SQL.
Offset = Annotated[int, Query(ge=0, le=MAX_INT32, description="rows to skip")]
Limit = Annotated[int, Query(ge=1, le=100, description="rows to return (at most 100)")]
VersionNumber = Annotated[int, Path(ge=1, le=MAX_INT32, description="a version number (1, 2, ...)")]
RowId = Annotated[str, Path(min_length=1, max_length=64, description="an id as the API returned it")]
