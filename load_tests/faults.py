"""The fault schedule of the long run (``python -m load_tests.run --spawn --faults all``): while the scenarios run,
faults are injected one after the other, round after round, into the spawned ``LocalStack``. Each is held for
``hold_s``, restored, its recovery measured by a probe, then the load is paused (``gate.Gate``) and every invariant
checked on the quiet stack before the load goes on.

    engine      SIGKILL of engine replica i (round robin); restarted on its port after the hold
                recovered: the restarted replica served a request (its admissions counter moved)
    redis       the own redis-server SIGKILLed; restarted empty          recovered: a completion answered 200
    redis_stall the own Redis stalled for writes (``CLIENT PAUSE WRITE``, lifted by ``CLIENT UNPAUSE`` after the
                hold) while streams end                                  recovered: a completion answered 200;
                the lease invariant is then given ``STALL_LEASE_TIMEOUT_S`` (released leases must all be gone)
    postgres    the own cluster stopped ``-m immediate`` (or, on the proxy fallback, cut); started again
                recovered: ``GET /v1/adapters`` answered 200 (a database read)
    s3_down     the S3 proxy refuses and drops connections               recovered: an upload answered 201
    s3_slow     the S3 proxy delays every chunk by ``slow_delay_s``; an upload and a cold load are timed in it
                recovered: an upload answered 201 after the proxy is back to normal
    disconnect  8 streams leaving after 2 events and 6 completions cut after 0.3 s, at once; nothing to restore

    schedule = FaultSchedule(local_stack, population, ["redis", "engine"], interval_s=30, hold_s=3, max_rounds=None)
    schedule.start(t0=t0, deadline=t0 + duration, gate=gate, load_records=lambda: [...])
    ...; schedule.join(); schedule.injections     # [Injection]; schedule.records: its own probe requests

Requests of the load whose time overlaps a fault (from injection to recovery + ``GRACE_S``) may end in the outcomes
``ALLOWED[fault]`` (clear, retryable errors); ``excuse`` marks them expected so that the ``answers`` invariant
still fails on anything else.
"""
from __future__ import annotations

import asyncio
import threading
import time
import traceback
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx

from load_tests.adapters import rank1_adapter
from load_tests.invariants import check_all, failed
from load_tests.population import Population, new_tenant, upload
from load_tests.records import Record, error_kind

FAULTS = ("engine", "redis", "redis_stall", "postgres", "s3_down", "s3_slow", "disconnect")
PAUSE_SLACK_S = 20.0     # redis_stall: how much longer than the hold the pause may last before Redis lifts it
ALLOWED: dict[str, set[str]] = {
    "engine": {"engine_unavailable"},                       # streams/completions running on the killed replica
    "redis": {"quota_store_unavailable"},                   # fail closed
    "redis_stall": {"quota_store_unavailable"},             # acquires time out (QUOTA_TIMEOUT_S): fail closed
    "postgres": {"database_unavailable", "registry_unavailable"},
    "s3_down": {"blob_store_unavailable", "adapter_fetch_unavailable"},
    "s3_slow": set(),
    "disconnect": set(),
}
RECOVERY_TIMEOUT_S = {"engine": 120.0}                      # model load on a busy CPU; 30 s for the others
STALL_LEASE_TIMEOUT_S = 30.0                                # after a Redis stall: no lease may be left by then
GRACE_S = 3.0                                               # after recovery, stragglers on old connections


@dataclass
class Injection:
    fault: str
    round: int
    injected_s: float                    # run clock (seconds since t0)
    restored_s: float | None = None
    recovered_s: float | None = None     # first probe success after the restore
    figures: dict = field(default_factory=dict)
    invariants: dict = field(default_factory=dict)
    pause_s: float | None = None         # waiting for in-flight requests before the invariant check
    error: str | None = None

    @property
    def hold_s(self) -> float | None:
        return None if self.restored_s is None else self.restored_s - self.injected_s

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_s is None or self.restored_s is None else self.recovered_s - self.restored_s

    def window(self) -> tuple[float, float]:
        end = self.recovered_s or self.restored_s or self.injected_s
        return self.injected_s, end

    def as_dict(self) -> dict:
        return {**asdict(self), "hold_s": _r(self.hold_s), "recovery_s": _r(self.recovery_s),
                "invariants_ok": bool(self.invariants) and not failed(self.invariants)}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def overlaps(r: Record, start: float, end: float) -> bool:
    return r.started_s <= end and r.started_s + r.latency_ms / 1000 >= start


