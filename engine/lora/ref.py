"""AdapterRef: the identity of one LoRA adapter as requests name it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdapterRef:
    """What ``add_request(adapter=...)`` takes.

    Hashable; two refs are equal when ``adapter_id`` and ``sha256`` are equal (the ``uri`` is where the
    bytes come from, not what they are, so it takes no part in equality).

    Args:
        adapter_id: globally unique name (the platform uses ``"<tenant>/<adapter>/<version>"``).
        uri: ``file:///path/to/peft-folder`` or ``s3://bucket/key...``; the fetcher is chosen by scheme.
        sha256: hex digest of ``adapter_model.safetensors``; verified after fetch when given.
    """

    adapter_id: str
    uri: str = field(compare=False)
    sha256: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.adapter_id, str) or not self.adapter_id:
            raise ValueError("AdapterRef.adapter_id must be a non-empty string")
        if not isinstance(self.uri, str) or "://" not in self.uri:
            raise ValueError(
                f"AdapterRef.uri must be a URI with a scheme (file://..., s3://...), got {self.uri!r}"
            )
        if self.sha256 is not None:
            digest = self.sha256.lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(
                    f"AdapterRef.sha256 must be 64 hex characters, got {self.sha256!r} "
                    f"for adapter {self.adapter_id!r}"
                )
            object.__setattr__(self, "sha256", digest)

    @property
    def scheme(self) -> str:
        """The URI scheme (``"file"``, ``"s3"``, ...)."""
        return self.uri.split("://", 1)[0].lower()
