"""Locust users of the load scenarios (a locustfile; ``locust_worker.py`` runs them). Configured by the JSON file
named in ``LORAPLEX_LOAD_CONFIG`` (written by ``run.py``); every request becomes a ``Record`` in ``RECORDS``.

    zipf    inference on adapter rank k with probability ∝ 1/k^s over the whole population
    burst   a tenant over its requests_per_minute: bursts of back-to-back requests (429 + Retry-After expected)
    churn   upload an adapter, infer on it, delete it while a request on it runs, then expect 404
    long    prompts filling the context (prompt + max_tokens = max_model_len), and one token over it (400)

With ``pause_file`` in the config (fault mode, ``gate.py``), every task waits while that file exists; once none
runs, the records so far are appended to the records file and ``<pause_file>.ack`` is written.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import time
import uuid

import functools

import gevent
from locust import HttpUser, between, task

from load_tests.adapters import rank1_adapter
from load_tests.population import Population
from load_tests.records import Record, error_kind

CONFIG = json.load(open(os.environ["LORAPLEX_LOAD_CONFIG"])) if os.environ.get("LORAPLEX_LOAD_CONFIG") else {}
POP = Population.load(CONFIG["population"]) if CONFIG else None
RECORDS: list[Record] = []
T0 = CONFIG.get("t0") or time.time()     # the run's clock, shared with the streaming client and the fault schedule
PAUSED = False
_INFLIGHT = 0
_FLUSHED = 0                             # RECORDS[:_FLUSHED] are in the records file already
_WEIGHTS = list(itertools.accumulate(1.0 / (k + 1) ** CONFIG.get("zipf_s", 1.1)
                                     for k in range(len(POP.adapters)))) if POP else []


def pausable(fn):
    """A task that waits while the load is paused and counts as in flight while it runs."""
    @functools.wraps(fn)
    def run(self) -> None:
        global _INFLIGHT
        while PAUSED:
            gevent.sleep(0.05)
        _INFLIGHT += 1
        try:
            fn(self)
        finally:
            _INFLIGHT -= 1
    return run


def flush_records(path: str) -> int:
    """Appends the records not written yet; returns how many there are in all."""
    global _FLUSHED
    from load_tests.records import write_records

    new = RECORDS[_FLUSHED:]
    _FLUSHED += len(new)
    write_records(path, new)
    return _FLUSHED


def watch_pause(pause_file: str, records_path: str) -> None:
    """A greenlet: pauses the tasks while ``pause_file`` exists; acknowledges once none runs (records flushed)."""
    global PAUSED
    while True:
        if os.path.exists(pause_file):
            PAUSED = True
            while _INFLIGHT:
                gevent.sleep(0.05)
            flush_records(records_path)
            open(pause_file + ".ack", "w").close()
            while os.path.exists(pause_file):
                gevent.sleep(0.05)
            PAUSED = False
        gevent.sleep(0.05)


def _call(user: HttpUser, scenario: str, tenant: dict, model: str, body: dict, *, allowed: set[str],
          path: str = "/v1/completions") -> Record:
    t = time.time()
    status, kind, rid, tokens = 0, "", None, 0
    try:
        r = user.client.post(path, json={"model": model, **body}, name=f"{scenario} {path}",
                             headers={"Authorization": f"Bearer {tenant['key']}"}, timeout=CONFIG.get("timeout_s", 60))
        status, rid = r.status_code, r.headers.get("x-request-id")
        kind = error_kind(status, r.content) if status else f"transport:{type(r.error).__name__}"
        if kind == "ok":
            tokens = r.json().get("usage", {}).get("completion_tokens", 0)
        if status == 429 and not (r.headers.get("retry-after") and r.headers.get("x-ratelimit-limit-requests")):
            kind = "429_without_retry_after"
    except Exception as e:  # noqa: BLE001 - recorded, never raised: a run counts every outcome
        kind = f"transport:{type(e).__name__}"
    rec = Record(scenario=scenario, tenant=tenant["id"], model=model, status=status, kind=kind,
                 latency_ms=(time.time() - t) * 1000, started_s=t - T0, request_id=rid, completion_tokens=tokens,
                 expected=kind in allowed)
    RECORDS.append(rec)
    return rec


class ZipfUser(HttpUser):
    weight = CONFIG.get("weights", {}).get("zipf", 0)
    wait_time = between(0.0, 0.1)

    @task
    @pausable
    def infer(self) -> None:
        a = random.choices(POP.adapters, cum_weights=_WEIGHTS)[0]
        _call(self, "zipf", POP.tenants[a["tenant"]], a["name"],
              {"prompt": "The quick brown fox", "max_tokens": CONFIG.get("max_tokens", 8)}, allowed={"ok"})


class BurstUser(HttpUser):
    weight = CONFIG.get("weights", {}).get("burst", 0)
    wait_time = between(2.0, 4.0)

    @task
    @pausable
    def burst(self) -> None:
        tenant = random.choice(POP.burst_tenants)
        for _ in range(CONFIG.get("burst_size", 20)):
            _call(self, "burst", tenant, CONFIG["base_model"], {"prompt": "hi", "max_tokens": 1},
                  allowed={"ok", "rate_limit_exceeded"})


class ChurnUser(HttpUser):
    weight = CONFIG.get("weights", {}).get("churn", 0)
    wait_time = between(0.5, 1.0)

    @task
    @pausable
    def churn(self) -> None:
        tenant = random.choice(POP.tenants)
        name = f"c-{uuid.uuid4().hex[:10]}"
        headers = {"Authorization": f"Bearer {tenant['key']}"}
        files = rank1_adapter(CONFIG["base_model_path"], value=0.02)
        t = time.time()
        r = self.client.post("/v1/adapters", data={"name": name}, headers=headers, name="churn upload",
                             files=[("files", (n, b)) for n, b in files.items()])
        kind = "ok" if r.status_code == 201 else error_kind(r.status_code, r.content)
        RECORDS.append(Record(scenario="churn", tenant=tenant["id"], model=f"upload {name}", status=r.status_code,
                              kind=kind, latency_ms=(time.time() - t) * 1000, started_s=t - T0,
                              expected=kind == "ok"))
        if kind != "ok":
            return
        body = {"prompt": "hello", "max_tokens": CONFIG.get("max_tokens", 8)}
        _call(self, "churn", tenant, name, body, allowed={"ok"})
        # a request racing the delete is served or gets 404 (the gateway re-checks the registry when the engine
        # cannot fetch a version that was deleted meanwhile)
        racer = gevent.spawn(_call, self, "churn", tenant, name, body, allowed={"ok", "model_not_found"})
        give_up = time.time() + 60
        while True:      # a 503 says "repeat the DELETE later to finish" (blob store or database down): we do
            t = time.time()
            r = self.client.delete(f"/v1/adapters/{name}", headers=headers, name="churn delete")
            kind = "ok" if r.status_code in (200, 204) else error_kind(r.status_code, r.content)
            RECORDS.append(Record(scenario="churn", tenant=tenant["id"], model=f"delete {name}",
                                  status=r.status_code, kind=kind, latency_ms=(time.time() - t) * 1000,
                                  started_s=t - T0, expected=kind == "ok"))
            if r.status_code != 503 or time.time() > give_up:
                break
            gevent.sleep(min(5.0, float(r.headers.get("retry-after") or 1)))
        racer.join()
        _call(self, "churn", tenant, name, body, allowed={"model_not_found"})


class LongPromptUser(HttpUser):
    weight = CONFIG.get("weights", {}).get("long", 0)
    wait_time = between(0.2, 0.5)

    @task
    @pausable
    def long_prompt(self) -> None:
        a = random.choice(POP.adapters[:50])
        tenant = POP.tenants[a["tenant"]]
        max_tokens = CONFIG.get("max_tokens", 8)
        n = CONFIG["max_model_len"] - max_tokens
        over = random.random() < 0.2
        ids = [random.randrange(10, 200) for _ in range(n + (1 if over else 0))]
        _call(self, "long", tenant, a["name"], {"prompt": ids, "max_tokens": max_tokens},
              allowed={"context_length_exceeded"} if over else {"ok"})
