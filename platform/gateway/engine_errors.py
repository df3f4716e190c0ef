"""Engine errors as tenants see them: nothing about the deployment's insides (blob store endpoints, buckets, key
layout, file paths, engine addresses) leaves the platform. The full message is logged with the request id, which
the tenant gets (in the message and ``x-request-id``) to quote to the operator.

    adapter load failure (422)   "The adapter `<model>` could not be loaded ... request id <id> ..."
    adapter fetch outage (503)   "The adapter's weights are temporarily unavailable; retry shortly (request id <id>)."
    engine unavailable (503)     "No engine replica is available right now; retry shortly (request id <id>)."
    other 5xx                    "The engine failed to serve this request; ... request id <id> ..."
    4xx (the request as sent)    the engine's message with URIs, paths, addresses and key layouts replaced by
                                 "<internal>", plus the request id; ``param`` is the request field the message is
                                 about (``top_k``, ``logit_bias``; a grammar the engine could not compile: its field,
                                 ``response_format`` or ``guided_*``)
"""
from __future__ import annotations

import logging
import re
from typing import Any

from loraplex.platform.engines.errors import (AdapterFetchUnavailableError, AdapterLoadFailedError, EngineError,
                                              EngineUnavailableError)
from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.parameters import parameters_of

logger = logging.getLogger(__name__)

INTERNAL = "<internal>"
_SCRUB = [
    re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.\-]*://\S+"),                     # URIs and URLs (s3://, http://, file://)
    re.compile(r"\badapters/\S+"),                                        # blob key layout
    re.compile(r"(?<![\w.\-])/(?:[\w.\-]+/)+[\w.\-]*"),                  # absolute paths
    re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"),                  # IPv4 addresses, with a port
    re.compile(r"\b[\w\-]+(?:\.[\w\-]+)+:\d{2,5}\b"),                     # host:port
]


def scrub(message: str) -> str:
    """``message`` with anything that names the deployment's insides replaced by ``<internal>``."""
    for pattern in _SCRUB:
        message = pattern.sub(INTERNAL, message)
    return message


def for_tenant(e: EngineError, prep: Any) -> InferenceError:
    """The ``InferenceError`` a tenant gets for engine error ``e`` of request ``prep``; logs the full message."""
    rid = prep.request_id
    logger.warning("request %s (tenant %s, model %r): engine error %d %s: %s", rid, prep.tenant.id, prep.body.model,
                   e.status_code, e.type_, e.message)
    if isinstance(e, AdapterLoadFailedError):
        message = (f"The adapter `{prep.body.model}` could not be loaded by the engine. If it persists, upload it "
                   f"again or give the operator the request id {rid}.")
    elif isinstance(e, AdapterFetchUnavailableError):
        message = f"The adapter's weights are temporarily unavailable; retry shortly (request id {rid})."
    elif isinstance(e, EngineUnavailableError):
        message = f"No engine replica is available right now; retry shortly (request id {rid})."
    elif e.status_code >= 500:
        message = f"The engine failed to serve this request; retry, or give the operator the request id {rid}."
    else:
        message = f"{scrub(e.message)} (request id {rid})"
    param = _param_of(e, prep) if e.status_code < 500 else None
    structured = getattr(prep.body, "structured", None)
    if param is not None and structured is not None and e.message.startswith("structured."):
        message = message.replace(f"structured.{structured.spec.kind}", param, 1)
    headers = {"x-request-id": rid}
    retry = getattr(e, "retry_after_s", None)
    if retry:
        headers["retry-after"] = str(retry)
    return InferenceError(e.status_code, message, code=e.type_, param=param, headers=headers)


def _param_of(e: EngineError, prep: Any) -> str | None:
    """The request field an engine refusal is about: the one its message starts with (``top_k=...``,
    ``logit_bias has ...``), or the output constraint's field for a grammar the engine could not compile."""
    structured = getattr(prep.body, "structured", None)
    if e.message.startswith("structured."):
        return structured.param if structured is not None else None
    match = _LEADING_NAME.match(e.message)
    known = parameters_of("chat" if getattr(prep, "kind", "chat") == "chat" else "completion")
    if match and match.group(1) in known and known[match.group(1)].status != "refused":
        return match.group(1)
    return None


_LEADING_NAME = re.compile(r"([a-z_]+)\b")


def no_engine_error(request_id: str, reason: str) -> InferenceError:
    """The deployment has no engine replica (misconfigured or failed to build): the reason goes to the log."""
    logger.warning("request %s: no engine replica (%s)", request_id, reason)
    return InferenceError(503, f"This deployment has no engine replica running; the operator must fix the engine "
                               f"settings (request id {request_id}).", code="engine_unavailable",
                          headers={"x-request-id": request_id})