def excuse(records: list[Record], injections: list[Injection]) -> dict[str, dict[str, int]]:
    """Marks expected the outcomes a fault allows for requests overlapping it; returns {fault: {kind: n}}, counting
    records excused by an earlier call too (no scenario expects these outcomes by itself)."""
    out: dict[str, Counter] = {}
    for r in records:
        if r.kind == "ok":
            continue
        for inj in injections:
            start, end = inj.window()
            if r.kind in ALLOWED[inj.fault] and overlaps(r, start - 0.5, end + GRACE_S):
                r.expected = True
                out.setdefault(inj.fault, Counter())[r.kind] += 1
                break
    return {k: dict(v) for k, v in out.items()}


def outcome(r: Record) -> str:
    """The bucket of a request in the fault matrix."""
    if r.kind == "client_disconnect":
        return "client_disconnect"
    if r.kind.startswith("transport:") or r.status == 0:
        return "connection_error"
    if 200 <= r.status < 300:
        return "2xx" if r.kind == "ok" else "stream_error"      # an SSE error event after the 200
    if r.status in (429, 503):
        return str(r.status)
    return "other_5xx" if r.status >= 500 else "4xx"


def during(records: list[Record], inj: Injection) -> dict[str, int]:
    """Load requests whose time overlaps the fault (injection → recovery), by outcome."""
    start, end = inj.window()
    return dict(Counter(outcome(r) for r in records if overlaps(r, start, end)))


def admissions(url: str) -> int:
    """Requests an engine admitted since it started (adapter activations and slot hits, base-model prefix
    lookups)."""
    s = httpx.get(url + "/v1/stats", timeout=5).json()
    c = s.get("adapter_counters", {})
    return c.get("activations", 0) + c.get("slot_hits", 0) + s.get("prefix_cache_queries", 0)


