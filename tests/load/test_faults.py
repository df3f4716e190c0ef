"""Fault injection on the live stack, each with its expected behaviour asserted, then the invariants: no lost
usage record, no leaked KV block or quota lease, no orphan blob, no ready version without its blob, every request
answered or failed with a clear error. Figures (latencies, recovery times) go to LORAPLEX_FAULT_REPORT.

| fault                       | expected                                                                            |
|-----------------------------|-------------------------------------------------------------------------------------|
| engine replica killed       | streams on it that already sent tokens end with an SSE error event + [DONE]; nothing|
|                             | else fails (fail-over); the restarted replica takes traffic again within seconds     |
| Redis down / restarted      | 503 quota_store_unavailable within QUOTA_TIMEOUT_S (fail closed); requests in flight |
|                             | are still answered; 200s again once Redis is back; no lease left                     |
| PostgreSQL down / restarted | requests needing the database fail with a clear 503; answered requests' usage is     |
|                             | written after the restart (kept in memory meanwhile); 200s again once it is back     |
| S3 down                     | uploads 503 (no row ready, no blob); resident adapters keep serving; a cold adapter  |
|                             | fails with a clear error; deletes 503 and finish when repeated after S3 is back      |
| S3 slow                     | uploads and cold loads succeed, slower                                               |
| clients disconnect          | engine requests aborted (KV freed), leases released, usage recorded for started ones |
"""
from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from load_tests.adapters import rank1_adapter
from load_tests.invariants import check_blobs, check_kv, check_leases, check_usage
from load_tests.population import new_tenant, upload
from load_tests.streaming import one_completion, one_stream
from tests.load.conftest import Background
from tests.load.faults import clear, record_figures, wait_for


def assert_invariants(stack, records, *, down: frozenset = frozenset()) -> None:
    info = stack.info
    for name, (ok, detail) in (("usage", check_usage(info, records)), ("leases", check_leases(info)),
                               ("kv", check_kv(info, down=down)), ("blobs", check_blobs(info))):
        assert ok, f"invariant {name} broken: {detail}"


def tenant_models(population, i: int = 0) -> tuple[dict, list[str]]:
    return population.tenants[i], [a["name"] for a in population.adapters if a["tenant"] == i][:4]


def admissions(engine) -> int:
    s = engine.stats()
    c = s.get("adapter_counters", {})
    return c.get("activations", 0) + c.get("slot_hits", 0) + s.get("prefix_cache_queries", 0)


def test_engine_replica_killed_and_restarted(stack, population):
    tenant, models = tenant_models(population, 0)
    bg = Background(stack.info.url, tenant, models, concurrency=4, stream=True, max_tokens=48)
    time.sleep(2.0)
    victim = stack.engines[0]
    t_kill = time.time()
    victim.kill()
    time.sleep(3.0)
    victim.start()
    victim.wait_ready()
    t_ready = time.time()
    rejoin_s = wait_for(lambda: admissions(victim) > 0, 30, "the restarted replica to take traffic again")
    time.sleep(1.0)
    records = bg.stop()
    failed = [r for r in records if r.kind != "ok"]
    assert all(clear(r.kind) for r in failed), sorted({r.kind for r in failed})
    # only streams that had already sent tokens fail (no replay after the first token); the rest failed over
    assert all(r.ttft_ms is not None and r.started_s + bg.t0 < t_kill for r in failed), \
        [(r.kind, r.ttft_ms, r.started_s + bg.t0 - t_kill) for r in failed]
    assert len(failed) <= bg.concurrency
    after = [r for r in records if r.started_s + bg.t0 > t_kill]
    assert after and all(r.kind == "ok" for r in after)
    assert_invariants(stack, records)
    record_figures("engine_kill_restart", requests=len(records), cut_streams=len(failed),
                   cut_kinds=sorted({r.kind for r in failed}), failed_after_kill=0, restart_to_ready_s=
                   t_ready - t_kill - 3.0, ready_to_traffic_s=rejoin_s,
                   p99_latency_ms=sorted(r.latency_ms for r in records)[int(0.99 * (len(records) - 1))])


