"""The end-to-end target of ``loraplex bench serve --url``: the same scenarios through the platform's OpenAI
endpoint, with tenant keys, streaming, so in-process and end-to-end figures share one report format.

    run = RemoteRun(cfg)                       # keys, adapter names, the base model's name (GET /v1/models)
    row = run.measure(measurement, deadline)   # warm-up, then the load: one streamed /v1/completions per request

Each request is ``POST /v1/completions`` through the official ``openai`` async client: the prompt as token ids
(exactly ``input_len`` tokens), ``max_tokens`` = the output length with ``ignore_eos``, ``stream=True`` and
``stream_options={"include_usage": True}``. TTFT = send -> first chunk with a choice; the output token count is
the final chunk's ``usage.completion_tokens``. Requests of an adapter go with the key of the tenant that owns it
(``model`` = the adapter's name); base-only requests with the first tenant's key. In the fairness scenario the
first tenant of the keys file is the light one and the second the heavy one, each sending to its own first
adapter (the base model if it lists none). A refused request (a quota's 429, say) is counted under ``errors``,
not raised. What the engine did (graph steps, KV, adapter loads) is not seen from outside: those columns stay
empty; the platform's /metrics has the engine's gauges.

Keys file (JSON): ``{"tenants": [{"name": "light", "key": "lpx-...", "adapters": ["bot"]}, ...],
"base_model": "optional name"}``.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from loraplex.bench.driver import DriveResult, LoadGroup
from loraplex.bench.measure import Measurement, summarize_run
from loraplex.bench.stats import RequestTiming
from loraplex.bench.workload import SCALES, request_plan

WARMUP_OUTPUT_LEN = 8


@dataclass
class Tenant:
    name: str
    key: str = field(repr=False)
    adapters: list[str] = field(default_factory=list)


@dataclass
class Keys:
    tenants: list[Tenant]
    base_model: str | None = None

    @property
    def adapters(self) -> list[tuple[Tenant, str]]:
        return [(t, a) for t in self.tenants for a in t.adapters]


def read_keys_file(path: str) -> Keys:
    """The keys file (module docstring); ValueError saying what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"keys file {path!r} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"keys file {path!r} is not JSON: {e}") from None
    tenants = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(tenants, list) or not tenants:
        raise ValueError(f'keys file {path!r} needs {{"tenants": [{{"name", "key", "adapters"}}, ...]}}')
    out = []
    for i, t in enumerate(tenants):
        if not isinstance(t, dict) or not isinstance(t.get("key"), str) or not t["key"]:
            raise ValueError(f"keys file {path!r}: tenant {i} needs a non-empty string 'key'")
        adapters = t.get("adapters", [])
        if not isinstance(adapters, list) or not all(isinstance(a, str) and a for a in adapters):
            raise ValueError(f"keys file {path!r}: tenant {i}'s 'adapters' must be a list of adapter names")
        out.append(Tenant(str(t.get("name") or f"tenant-{i}"), t["key"], list(adapters)))
    base = data.get("base_model")
    return Keys(out, base if isinstance(base, str) and base else None)


