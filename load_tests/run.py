"""CLI of the load scenarios: start (or point at) a platform, register the population, run the scenarios, check the
invariants, write ``report.json`` and ``report.md``.

    python -m load_tests.run --scenario all --duration 300 --spawn --out load-report/
    python -m load_tests.run --scenario zipf,stream --duration 60 --url http://gw:8000 --admin-key KEY \
        --engine-url http://e0:8001 --database-url postgresql+psycopg://... --redis-url redis://... \
        --s3-endpoint http://s3:9000 --s3-bucket adapters --base-model-path /models/base

Scenarios: zipf (Locust, Zipf over the population), burst (tenants over quota), churn (uploads + deletes while
inference runs), long (prompts filling the context), stream (asyncio streaming client: TTFT, inter-token gaps,
some clients disconnect). ``all`` = every one at once. Exit status 1 when an invariant fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from load_tests.invariants import Stack, check_all, failed
from load_tests.population import Population, populate
from load_tests.records import read_records
from load_tests.report import summarize, write_reports
from load_tests.streaming import stream_load

SCENARIOS = ("zipf", "burst", "churn", "long", "stream")
LOCUST_WEIGHTS = {"zipf": 10, "burst": 1, "churn": 1, "long": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m load_tests.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="all", help=f"comma list of {', '.join(SCENARIOS)}, or all")
    p.add_argument("--duration", type=float, default=60, help="seconds of load")
    p.add_argument("--users", type=int, default=8, help="Locust users")
    p.add_argument("--streams", type=int, default=4, help="concurrent asyncio streams")
    p.add_argument("--tenants", type=int, default=50)
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", default="load-report")
    p.add_argument("--spawn", action="store_true", help="start a local stack (own PostgreSQL, Redis, moto, engines)")
    p.add_argument("--engines", type=int, default=2, help="--spawn: engine processes")
    p.add_argument("--url")
    p.add_argument("--admin-key", default=os.environ.get("LORAPLEX_ADMIN_KEY"))
    p.add_argument("--engine-url", action="append", default=[])
    p.add_argument("--database-url")
    p.add_argument("--redis-url")
    p.add_argument("--quota-key-prefix", default="loraplex:quota")
    p.add_argument("--s3-endpoint")
    p.add_argument("--s3-bucket")
    p.add_argument("--base-model-path", help="the base model folder (adapters are built from its config.json)")
    p.add_argument("--base-model", default=None, help="the served base model name (default: the folder's name)")
    p.add_argument("--max-model-len", type=int, default=256)
    a = p.parse_args(argv)
    a.scenarios = SCENARIOS if a.scenario == "all" else tuple(a.scenario.split(","))
    unknown = set(a.scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    if not a.spawn and not (a.url and a.admin_key and a.database_url and a.base_model_path):
        p.error("without --spawn, give --url, --admin-key, --database-url and --base-model-path")
    return a


def engine_stats(urls: list[str]) -> dict[str, dict]:
    out = {}
    for u in urls:
        try:
            out[u] = httpx.get(u + "/v1/stats", timeout=5).json()
        except httpx.HTTPError:
            out[u] = {}
    return out


def run_load(stack: Stack, pop_path: str, scenarios: tuple[str, ...], *, duration_s: float, users: int,
             streams: int, max_tokens: int, work_dir: str) -> tuple[list, float]:
    """Locust (its own process) and the streaming client side by side; returns (records, seconds)."""
    records_path = os.path.join(work_dir, "records.jsonl")
    open(records_path, "w").close()
    weights = {k: w for k, w in LOCUST_WEIGHTS.items() if k in scenarios}
    proc = None
    t0 = time.time()
    if weights:
        cfg = {"url": stack.url, "population": pop_path, "records": records_path, "users": users,
               "duration_s": duration_s, "weights": weights, "max_tokens": max_tokens,
               "base_model": stack.base_model, "base_model_path": stack.base_model_path,
               "max_model_len": stack.max_model_len}
        cfg_path = os.path.join(work_dir, "locust.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        proc = subprocess.Popen([sys.executable, "-m", "load_tests.locust_worker"],
                                env=dict(os.environ, LORAPLEX_LOAD_CONFIG=cfg_path),
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    streamed = []
    if "stream" in scenarios:
        streamed = asyncio.run(stream_load(stack.url, Population.load(pop_path), duration_s=duration_s,
                                           concurrency=streams, max_tokens=max_tokens * 2, t0=t0))
    if proc is not None:
        rc = proc.wait(duration_s + 120)
        if rc != 0:
            raise RuntimeError(f"the Locust worker exited with {rc}")
    return read_records(records_path) + streamed, time.time() - t0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    local = None
    work_dir = tempfile.mkdtemp(prefix="loraplex-load-")
    if a.spawn:
        from load_tests.stack import LocalStack

        local = LocalStack(os.path.join(work_dir, "stack"), engines=a.engines).start()
        stack = local.info
    else:
        stack = Stack(url=a.url, admin_key=a.admin_key, database_url=a.database_url, redis_url=a.redis_url,
                      quota_key_prefix=a.quota_key_prefix, s3_endpoint=a.s3_endpoint, s3_bucket=a.s3_bucket,
                      engine_urls=a.engine_url, base_model_path=a.base_model_path,
                      base_model=a.base_model or os.path.basename(os.path.normpath(a.base_model_path)),
                      max_model_len=a.max_model_len)
    try:
        t = time.time()
        pop = populate(stack.url, stack.admin_key, stack.base_model_path, tenants=a.tenants, adapters=a.adapters)
        setup_s = time.time() - t
        print(f"registered {a.adapters} adapters for {a.tenants} tenants in {setup_s:.1f} s", flush=True)
        pop_path = os.path.join(work_dir, "population.json")
        pop.save(pop_path)
        before = engine_stats(stack.engine_urls)
        records, secs = run_load(stack, pop_path, a.scenarios, duration_s=a.duration, users=a.users,
                                 streams=a.streams, max_tokens=a.max_tokens, work_dir=work_dir)
        after = engine_stats(stack.engine_urls)
        results = check_all(stack, records)
        summary = summarize(records, secs, engines_before=before, engines_after=after, invariants=results,
                            config={"scenarios": list(a.scenarios), "users": a.users, "streams": a.streams,
                                    "tenants": a.tenants, "adapters": a.adapters, "setup_s": round(setup_s, 1),
                                    "spawned": a.spawn})
        pj, pm = write_reports(summary, a.out)
        print(open(pm).read())
        print(f"reports: {pj} {pm}")
        return 1 if failed(results) else 0
    finally:
        if local is not None:
            local.stop()


if __name__ == "__main__":
    sys.exit(main())