def test_redis_killed_and_restarted(stack, population):
    info = stack.info
    with httpx.Client(base_url=info.url, timeout=30) as http:
        tenant = new_tenant(http, info.admin_key, quotas={"requests_per_minute": 100000, "max_concurrency": 50})
    bg = Background(info.url, tenant, [info.base_model], concurrency=3, stream=False, max_tokens=4)
    time.sleep(1.5)
    t_down = time.time()
    stack.redis.kill()
    time.sleep(2.5)
    stack.redis.start()
    t_up = time.time()
    recover_s = wait_for(lambda: any(r.kind == "ok" and r.started_s + bg.t0 > t_up for r in bg.records), 30,
                         "200s once Redis is back")
    time.sleep(1.0)
    records = bg.stop()
    kinds = {r.kind for r in records}
    assert kinds <= {"ok", "quota_store_unavailable"}, kinds
    refused = [r for r in records if r.kind == "quota_store_unavailable"]
    assert refused, "Redis was down 2.5 s and nothing was refused: the quota store was not consulted"
    assert all(r.status == 503 for r in refused)
    assert max(r.latency_ms for r in refused) < (info_timeout := 0.5) * 1000 * 2 + 1000, info_timeout
    assert all(r.started_s + bg.t0 > t_down - 0.5 for r in refused)
    assert_invariants(stack, records)
    record_figures("redis_restart", requests=len(records), refused_503=len(refused),
                   refused_latency_p50_ms=sorted(r.latency_ms for r in refused)[len(refused) // 2],
                   refused_latency_max_ms=max(r.latency_ms for r in refused), up_to_first_200_s=recover_s)


def test_postgres_stopped_and_restarted(stack, population):
    tenant, models = tenant_models(population, 1)
    bg = Background(stack.info.url, tenant, models, concurrency=3, stream=False, max_tokens=4)
    time.sleep(1.5)
    t_down = time.time()
    stack.pg.stop("immediate")
    time.sleep(3.0)
    stack.pg.start()
    t_up = time.time()
    recover_s = wait_for(lambda: any(r.kind == "ok" and r.started_s + bg.t0 > t_up for r in bg.records), 30,
                         "200s once PostgreSQL is back")
    time.sleep(1.0)
    records = bg.stop()
    failed = [r for r in records if r.kind != "ok"]
    assert all(clear(r.kind) and r.status == 503 for r in failed), sorted({(r.status, r.kind) for r in failed})
    assert failed, "PostgreSQL was down 3 s and every request succeeded: nothing was resolved from the database"
    answered_during = [r for r in records if r.kind == "ok" and t_down < r.started_s + bg.t0 < t_up]
    assert_invariants(stack, records)     # includes the usage of requests answered while the database was down
    record_figures("postgres_restart", requests=len(records), failed_503=len(failed),
                   failed_kinds=sorted({r.kind for r in failed}), answered_while_down=len(answered_during),
                   failed_latency_max_ms=max(r.latency_ms for r in failed), up_to_first_200_s=recover_s)


def test_s3_down_then_slow(stack, population):
    info = stack.info
    tenant, models = tenant_models(population, 2)
    headers = {"Authorization": f"Bearer {tenant['key']}"}
    files = rank1_adapter(info.base_model_path, value=0.03)
    with httpx.Client(base_url=info.url, timeout=60) as http:
        def infer(model: str) -> httpx.Response:
            return http.post("/v1/completions", headers=headers,
                             json={"model": model, "prompt": "hi", "max_tokens": 2})

        warm, cold, cold2, doomed = models[0], *(f"{p}-{uuid.uuid4().hex[:6]}" for p in ("cold", "cold2", "doomed"))
        assert infer(warm).status_code == 200                 # resident on some replica now
        for name in (cold, cold2, doomed):
            assert upload(http, tenant["key"], name, files).status_code == 201
        try:
            figures = _s3_outage(stack, http, tenant, files, infer, warm, cold, cold2, doomed)
        finally:
            stack.proxy.up()
        r = http.delete(f"/v1/adapters/{doomed}", headers=headers)   # repeating the DELETE finishes the job
        assert r.status_code in (200, 204), r.text
        assert http.get(f"/v1/adapters/{doomed}", headers=headers).status_code == 404
    assert_invariants(stack, [])
    record_figures("s3_down_slow", **figures, slow_delay_per_chunk_s=0.3)


def _s3_outage(stack, http, tenant, files, infer, warm, cold, cold2, doomed) -> dict:
    headers = {"Authorization": f"Bearer {tenant['key']}"}
    stack.proxy.down()
    t = time.time()
    r = upload(http, tenant["key"], f"new-{uuid.uuid4().hex[:6]}", files)
    upload_down_s = time.time() - t
    assert r.status_code == 503 and "blob store is unavailable" in r.json()["error"]["message"], r.text
    warm_statuses = [infer(warm).status_code for _ in range(3)]
    assert warm_statuses == [200] * 3                     # resident adapters do not need S3
    t = time.time()
    r = infer(cold)
    cold_down_s = time.time() - t
    # a clear, retryable error naming the blob store, not a hang (also test_cold_adapter_during_s3_outage...)
    assert r.status_code == 503 and "temporarily unavailable; retry shortly" in r.json()["error"]["message"], r.text
    assert "s3://" not in r.text and "http://" not in r.text                      # sanitised for the tenant
    cold_status, cold_code = r.status_code, r.json()["error"].get("code")
    r = http.delete(f"/v1/adapters/{doomed}", headers=headers)
    assert r.status_code == 503 and r.json()["error"]["message"], r.text
    stack.proxy.slow(0.3)
    t = time.time()
    r = upload(http, tenant["key"], f"slow-{uuid.uuid4().hex[:6]}", files)
    upload_slow_s = time.time() - t
    assert r.status_code == 201, r.text
    t = time.time()
    r = infer(cold2)                                      # never tried before: a cold load through slow S3
    cold_slow_s = time.time() - t
    assert r.status_code == 200, r.text
    return dict(upload_down_s=upload_down_s, cold_inference_down_s=cold_down_s,
                cold_inference_down_status=cold_status, cold_inference_down_code=cold_code,
                upload_slow_s=upload_slow_s, cold_inference_slow_s=cold_slow_s)


def test_adapter_that_failed_during_s3_outage_loads_once_s3_is_back(stack, population):
    info = stack.info
    tenant = population.tenants[5]
    headers = {"Authorization": f"Bearer {tenant['key']}"}
    name = f"retry-{uuid.uuid4().hex[:6]}"
    body = {"model": name, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=info.url, timeout=60) as http:
        assert upload(http, tenant["key"], name, rank1_adapter(info.base_model_path, value=0.06)).status_code == 201
        stack.proxy.down()
        try:
            assert http.post("/v1/completions", headers=headers, json=body).status_code >= 400
        finally:
            stack.proxy.up()
        statuses = [http.post("/v1/completions", headers=headers, json=body).status_code for _ in range(3)]
    assert statuses == [200] * 3, statuses


def test_cold_adapter_during_s3_outage_is_a_retryable_503(stack, population):
    info = stack.info
    tenant = population.tenants[4]
    headers = {"Authorization": f"Bearer {tenant['key']}"}
    name = f"cold-{uuid.uuid4().hex[:6]}"
    with httpx.Client(base_url=info.url, timeout=60) as http:
        assert upload(http, tenant["key"], name, rank1_adapter(info.base_model_path, value=0.05)).status_code == 201
        stack.proxy.down()
        try:
            r = http.post("/v1/completions", headers=headers, json={"model": name, "prompt": "hi", "max_tokens": 2})
        finally:
            stack.proxy.up()
    assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text[:300])