class FaultSchedule:
    def __init__(self, local, population: Population, faults: list[str], *, interval_s: float = 30.0,
                 hold_s: float = 3.0, slow_delay_s: float = 0.3, check_timeout_s: float = 90.0,
                 max_rounds: int | None = None) -> None:
        unknown = set(faults) - set(FAULTS)
        if unknown or not faults:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}; choose from {FAULTS}")
        self.local, self.pop, self.faults = local, population, list(faults)
        self.interval_s, self.hold_s, self.slow_delay_s = interval_s, hold_s, slow_delay_s
        self.check_timeout_s, self.max_rounds = check_timeout_s, max_rounds
        self.injections: list[Injection] = []
        self.records: list[Record] = []          # the schedule's own requests (probes, disconnects)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._since = 0.0                        # run clock of the last check: it covers requests started after it
        self.crashed: str | None = None

    # -- running --------------------------------------------------------------------------------------------
    def start(self, *, t0: float, deadline: float, gate, load_records: Callable[[], list[Record]]) -> None:
        """Injects faults from ``t0`` + 5 s (or ``interval_s`` if shorter), one every ``interval_s`` after the
        previous one's check, while the next fits before ``deadline`` (epoch seconds, ``budget_s``);
        ``load_records()`` returns the load's records so far (called while the load is paused)."""
        self.t0, self.deadline, self.gate, self.load_records = t0, deadline, gate, load_records
        info = self.local.info
        with httpx.Client(base_url=info.url, timeout=30) as http:
            self.tenant = new_tenant(http, info.admin_key, quotas={"requests_per_minute": 10**6,
                                                                   "tokens_per_minute": 10**8,
                                                                   "max_concurrency": 1000})
        self._thread = threading.Thread(target=self._main, name="fault-schedule", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float = 300) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the fault schedule did not finish within {timeout_s} s")

    def now(self) -> float:
        return time.time() - self.t0

    def budget_s(self, fault: str) -> float:
        """Seconds a fault needs from injection to the end of its invariant check (to fit before the deadline)."""
        return self.hold_s + {"engine": 45.0, "s3_slow": 15.0, "disconnect": 10.0}.get(fault, 12.0)

    def _main(self) -> None:
        try:
            i = 0
            while not self._stop.wait(self.interval_s if i else min(self.interval_s, 5.0)):
                fault = self.faults[i % len(self.faults)]
                if time.time() + self.budget_s(fault) > self.deadline or (
                        self.max_rounds is not None and i >= self.max_rounds * len(self.faults)):
                    return
                inj = Injection(fault=fault, round=i // len(self.faults) + 1, injected_s=self.now())
                self.injections.append(inj)
                i += 1
                try:
                    getattr(self, "_" + fault)(inj)
                except Exception as e:  # noqa: BLE001 - recorded in the report; the stack is restored below
                    inj.error = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                finally:
                    self._restore_all()
                self._check(inj)
                broken = {k: v for k, v in inj.invariants.items() if not v["ok"]}
                print(f"fault {fault} #{inj.round} at {inj.injected_s:.1f}s: hold {_r(inj.hold_s)} s, recovery "
                      f"{_r(inj.recovery_s)} s, invariants {'FAILED ' + str(broken)[:500] if broken else 'ok'}"
                      f"{'' if not inj.error else ', error ' + inj.error}", flush=True)
        except Exception:  # noqa: BLE001 - the run goes on; the report says the schedule crashed
            self.crashed = traceback.format_exc()
            print(self.crashed, flush=True)

    def _restore_all(self) -> None:
        """Whatever happened, the stack is whole again before the next fault."""
        s = self.local
        s.proxy.up()
        if s.redis.proc is None or s.redis.proc.poll() is not None:
            s.redis.start()
        else:
            _redis_command(s.redis.url, "CLIENT", "UNPAUSE")
        if hasattr(s.pg, "proxy") or not _port_open(s.pg.port):     # the proxy fallback: up() is idempotent
            s.pg.start()
        for e in s.engines:
            if e.proc is None or e.proc.poll() is not None:
                e.start()
                e.wait_ready(180)

    def _check(self, inj: Injection) -> None:
        """Pauses the load, checks every invariant (answers and usage: of the requests started since the last
        check, so that each fault's row shows its own breakage; the end of the run checks them all), resumes."""
        try:
            inj.pause_s = round(self.gate.pause(self.check_timeout_s), 3)
            since, self._since = self._since, self.now()
            records = [r for r in self.load_records() + list(self.records) if r.started_s >= since]
            excuse(records, self.injections)
            inj.invariants = check_all(self.local.info, records, lease_timeout_s=STALL_LEASE_TIMEOUT_S
                                       if inj.fault == "redis_stall" else 10.0)
        except Exception as e:  # noqa: BLE001 - recorded; the load must go on
            inj.invariants = {"check": {"ok": False, "detail": f"{type(e).__name__}: {e}"}}
        finally:
            self.gate.resume()

    # -- probes -------------------------------------------------------------------------------------------------
    def _request(self, fault: str, method: str, path: str, *, inference: bool, **kw) -> Record:
        """One request of the schedule's tenant, kept as a ``Record`` (scenario ``probe``); only inference
        answers carry their request id (those must have a usage record)."""
        info = self.local.info
        t = time.time()
        status, kind, rid = 0, "ok", None
        try:
            r = httpx.request(method, info.url + path, headers={"Authorization": f"Bearer {self.tenant['key']}"},
                              timeout=60, **kw)
            status, kind = r.status_code, error_kind(r.status_code, r.content)
            rid = r.headers.get("x-request-id") if inference else None
        except httpx.HTTPError as e:
            kind = f"transport:{type(e).__name__}"
        rec = Record(scenario="probe", tenant=self.tenant["id"], model=f"{method} {path}", status=status, kind=kind,
                     latency_ms=(time.time() - t) * 1000, started_s=t - self.t0, request_id=rid,
                     expected=kind == "ok" or kind in ALLOWED[fault])
        self.records.append(rec)
        return rec

    def _complete(self, fault: str, model: str | None = None) -> Record:
        return self._request(fault, "POST", "/v1/completions", inference=True,
                             json={"model": model or self.local.info.base_model, "prompt": "hi", "max_tokens": 1})

    def _upload(self, fault: str, prefix: str) -> tuple[Record, str]:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        files = rank1_adapter(self.local.info.base_model_path, value=0.04)
        rec = self._request(fault, "POST", "/v1/adapters", inference=False, data={"name": name},
                            files=[("files", (n, b)) for n, b in files.items()])
        return rec, name

    def _until(self, inj: Injection, ok: Callable[[], bool], interval_s: float = 0.1) -> None:
        """Polls ``ok`` after the restore; ``recovered_s`` at its first success."""
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S.get(inj.fault, 30.0)
        while time.monotonic() < deadline:
            if ok():
                inj.recovered_s = self.now()
                return
            time.sleep(interval_s)
        raise TimeoutError(f"{inj.fault}: no success within {RECOVERY_TIMEOUT_S.get(inj.fault, 30.0)} s after "
                           "the restore")

    # -- the faults ---------------------------------------------------------------------------------------------
    def _engine(self, inj: Injection) -> None:
        engines = self.local.engines
        victim = engines[(inj.round - 1) % len(engines)]
        victim.kill()
        inj.figures["during_kind"] = f"exit {victim.proc.returncode}"       # -9: SIGKILLed
        time.sleep(self.hold_s)
        inj.restored_s = self.now()
        victim.start()
        victim.wait_ready(180)
        inj.figures["restart_to_ready_s"] = _r(self.now() - inj.restored_s)
        inj.figures["engine"] = victim.url

        def served() -> bool:
            try:
                return admissions(victim.url) > 0
            except httpx.HTTPError:
                return False
        self._until(inj, served)

    def _redis(self, inj: Injection) -> None:
        self.local.redis.kill()
        inj.figures["during_kind"] = self._complete("redis").kind
        time.sleep(self.hold_s)
        inj.restored_s = self.now()
        self.local.redis.start()
        self._until(inj, lambda: self._complete("redis").kind == "ok")

    def _redis_stall(self, inj: Injection) -> None:
        """Writes (every quota script) block for ``hold_s`` while the load runs: acquires time out and fail closed,
        streams that end meanwhile cannot release their leases until it is over. The pause is set for longer and
        lifted by hand (``CLIENT UNPAUSE``) once ``hold_s`` has passed and the probe has its answer, so a probe the
        loaded machine delays still lands inside it (Redis itself ends the pause after PAUSE_SLACK_S at worst)."""
        start = time.monotonic()
        _redis_command(self.local.redis.url, "CLIENT", "PAUSE", str(int((self.hold_s + PAUSE_SLACK_S) * 1000)),
                       "WRITE")
        inj.figures["during_kind"] = self._complete("redis_stall").kind
        time.sleep(max(0.0, self.hold_s - (time.monotonic() - start)))
        _redis_command(self.local.redis.url, "CLIENT", "UNPAUSE")
        inj.restored_s = self.now()
        self._until(inj, lambda: self._complete("redis_stall").kind == "ok")

    def _postgres(self, inj: Injection) -> None:
        self.local.pg.stop("immediate")
        time.sleep(1.1)                                   # the gateway's auth cache (AUTH_CACHE_S = 1 s) runs out
        inj.figures["during_kind"] = self._request("postgres", "GET", "/v1/adapters?limit=1", inference=False).kind
        time.sleep(max(0.0, self.hold_s - 1.1))
        inj.restored_s = self.now()
        self.local.pg.start()
        self._until(inj, lambda: self._request("postgres", "GET", "/v1/adapters?limit=1",
                                               inference=False).kind == "ok")

    def _s3_down(self, inj: Injection) -> None:
        self.local.proxy.down()
        inj.figures["during_kind"] = self._upload("s3_down", "down")[0].kind
        time.sleep(self.hold_s)
        inj.restored_s = self.now()
        self.local.proxy.up()
        self._until(inj, lambda: self._upload("s3_down", "probe")[0].kind == "ok", interval_s=0.2)

    def _s3_slow(self, inj: Injection) -> None:
        self.local.proxy.slow(self.slow_delay_s)
        start = time.monotonic()
        rec, name = self._upload("s3_slow", "slow")
        inj.figures["upload_ms"] = round(rec.latency_ms)
        inj.figures["upload_kind"] = rec.kind
        if rec.kind == "ok":
            cold = self._complete("s3_slow", name)            # never loaded anywhere: fetched through the slow proxy
            inj.figures["cold_load_ms"] = round(cold.latency_ms)
            inj.figures["cold_load_kind"] = cold.kind
        time.sleep(max(0.0, self.hold_s - (time.monotonic() - start)))
        inj.figures["slow_delay_per_chunk_s"] = self.slow_delay_s
        inj.restored_s = self.now()
        self.local.proxy.up()
        self._until(inj, lambda: self._upload("s3_slow", "probe")[0].kind == "ok", interval_s=0.2)

    def _disconnect(self, inj: Injection) -> None:
        from load_tests.streaming import one_completion, one_stream

        info = self.local.info
        owner = self.pop.adapters[0]["tenant"]
        models = [a["name"] for a in self.pop.adapters if a["tenant"] == owner][:4]
        tenant = self.pop.tenants[owner]

        async def main() -> list[Record]:
            async with httpx.AsyncClient(base_url=info.url, timeout=60) as http:
                streams = [one_stream(http, tenant, models[i % len(models)], max_tokens=96, t0=self.t0,
                                      disconnect_after=2, scenario="probe") for i in range(8)]
                wholes = [one_completion(http, tenant, models[i % len(models)], max_tokens=96, t0=self.t0,
                                         scenario="probe", timeout_s=0.3) for i in range(6)]
                return list(await asyncio.gather(*streams, *wholes))

        records = asyncio.run(main())
        for r in records:
            r.expected = r.kind in ("ok", "client_disconnect")
        self.records.extend(records)
        inj.restored_s = inj.recovered_s = self.now()
        inj.figures["disconnects"] = sum(r.kind == "client_disconnect" for r in records)
        inj.figures["requests"] = len(records)


def _redis_command(url: str, *args: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        client.execute_command(*args)
    finally:
        client.close()


def _port_open(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def late(records: list[Record], injections: list[Injection]) -> dict[str, dict[str, int]]:
    """Outcomes a fault allows that came after its window (recovery + ``GRACE_S``) and before the next one of the
    same kind, still unexpected: {fault: {kind: n}} (e.g. stale pooled connections failing after a restart)."""
    out: dict[str, Counter] = {}
    for r in records:
        if r.expected:
            continue
        before = [i for i in injections if r.kind in ALLOWED[i.fault] and i.window()[1] + GRACE_S < r.started_s]
        if before:
            out.setdefault(before[-1].fault, Counter())[r.kind] += 1
    return {k: dict(v) for k, v in out.items()}


def summarize_faults(injections: list[Injection], records: list[Record], excused: dict, crashed: str | None) -> dict:
    """The fault-matrix section of the report: every injection, and per fault the aggregate figures."""
    load = [r for r in records if r.scenario != "probe"]
    stragglers = late(records, injections)
    rows = []
    for inj in injections:
        rows.append({**inj.as_dict(), "requests_during": during(load, inj)})
    by_fault = {}
    for fault in dict.fromkeys(i.fault for i in injections):
        mine = [r for r in rows if r["fault"] == fault]
        rec = sorted(r["recovery_s"] for r in mine if r["recovery_s"] is not None)
        totals = Counter()
        for r in mine:
            totals.update(r["requests_during"])
        by_fault[fault] = {
            "injected": len(mine), "recovered": len(rec), "errors": [r["error"] for r in mine if r["error"]],
            "hold_s": [min(r["hold_s"] or 0 for r in mine), max(r["hold_s"] or 0 for r in mine)],
            "recovery_s": {"min": rec[0], "median": rec[len(rec) // 2], "max": rec[-1]} if rec else None,
            "requests_during": dict(totals), "excused": excused.get(fault, {}), "late": stragglers.get(fault, {}),
            "invariants_ok": sum(r["invariants_ok"] for r in mine),
            "figures": {k: [r["figures"][k] for r in mine if k in r["figures"]]
                        for k in dict.fromkeys(k for r in mine for k in r["figures"])}}
    return {"injections": rows, "by_fault": by_fault, "crashed": crashed, "allowed": {k: sorted(v) for k, v in
                                                                                     ALLOWED.items()}}
