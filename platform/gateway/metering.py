"""RequestMeter: what one inference request tells the platform metrics (``app.state.metrics``), exactly once.

    arrival ─▶ authenticated (tenant) ─▶ prepared (adapter) ─▶ [quota denial] ─▶ first token ─▶ finish(status)

``finish`` reports ``observe_request(tenant, adapter, status, ttft, tpot, e2e, prompt, completion, error=code,
version=number)``:

    ttft = first token - arrival        (None when no token came)
    e2e  = end - arrival                (served requests only: status < 400)
    tpot = (e2e - ttft) / (completion / sequences - 1)   (None below two tokens per sequence; n > 1 and
                                                         best_of run ``sequences`` side by side)

``status`` is the HTTP status answered, or for a stream that broke after its first token the status of the error
it carried (the 200 was already sent), and 499 for a client that left before the end (nginx's "client closed
request"). Requests refused before their model was resolved (bad key, bad body, unknown model) carry the adapter
label ``_unresolved``; before the tenant is known, the tenant label ``_unknown``. ``metrics`` None: a no-op.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from loraplex.platform.metrics.platform_metrics import UNRESOLVED

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499


class RequestMeter:
    """Times one request; ``finish`` reports it (later calls do nothing)."""

    def __init__(self, metrics: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self.arrived = clock()
        self.first_token_at: float | None = None
        self.tenant = ""                        # the tenant's name once authenticated
        self.adapter: str | None = UNRESOLVED   # the adapter's name once prepared; None = the base model
        self.version: str | None = None         # the number of the adapter version that serves it
        self.finished = False

    def resolved(self, adapter_name: str | None, version: int | None = None) -> None:
        """The request's model is known: an adapter's name (and the number of the version serving it), or None for
        the base model."""
        self.adapter = adapter_name
        if version is not None:
            self.version = str(version)

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = self.clock()

    def quota_rejected(self, kind: str) -> None:
        """A quota denial (``QuotaDecision.reason``); ``finish`` with its status follows."""
        if self.metrics is not None:
            self.metrics.observe_quota_rejection(self.tenant, kind)

    def finish(self, status: int, *, prompt_tokens: int = 0, completion_tokens: int = 0,
               error: str | None = None, sequences: int = 1) -> None:
        if self.finished:
            return
        self.finished = True
        if self.metrics is None:
            return
        end = self.clock()
        ttft = self.first_token_at - self.arrived if self.first_token_at is not None else None
        e2e = end - self.arrived if status < 400 else None
        tpot = None
        per_sequence = completion_tokens / max(1, sequences)
        if e2e is not None and ttft is not None and per_sequence >= 2:
            tpot = (e2e - ttft) / (per_sequence - 1)
        try:
            self.metrics.observe_request(self.tenant, self.adapter, status, ttft, tpot, e2e, prompt_tokens,
                                         completion_tokens, error=error, version=self.version)
        except Exception:  # noqa: BLE001 - metrics must never turn a served request into an error
            logger.exception("recording request metrics failed")