class RemoteRun:
    kind = "end-to-end"

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.model_config = SCALES[cfg.scale]
        self.keys = read_keys_file(cfg.keys_file) if cfg.keys_file else \
            Keys([Tenant("tenant", cfg.api_key, list(cfg.adapter_names))])
        self.adapters = self.keys.adapters
        if cfg.scenario != "fairness" and cfg.num_adapters > len(self.adapters):
            raise ValueError(f"{cfg.num_adapters} adapters asked for, the keys name {len(self.adapters)}")
        if cfg.scenario == "fairness" and len(self.keys.tenants) < 2:
            raise ValueError("the fairness scenario needs two tenants' keys (a keys file: light first, heavy second)")
        self.setup_s: dict[str, float] = {}
        self.notes = [f"end to end through {cfg.url}: {len(self.keys.tenants)} tenant(s), {len(self.adapters)} "
                      "adapter(s); engine-side figures (graph steps, KV usage, adapter loads) are not seen from "
                      "outside"]
        self.engine_info: dict = {}
        self.adapter_folders: list[str] = []
        self.vocab = cfg.vocab_size or self.model_config["vocab_size"]
        self._clients: dict[str, object] = {}
        self.base_model = cfg.base_model or self.keys.base_model
        if self.base_model is None:
            try:
                self.base_model = asyncio.run(self._first_model())
            except Exception as e:  # noqa: BLE001 - said once, clearly, instead of a client traceback
                raise RuntimeError(f"cannot list the models at {cfg.url} with the first tenant's key "
                                   f"({type(e).__name__}: {e}); check --url and the key, or pass --base-model") from e

    # ---- clients ------------------------------------------------------------------------------------------------
    def _client(self, tenant: Tenant):
        import httpx
        import openai

        if tenant.key not in self._clients:
            http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
                                     timeout=self.cfg.request_timeout_s)
            self._clients[tenant.key] = openai.AsyncOpenAI(base_url=self.cfg.url, api_key=tenant.key, max_retries=0,
                                                           timeout=self.cfg.request_timeout_s, http_client=http)
        return self._clients[tenant.key]

    async def _first_model(self) -> str:
        try:
            page = await self._client(self.keys.tenants[0]).models.list()
            return page.data[0].id
        finally:
            await self._close_clients()

    async def _close_clients(self) -> None:
        clients, self._clients = self._clients, {}
        for c in clients.values():
            await c.close()

    def _route(self, group: LoadGroup, adapter: int | None) -> tuple[Tenant, str]:
        """(tenant whose key sends it, model name) of a request."""
        if group.tenant is not None:  # fairness: light = first tenant, heavy = second, each its own first adapter
            tenant = self.keys.tenants[0 if group.tenant == "light" else 1]
            return tenant, (tenant.adapters[0] if adapter is not None and tenant.adapters else self.base_model)
        if adapter is None:
            return self.keys.tenants[0], self.base_model
        return self.adapters[adapter % len(self.adapters)]

    # ---- phases and runs ------------------------------------------------------------------------------------------
    def start_phase(self, phase) -> None:
        self.engine_info[phase.label] = {"endpoint": self.cfg.url, "base_model": self.base_model,
                                         "description": phase.description}

    def close(self) -> None:
        pass

    def measure(self, m: Measurement, deadline: float | None) -> dict | None:
        return asyncio.run(self._measure(m, deadline))

    async def _measure(self, m: Measurement, deadline: float | None) -> dict | None:
        try:
            if self.cfg.warmup and m.warmup_requests:
                t0 = time.monotonic()
                await self._warmup(m, deadline)
                self.setup_s[f"warmup {m.name}"] = time.monotonic() - t0
            res, errors = await self._drive(m, deadline)
        finally:
            await self._close_clients()
        primary = [t for t in res.timings if t.group == m.primary and t.finish is not None]
        if not primary:
            if deadline is not None and res.end >= deadline:
                return None
            raise RuntimeError(f"scenario {m.name!r}: no request of {m.primary!r} finished"
                               + (f" ({len(errors)} errors, first: {errors[0]})" if errors else ""))
        extra = {"errors": len(errors), "first_error": errors[0] if errors else None, "endpoint": self.cfg.url,
                 "engine_steps": None}
        return summarize_run(m, res, peak_memory_gib=None, extra=extra).to_dict()

    async def _warmup(self, m: Measurement, deadline: float | None) -> None:
        plan = request_plan(num_requests=m.warmup_requests, num_adapters=m.warmup_adapters, mix="even",
                            input_len=min(m.input_len, 64), vocab=self.vocab, seed=self.cfg.seed + 1000)
        group = LoadGroup("warm", plan, min(WARMUP_OUTPUT_LEN, m.output_len), concurrency=len(plan))
        await self._drive(Measurement("warm", [group], "warm", len(plan), m.input_len, m.output_len), deadline)

    async def _drive(self, m: Measurement, deadline: float | None) -> tuple[DriveResult, list[str]]:
        clock = time.monotonic
        start = clock()
        soft = start + m.time_s if m.time_s else None
        hard = start + (m.hard_s or 2 * m.time_s) if m.time_s else None
        if deadline is not None:
            hard = deadline if hard is None else min(hard, deadline)
        res = DriveResult([], False, start, start, tokens={g.name: [] for g in m.groups},
                          in_flight={g.name: [] for g in m.groups})
        errors: list[str] = []
        flight = {g.name: 0 for g in m.groups}
        queues = {g.name: list(g.plan) for g in m.groups}

        def event(group: str, tokens: int) -> None:
            res.step_times.append(clock())
            for name in res.tokens:
                res.tokens[name].append(tokens if name == group else 0)
                res.in_flight[name].append(flight[name])

        async def one(g: LoadGroup, req) -> None:
            tenant, model = self._route(g, req.adapter)
            t = RequestTiming(f"{g.name}-{req.index}", req.adapter, len(req.prompt), arrival=clock(), group=g.name,
                              tenant=g.tenant)
            res.timings.append(t)
            flight[g.name] += 1
            usage = None
            try:
                stream = await self._client(tenant).completions.create(
                    model=model, prompt=req.prompt, max_tokens=g.output_len, n=g.n,
                    temperature=0.0 if g.n == 1 else 1.0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if chunk.choices:
                        if t.first_token is None:
                            t.first_token = clock()
                        event(g.name, len(chunk.choices))
                    if getattr(chunk, "usage", None) is not None:
                        usage = chunk.usage.completion_tokens
                t.finish, t.output_tokens = clock(), usage if usage is not None else 0
                if usage is None:
                    errors.append(f"{t.request_id}: the stream ended without usage")
                    t.finish = None
            except Exception as e:  # noqa: BLE001 - a refused or failed request is counted, not fatal
                errors.append(f"{t.request_id}: {type(e).__name__}: {str(e)[:200]}")
            finally:
                flight[g.name] -= 1

        def past_soft() -> bool:
            return soft is not None and clock() >= soft

        async def client(g: LoadGroup, k: int) -> None:
            await asyncio.sleep(max(0.0, start + k * g.stagger_s - clock()))
            while queues[g.name] and not past_soft():
                await one(g, queues[g.name].pop(0))

        async def sender(g: LoadGroup) -> None:
            tasks = []
            for due, req in zip(g.arrivals, g.plan):
                await asyncio.sleep(max(0.0, start + due - clock()))
                if soft is not None and start + due >= soft:
                    break
                queues[g.name].remove(req)
                tasks.append(asyncio.create_task(one(g, req)))
            await asyncio.gather(*tasks)

        def tasks_of(g: LoadGroup) -> list[asyncio.Task]:
            if g.concurrency is not None:
                return [asyncio.create_task(client(g, k)) for k in range(min(g.concurrency, len(g.plan)))]
            return [asyncio.create_task(sender(g))]

        fg = [t for g in m.groups if not g.background for t in tasks_of(g)]
        bg = [t for g in m.groups if g.background for t in tasks_of(g)]
        if m.background_s and bg:
            asyncio.get_running_loop().call_later(m.background_s, lambda: [t.cancel() for t in bg])
        timeout = None if hard is None else max(0.0, hard - clock())
        done, pending = await asyncio.wait(fg, timeout=timeout)
        for t in list(pending) + bg:
            t.cancel()
        await asyncio.gather(*pending, *bg, return_exceptions=True)
        res.truncated = bool(pending) or any(queues[g.name] for g in m.groups if not g.background)
        res.steps = len(res.step_times)
        res.end = clock()
        return res, errors
