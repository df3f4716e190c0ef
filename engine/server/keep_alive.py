"""How long the HTTP servers (``loraplex serve``, ``loraplex engine serve``) keep an idle keep-alive connection
open: ``LORAPLEX_KEEP_ALIVE_S`` seconds, 75 by default, passed to uvicorn's ``timeout_keep_alive``.

It must exceed the idle timeout of whatever pools connections in front of the server (a load balancer, an ingress
proxy, a client's connection pool): otherwise the server closes an idle connection at the moment the client reuses
it, and that request fails with a connection reset. Common idle timeouts: AWS ALB 60 s, nginx upstream keepalive
60 s, GCP load balancers 600 s (raise the setting above it there). uvicorn's own default is 5 s.
"""
from __future__ import annotations

import math
import os
from typing import Mapping

KEEP_ALIVE_ENV = "LORAPLEX_KEEP_ALIVE_S"
DEFAULT_KEEP_ALIVE_S = 75.0
MAX_KEEP_ALIVE_S = 3600.0


def keep_alive_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """``LORAPLEX_KEEP_ALIVE_S`` as seconds (default 75); ValueError naming the setting when it is not a number in
    (0, 3600]."""
    text = environ.get(KEEP_ALIVE_ENV, "").strip()
    if not text:
        return DEFAULT_KEEP_ALIVE_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_KEEP_ALIVE_S):
        raise ValueError(f"{KEEP_ALIVE_ENV}={text[:40]!r}: expected seconds in (0, {MAX_KEEP_ALIVE_S:g}], more than "
                         "the idle timeout of the load balancer or client pool in front (default "
                         f"{DEFAULT_KEEP_ALIVE_S:g})")
    return value