def test_clients_that_disconnect(stack, population):
    info = stack.info
    tenant, models = tenant_models(population, 3)
    with httpx.Client(base_url=info.url, timeout=30) as http:
        limited = new_tenant(http, info.admin_key, quotas={"max_concurrency": 4, "tokens_per_minute": 10**6})
    base = info.base_model

    async def main():
        t0 = time.time()
        async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
            streams = [one_stream(http, limited, base, max_tokens=96, t0=t0, disconnect_after=2) if i % 2 else
                       one_stream(http, tenant, models[i % len(models)], max_tokens=96, t0=t0, disconnect_after=2)
                       for i in range(8)]
            wholes = [one_completion(http, tenant, models[i % len(models)], max_tokens=96, t0=t0, timeout_s=0.3)
                      for i in range(6)]
            return await asyncio.gather(*streams, *wholes)

    t = time.time()
    records = asyncio.run(main())
    kinds = {r.kind for r in records}
    assert kinds <= {"client_disconnect", "ok"}, kinds
    assert sum(r.kind == "client_disconnect" for r in records) >= 8
    settle_s = wait_for(lambda: check_kv(info, timeout_s=0)[0] and check_leases(info, timeout_s=0)[0], 20,
                        "KV blocks and leases to be released after the disconnects")
    assert_invariants(stack, records)
    record_figures("client_disconnect", disconnects=sum(r.kind == "client_disconnect" for r in records),
                   release_after_last_disconnect_s=settle_s, run_s=time.time() - t)
