"""Secrets never reach the access log: the values of credential-like query parameters (``key``, ``login``,
``token``, ``api_key``, ...) are replaced by ``[REDACTED]`` in uvicorn's access-log lines.

    GET /admin/dashboard?key=s3cr3t&x=1   is logged as   GET /admin/dashboard?key=[REDACTED]&x=1

``install()`` adds the filter to the ``uvicorn.access`` logger (idempotent); ``loraplex serve`` and the dashboard
call it. Credentials belong in headers or POST bodies, which are never logged; this is the net for links that
carry one anyway (the dashboard refuses ``?key=``, but the request line is logged before any route runs).
"""
from __future__ import annotations

import logging
from urllib.parse import unquote_plus

SENSITIVE = frozenset({"key", "login", "token", "api_key", "apikey", "access_token", "auth", "password", "secret",
                       "admin_key", "code", "signature", "x-amz-signature", "x-amz-credential", "sig"})
REDACTED = "[REDACTED]"


def redact_target(target: str) -> str:
    """``path?query`` with the values of sensitive parameters replaced (names compared case-insensitively)."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    parts = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        if eq and unquote_plus(name).strip().lower() in SENSITIVE:
            parts.append(f"{name}={REDACTED}")
        else:
            parts.append(item)
    return f"{path}?{'&'.join(parts)}"


class RedactQueryFilter(logging.Filter):
    """Rewrites the request target of uvicorn's access records (args: client, method, target, version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], redact_target(args[2]), *args[3:])
        return True


def install(logger_name: str = "uvicorn.access") -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, RedactQueryFilter) for f in logger.filters):
        logger.addFilter(RedactQueryFilter())
