"""Gateway: everything the inference routes share, built from the settings and started in the app's lifespan.

    replicas ──▶ Router ◀── ResidencyPoller (every RESIDENCY_POLL_S)     LimitsWatcher (engines' serving limits)
    QuotaStore (Redis | in-process)    PromptTokenizer + chat template    TenantAuth (cached)
    AdapterReferences (PEFT folders / inline configs)    UsageWriter (batched SQL)    EngineFanoutNotifier
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from loraplex.engine.engine_config import EngineSettingsError
from loraplex.platform.core.config import Settings
from loraplex.platform.engines.limits import EngineLimits, LimitsWatcher
from loraplex.platform.engines.notifier import EngineNotifier, Eviction, Promotion, promote
from loraplex.platform.engines.messages import AdapterReference
from loraplex.platform.gateway.adapters import AdapterReferences, resolve_version
from loraplex.platform.gateway.auth import TenantAuth
from loraplex.platform.gateway.engines import build_replicas
from loraplex.platform.gateway.notifier import EngineFanoutNotifier
from loraplex.platform.gateway.residency import ResidencyPoller
from loraplex.platform.gateway.tokenizer import PromptTokenizer
from loraplex.platform.quotas import QuotaStore, make_quota_store
from loraplex.platform.routing import Replica, Router, RouterConfig
from loraplex.platform.usage import UsageWriter

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN_CAP = 8192


@dataclass
class Gateway:
    settings: Settings
    sessions: sessionmaker[Session]
    model_name: str
    base_names: list[str]
    max_model_len: int
    tokenizer: PromptTokenizer
    quotas: QuotaStore
    router: Router | None
    auth: TenantAuth
    references: AdapterReferences
    usage: UsageWriter
    engine_error: str | None = None    # why no engine replica could be built (inference answers 503 with it)
    poller: ResidencyPoller | None = None
    notifier: EngineFanoutNotifier | None = None
    limits_watcher: LimitsWatcher | None = None   # the engines' serving limits (uploads, /v1/models)
    _closed: bool = field(default=False, repr=False)

    @property
    def serving_limits(self) -> EngineLimits | None:
        """What every engine replica can serve; None until one reported (the settings' limits apply alone)."""
        return self.limits_watcher.limits if self.limits_watcher is not None else None

    @classmethod
    def build(cls, settings: Settings, sessions: sessionmaker[Session], *,
              replicas: list[Replica] | None = None, quotas: QuotaStore | None = None) -> "Gateway":
        """Blocking (the embedded engine loads its model here): run it in a worker thread from async code."""
        model_name = settings.served_model_name or ("null" if settings.engine_mode == "null" else "base")
        base_names = [model_name, *settings.base_model_aliases]
        if settings.base_model_path:
            base_names.append(os.path.basename(os.path.normpath(settings.base_model_path)))
        max_len = settings.max_model_len
        if max_len is None:
            max_len = DEFAULT_MAX_MODEL_LEN_CAP
            if settings.base_model_path:
                from loraplex.engine.config import ModelConfig

                max_len = min(ModelConfig.from_pretrained(settings.base_model_path).max_position_embeddings, max_len)
        engine_error = None
        if replicas is None:
            try:
                replicas = build_replicas(settings, model_name=model_name)
            except EngineSettingsError as e:   # a setting the model cannot honour: one line says which
                logger.error("no engine replica: %s; inference answers 503 until this is fixed", e)
                replicas, engine_error = [], str(e)
            except Exception as e:  # noqa: BLE001 - the control plane stays up; inference says why it cannot run
                logger.exception("no engine replica could be built; inference answers 503 until this is fixed")
                replicas, engine_error = [], f"{type(e).__name__}: {e}"
        return cls(
            settings=settings, sessions=sessions, model_name=model_name, base_names=list(dict.fromkeys(base_names)),
            max_model_len=max_len, tokenizer=PromptTokenizer(settings.base_model_path),
            quotas=quotas or make_quota_store(settings.redis_url, fail_open=settings.quota_fail_open,
                                              timeout_s=settings.quota_timeout_s,
                                              key_prefix=settings.quota_key_prefix,
                                              reap_interval_s=settings.quota_lease_reap_s,
                                              instance_ttl_s=settings.quota_instance_ttl_s),
            router=Router(replicas, RouterConfig(probe_interval_s=settings.residency_poll_s)) if replicas else None,
            auth=TenantAuth(sessions, secret=settings.secret_key.get_secret_value(), ttl_s=settings.auth_cache_s),
            references=AdapterReferences(settings.adapter_path),
            usage=UsageWriter(sessions, max_rows=settings.usage_flush_rows, interval_s=settings.usage_flush_s),
            engine_error=engine_error)

    async def start(self) -> None:
        await self.usage.start()
        if self.router is not None:
            self.poller = ResidencyPoller(self.router, interval_s=self.settings.residency_poll_s)
            await self.poller.poll_once()
            self.poller.start()
            self.limits_watcher = LimitsWatcher({rid: r.client for rid, r in self.router.replicas.items()},
                                                interval_s=self.settings.engine_limits_poll_s)
            await self.limits_watcher.refresh()
            self.limits_watcher.start()
            self.notifier = EngineFanoutNotifier(self.router, asyncio.get_running_loop(), on_evict=self._forget,
                                                 reference_of=self._reference_of)

    def _forget(self, eviction: Eviction) -> None:
        self.references.forget(eviction.version_id)

    def _reference_of(self, tenant_id: str, version_id: str) -> AdapterReference | None:
        """The engine reference of a ready version (None if it is not ready): what a promotion warms."""
        with self.sessions() as session:
            adapter = resolve_version(session=session, tenant_id=tenant_id, version_id=version_id)
        return self.references.reference(adapter) if adapter is not None else None

    async def stop(self) -> None:
        """Stop polling, write the remaining usage, close quota store and engines (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.poller is not None:
            await self.poller.stop()
        if self.limits_watcher is not None:
            await self.limits_watcher.stop()
        await self.usage.stop()
        await self.quotas.close()
        from loraplex.platform.inference.harmony import render_pool

        await asyncio.to_thread(render_pool.shutdown)   # harmony's rendering processes, if any started
        if self.router is not None:
            for replica in self.router.replicas.values():
                try:
                    await replica.client.close()
                except Exception:  # noqa: BLE001 - close the others
                    logger.exception("closing engine client %s failed", replica.replica_id)


class CompositeNotifier:
    """Tells several notifiers (the app's own, e.g. a test's recorder, and the engine fan-out)."""

    def __init__(self, *notifiers: EngineNotifier) -> None:
        self.notifiers = notifiers

    def evict(self, evictions: list[Eviction]) -> None:
        for n in self.notifiers:
            n.evict(evictions)

    def promote(self, promotions: list[Promotion]) -> None:
        for n in self.notifiers:
            promote(n, promotions)
