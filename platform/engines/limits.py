"""Serving limits: what the engines of this deployment can serve, learnt from the engines themselves (their
``GET /health`` ``"limits"``; ``loraplex.engine.server.protocol.limits_dict``), so that uploads are validated
against the engines that will serve them and ``/v1/models`` marks adapters none of them can serve.

    EngineLimits.from_wire(health["limits"])          one engine's
    deployment_limits([a, b])                         every engine's at once: the smallest rank, model length and
                                                      adapter size, the targets and dtypes all of them serve
    unservable(limits, rank=32, targets=...)          None, or (code, why) no engine can serve such an adapter
    LimitsWatcher(replicas).refresh()                 asks each engine (at start, then every ``interval_s``)
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Iterable

from loraplex.platform.core.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    lora: bool
    max_lora_rank: int
    targets: tuple[str, ...]
    dtypes: tuple[str, ...]
    quantization: str | None = None
    max_adapter_bytes: int | None = None
    max_model_len: int | None = None
    max_loras: int | None = None

    @classmethod
    def from_wire(cls, d: Any) -> "EngineLimits | None":
        """None for an engine that reports no limits (an older engine, the null engine by default) or a report
        that does not parse (logged; the upload limits of the settings still apply)."""
        if not isinstance(d, dict):
            return None
        try:
            return cls(lora=bool(d.get("lora", True)), max_lora_rank=int(d["max_lora_rank"]),
                       targets=tuple(str(t) for t in d.get("targets") or ()),
                       dtypes=tuple(str(t) for t in d.get("dtypes") or ()),
                       quantization=d.get("quantization"),
                       max_adapter_bytes=int(d["max_adapter_bytes"]) if d.get("max_adapter_bytes") else None,
                       max_model_len=int(d["max_model_len"]) if d.get("max_model_len") else None,
                       max_loras=int(d["max_loras"]) if d.get("max_loras") else None)
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("an engine reported limits that do not parse (%s: %s); ignoring them", type(e).__name__, e)
            return None

    def describe(self) -> str:
        return (f"rank <= {self.max_lora_rank}, targets {', '.join(self.targets) or 'none'}, dtypes "
                f"{', '.join(self.dtypes)}")


def deployment_limits(limits: Iterable[EngineLimits | None]) -> EngineLimits | None:
    """The limits every engine meets (so an adapter that passes can be served by any replica); None if no
    engine reported any."""
    known = [lim for lim in limits if lim is not None]
    if not known:
        return None
    targets = [t for t in known[0].targets if all(t in lim.targets for lim in known)]
    dtypes = [d for d in known[0].dtypes if all(d in lim.dtypes for lim in known)]

    def smallest(name: str) -> int | None:
        values = [getattr(lim, name) for lim in known if getattr(lim, name) is not None]
        return min(values) if values else None

    quantizations = {lim.quantization for lim in known}
    return EngineLimits(lora=all(lim.lora for lim in known), max_lora_rank=min(lim.max_lora_rank for lim in known),
                        targets=tuple(targets), dtypes=tuple(dtypes),
                        quantization=quantizations.pop() if len(quantizations) == 1 else "mixed",
                        max_adapter_bytes=smallest("max_adapter_bytes"), max_model_len=smallest("max_model_len"),
                        max_loras=smallest("max_loras"))


def unservable(limits: EngineLimits | None, *, rank: int | None, targets: Iterable[str] = (),
               dtype: str | None = None, size_bytes: int | None = None) -> tuple[str, str] | None:
    """``(code, message)`` saying why no engine of the deployment can serve an adapter of this rank / targets /
    dtype / size, or None when they can (or no engine reported limits)."""
    if limits is None:
        return None
    if not limits.lora:
        return "lora_unavailable", "no engine of this deployment serves LoRA adapters (they run with LoRA off)"
    if rank is not None and rank > limits.max_lora_rank:
        return "rank_too_high", (f"rank {rank} exceeds the engines' limit of {limits.max_lora_rank}; retrain with "
                                 f"r <= {limits.max_lora_rank}")
    missing = sorted(set(targets) - set(limits.targets))
    if missing:
        return "unsupported_target", (f"the engines do not serve the targets {', '.join(missing)} (they serve "
                                      f"{', '.join(limits.targets) or 'none'}); retrain without them")
    if dtype is not None and limits.dtypes and dtype not in limits.dtypes:
        return "bad_dtype", f"the engines do not load {dtype} adapters; save it in one of {', '.join(limits.dtypes)}"
    if size_bytes is not None and limits.max_adapter_bytes is not None and size_bytes > limits.max_adapter_bytes:
        return "too_large", (f"the adapter is {size_bytes} bytes, more than the engines hold "
                             f"({limits.max_adapter_bytes} bytes at their rank limit)")
    return None


def unservable_reason(limits: EngineLimits | None, **adapter) -> str | None:
    found = unservable(limits, **adapter)
    return found[1] if found else None


class LimitsWatcher:
    """Each replica's limits, asked of its ``health()``; ``limits`` is the deployment's. A replica that does not
    answer keeps what it last reported (its limits do not change while it is away; a restarted engine's new ones
    are read at the next refresh)."""

    def __init__(self, clients: dict[str, Any], *, interval_s: float = 30.0, timeout_s: float = 5.0) -> None:
        self.clients, self.interval_s, self.timeout_s = clients, interval_s, timeout_s
        self.by_replica: dict[str, EngineLimits | None] = {}
        self.limits: EngineLimits | None = None
        self._task: asyncio.Task | None = None

    async def refresh(self) -> EngineLimits | None:
        async def one(replica_id: str, client: Any) -> None:
            try:
                health = await asyncio.wait_for(client.health(), timeout=self.timeout_s)
            except Exception as e:  # noqa: BLE001 - a replica down keeps its last limits
                logger.debug("limits of replica %s unavailable: %s", replica_id, type(e).__name__)
                return
            self.by_replica[replica_id] = getattr(health, "limits", None)

        await asyncio.gather(*(one(rid, c) for rid, c in self.clients.items()))
        previous, self.limits = self.limits, deployment_limits(self.by_replica.values())
        if self.limits != previous:
            logger.info("serving limits: %s", self.limits.describe() if self.limits else "none reported")
        return self.limits

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one bad round
                logger.exception("serving limits refresh failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="loraplex-limits-watcher")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
