"""What must hold after any load or fault, checked over public interfaces only (SQL, Redis, S3, engine HTTP):

    usage      every answered request (200, or a stream the client left after tokens came) has exactly one usage
               record with its request id
    leases     no quota lease is left in Redis (``<prefix>:{tenant}:leases`` are all empty)
    kv         every engine is idle with all KV blocks free (``/v1/stats``: kv_blocks_free == kv_blocks_total)
    blobs      no blob without a ready version, no ready version without its blob
    answers    every request was answered or failed with a clear error the scenario allows

    stack = Stack(url=..., database_url=..., redis_url=..., quota_key_prefix=..., s3_endpoint=..., s3_bucket=...,
                  engine_urls=[...])
    results = check_all(stack, records)     # {name: {"ok": bool, "detail": str, ...figures}}
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import httpx

from load_tests.records import Record


@dataclass
class Stack:
    url: str
    admin_key: str
    database_url: str
    redis_url: str | None
    quota_key_prefix: str
    s3_endpoint: str | None
    s3_bucket: str | None
    engine_urls: list[str] = field(default_factory=list)
    base_model_path: str | None = None
    base_model: str = "base"
    max_model_len: int = 256
    s3_access_key_id: str = "testing"
    s3_secret_access_key: str = "testing"


def _poll(check: Callable[[], tuple[bool, dict]], timeout_s: float) -> tuple[bool, dict]:
    """Repeats ``check`` until it holds or ``timeout_s`` passed; returns the last result (plus seconds waited)."""
    start = time.monotonic()
    while True:
        ok, detail = check()
        if ok or time.monotonic() - start > timeout_s:
            return ok, {**detail, "waited_s": round(time.monotonic() - start, 2)}
        time.sleep(0.2)


def answered_ids(records: list[Record]) -> list[str]:
    """Request ids that must have a usage record: 200 answers and streams the client left after tokens."""
    return [r.request_id for r in records if r.request_id and r.status == 200
            and (r.kind == "ok" or (r.kind == "client_disconnect" and r.ttft_ms is not None))]


def check_usage(stack: Stack, records: list[Record], timeout_s: float = 15) -> tuple[bool, dict]:
    import sqlalchemy as sa

    want = set(answered_ids(records))
    engine = sa.create_engine(stack.database_url, pool_pre_ping=True)

    def check() -> tuple[bool, dict]:
        try:
            with engine.connect() as c:
                rows = c.execute(sa.text("SELECT request_id, count(*) FROM usage_records GROUP BY request_id")).all()
        except sa.exc.OperationalError as e:
            return False, {"detail": f"database unreachable: {e.__class__.__name__}"}
        counts = dict(rows)
        missing = [i for i in want if i not in counts]
        dupes = [i for i, n in counts.items() if n > 1]
        return not missing and not dupes, {"expected": len(want), "missing": len(missing), "duplicates": len(dupes),
                                           "detail": f"missing {missing[:3]} duplicated {dupes[:3]}"}
    try:
        return _poll(check, timeout_s)
    finally:
        engine.dispose()


def check_leases(stack: Stack, timeout_s: float = 10) -> tuple[bool, dict]:
    if not stack.redis_url:
        return True, {"detail": "in-process quota store (no Redis)"}
    import redis

    client = redis.Redis.from_url(stack.redis_url, socket_timeout=2)

    def check() -> tuple[bool, dict]:
        try:
            left = {k.decode(): client.zcard(k) for k in client.scan_iter(match=f"{stack.quota_key_prefix}:*:leases")}
        except redis.exceptions.RedisError as e:
            return False, {"detail": f"redis unreachable: {e.__class__.__name__}"}
        held = {k: n for k, n in left.items() if n}
        return not held, {"leases_held": sum(held.values()), "detail": f"held: {dict(list(held.items())[:3])}"}
    try:
        return _poll(check, timeout_s)
    finally:
        client.close()


def check_kv(stack: Stack, timeout_s: float = 15, down: set[str] = frozenset()) -> tuple[bool, dict]:
    def check() -> tuple[bool, dict]:
        bad = {}
        for url in stack.engine_urls:
            if url in down:
                continue
            try:
                s = httpx.get(url + "/v1/stats", timeout=5).json()
            except httpx.HTTPError as e:
                bad[url] = f"unreachable: {e.__class__.__name__}"
                continue
            if s["requests_running"] or s["requests_waiting"] or s["kv_blocks_free"] != s["kv_blocks_total"]:
                bad[url] = {k: s[k] for k in ("requests_running", "requests_waiting", "kv_blocks_free",
                                              "kv_blocks_total")}
        return not bad, {"engines": len(stack.engine_urls) - len(down), "detail": str(bad)[:500]}
    return _poll(check, timeout_s)


def _s3(stack: Stack):
    import boto3

    return boto3.client("s3", endpoint_url=stack.s3_endpoint, region_name="us-east-1",
                        aws_access_key_id=stack.s3_access_key_id, aws_secret_access_key=stack.s3_secret_access_key)


def check_blobs(stack: Stack, timeout_s: float = 10) -> tuple[bool, dict]:
    """Orphans (a blob no ready version points at) and ready versions whose blob is missing. Polled: a DELETE
    commits the registry first, then waits for engines to evict (retried while a request uses the adapter), then
    removes the blob, so a blob may outlive its rows for a few seconds."""
    if not stack.s3_bucket:
        return True, {"detail": "local blob store: not checked"}
    import sqlalchemy as sa

    engine = sa.create_engine(stack.database_url)
    prefix = f"s3://{stack.s3_bucket}/"

    def check() -> tuple[bool, dict]:
        with engine.connect() as c:
            rows = c.execute(sa.text("SELECT status, blob_uri FROM adapter_versions")).all()
        ready = {uri[len(prefix):] for status, uri in rows if str(status).lower().endswith("ready") and uri}
        keys = set()
        for page in _s3(stack).get_paginator("list_objects_v2").paginate(Bucket=stack.s3_bucket):
            keys |= {o["Key"] for o in page.get("Contents", [])}
        orphans, missing = keys - ready, ready - keys
        rows_of_orphans = sorted({str(st) for st, uri in rows if uri and uri[len(prefix):] in orphans})
        return not orphans and not missing, {
            "blobs": len(keys), "ready_versions": len(ready), "orphans": len(orphans),
            "ready_without_blob": len(missing), "orphan_row_statuses": rows_of_orphans,
            "detail": f"orphans {sorted(orphans)[:3]} missing {sorted(missing)[:3]}"}
    try:
        return _poll(check, timeout_s)
    finally:
        engine.dispose()


def check_answers(records: list[Record]) -> tuple[bool, dict]:
    unexpected = Counter(f"{r.scenario}:{r.kind}" for r in records if not r.expected)
    unclear = Counter(r.kind for r in records if r.kind.startswith("unclear"))
    return not unexpected and not unclear, {"requests": len(records), "unexpected": dict(unexpected),
                                            "unclear": dict(unclear)}


def check_all(stack: Stack, records: list[Record], *, down: set[str] = frozenset(),
              lease_timeout_s: float = 10.0) -> dict[str, dict]:
    """Every invariant; ``down`` names engines that are expected to be unreachable; leases are polled up to
    ``lease_timeout_s``."""
    out = {}
    for name, fn in (("answers", lambda: check_answers(records)), ("usage", lambda: check_usage(stack, records)),
                     ("leases", lambda: check_leases(stack, lease_timeout_s)),
                     ("kv", lambda: check_kv(stack, down=down)),
                     ("blobs", lambda: check_blobs(stack))):
        ok, detail = fn()
        out[name] = {"ok": ok, **detail}
    return out


def failed(results: dict[str, dict]) -> dict[str, dict]:
    return {k: v for k, v in results.items() if not v["ok"]}
