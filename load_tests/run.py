"""CLI of the load scenarios: start (or point at) a platform, register the population, run the scenarios, check the
invariants, write ``report.json`` and ``report.md``.

    python -m load_tests.run --scenario all --duration 300 --spawn --out load-report/
    python -m load_tests.run --scenario zipf,stream --duration 60 --url http://gw:8000 --admin-key KEY \
        --engine-url http://e0:8001 --database-url postgresql+psycopg://... --redis-url redis://... \
        --s3-endpoint http://s3:9000 --s3-bucket adapters --base-model-path /models/base
    python -m load_tests.run --spawn --scenario all --duration 1500 --faults all --fault-interval 30 --out rep/

Scenarios: zipf (Locust, Zipf over the population), burst (tenants over quota), churn (uploads + deletes while
inference runs), long (prompts filling the context), stream (asyncio streaming client: TTFT, inter-token gaps,
some clients disconnect). ``all`` = every one at once. ``--faults`` (needs ``--spawn``): while they run, the
fault schedule of ``faults.py`` breaks the stack in turn (engine, redis, redis_stall, postgres, s3_down,
s3_slow, disconnect), checks every invariant after each fault and adds a fault matrix to the report. Exit status 1
when an invariant fails (after any fault or at the end) or a fault was not injected and recovered cleanly.
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

from load_tests.faults import FAULTS, FaultSchedule, excuse, summarize_faults
from load_tests.gate import Gate
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
    p.add_argument("--faults", default="", help=f"--spawn: comma list of {', '.join(FAULTS)}, or all")
    p.add_argument("--fault-interval", type=float, default=30, help="seconds of plain load between faults")
    p.add_argument("--fault-hold", type=float, default=3, help="seconds each fault is held before the restore")
    p.add_argument("--slow-delay", type=float, default=0.3, help="s3_slow: seconds added to every chunk")
    a = p.parse_args(argv)
    a.fault_list = list(FAULTS) if a.faults == "all" else [f for f in a.faults.split(",") if f]
    if set(a.fault_list) - set(FAULTS):
        p.error(f"unknown fault(s) {sorted(set(a.fault_list) - set(FAULTS))}; choose from {FAULTS}")
    if a.fault_list and not a.spawn:
        p.error("--faults needs --spawn: faults are injected into the stack this command starts")
    if a.fault_interval <= 0 or a.fault_hold <= 0:
        p.error("--fault-interval and --fault-hold must be > 0")
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
             streams: int, max_tokens: int, work_dir: str, faults: FaultSchedule | None = None) -> tuple[list, float]:
    """Locust (its own process) and the streaming client side by side, and the fault schedule if given (it
    pauses both for its invariant checks); returns (records, seconds), the schedule's own requests included."""
    records_path = os.path.join(work_dir, "records.jsonl")
    open(records_path, "w").close()
    weights = {k: w for k, w in LOCUST_WEIGHTS.items() if k in scenarios}
    gate = Gate(os.path.join(work_dir, "pause"), locust=bool(weights)) if faults else None
    proc = None
    t0 = time.time()
    if weights:
        cfg = {"url": stack.url, "population": pop_path, "records": records_path, "users": users,
               "duration_s": duration_s, "weights": weights, "max_tokens": max_tokens,
               "base_model": stack.base_model, "base_model_path": stack.base_model_path,
               "max_model_len": stack.max_model_len, "t0": t0,
               **({"pause_file": gate.pause_path} if gate else {})}
        cfg_path = os.path.join(work_dir, "locust.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        proc = subprocess.Popen([sys.executable, "-m", "load_tests.locust_worker"],
                                env=dict(os.environ, LORAPLEX_LOAD_CONFIG=cfg_path),
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if gate is not None:
            gate.locust_proc = proc
    streamed: list = []
    try:
        if faults is not None:
            faults.start(t0=t0, deadline=t0 + duration_s, gate=gate,
                         load_records=lambda: read_records(records_path) + list(streamed))
        if "stream" in scenarios:
            asyncio.run(stream_load(stack.url, Population.load(pop_path), duration_s=duration_s,
                                    concurrency=streams, max_tokens=max_tokens * 2, t0=t0, gate=gate,
                                    records=streamed))
        if proc is not None:
            rc = proc.wait(duration_s + 300)
            if rc != 0:
                raise RuntimeError(f"the Locust worker exited with {rc}")
    finally:
        if faults is not None:
            faults.stop()
            faults.join()
    return read_records(records_path) + streamed + (faults.records if faults else []), time.time() - t0


def check_and_report(stack: Stack, records: list, secs: float, *, before: dict, out: str, config: dict,
                     faults: FaultSchedule | None = None) -> tuple[dict, dict, str, str]:
    """Every invariant (after excusing the outcomes each fault allows), the summary and its two files;
    returns (summary, invariant results, report.json path, report.md path)."""
    after = engine_stats(stack.engine_urls)
    excused = excuse(records, faults.injections) if faults else {}
    results = check_all(stack, records)
    summary = summarize(records, secs, engines_before=before, engines_after=after, invariants=results,
                        config=config)
    if faults is not None:
        summary["faults"] = summarize_faults(faults.injections, records, excused, faults.crashed)
    pj, pm = write_reports(summary, out)
    return summary, results, pj, pm


def faults_ok(summary: dict) -> bool:
    """Every injection restored, recovered and followed by holding invariants, and the schedule did not crash."""
    f = summary.get("faults")
    if f is None:
        return True
    return not f["crashed"] and all(i["recovered_s"] is not None and i["invariants_ok"] and not i["error"]
                                    for i in f["injections"])


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
        faults = FaultSchedule(local, pop, a.fault_list, interval_s=a.fault_interval, hold_s=a.fault_hold,
                               slow_delay_s=a.slow_delay) if a.fault_list else None
        before = engine_stats(stack.engine_urls)
        records, secs = run_load(stack, pop_path, a.scenarios, duration_s=a.duration, users=a.users,
                                 streams=a.streams, max_tokens=a.max_tokens, work_dir=work_dir, faults=faults)
        config = {"scenarios": list(a.scenarios), "users": a.users, "streams": a.streams, "tenants": a.tenants,
                  "adapters": a.adapters, "setup_s": round(setup_s, 1), "spawned": a.spawn,
                  "faults": a.fault_list, "fault_interval_s": a.fault_interval, "fault_hold_s": a.fault_hold}
        summary, results, pj, pm = check_and_report(stack, records, secs, before=before, out=a.out, config=config,
                                                    faults=faults)
        print(open(pm).read())
        print(f"reports: {pj} {pm}")
        return 1 if failed(results) or not faults_ok(summary) else 0
    finally:
        if local is not None:
            local.stop()


if __name__ == "__main__":
    sys.exit(main())
