"""Errors of the upload path, each with the HTTP status it maps to and a message that says what to fix."""
from __future__ import annotations


class UploadError(Exception):
    """A refused upload. ``status`` is the HTTP status, ``code`` a short machine-readable reason."""

    def __init__(self, status: int, message: str, *, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code

    @property
    def message(self) -> str:
        return str(self.args[0])


def too_large(limit: int, what: str = "upload") -> UploadError:
    return UploadError(413, f"{what} exceeds the {limit}-byte limit of this deployment; upload a smaller adapter "
                            "(lower rank or fewer targets) or ask the operator to raise LORAPLEX_MAX_UPLOAD_BYTES",
                       code="too_large")
