"""UsageEvent: the tokens one request used, as the gateway records it when the request ends."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class UsageEvent:
    """``adapter_name``/``adapter_version_id`` None = the base model; ``model`` is what the request named."""

    tenant_id: str
    request_id: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    adapter_name: str | None = None
    adapter_version_id: str | None = None
    created_at: datetime = field(default_factory=_now)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.completion_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {self.prompt_tokens}, {self.completion_tokens}")

    def row(self) -> dict:
        """The ``usage_records`` row (``day`` is the UTC day of ``created_at``)."""
        return {"tenant_id": self.tenant_id, "request_id": self.request_id, "model": self.model[:200],
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "adapter_name": self.adapter_name, "adapter_version_id": self.adapter_version_id,
                "created_at": self.created_at, "day": self.created_at.astimezone(timezone.utc).date()}
