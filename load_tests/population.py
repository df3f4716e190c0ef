"""Tenants and adapters registered through the real admin and upload APIs.

    pop = populate(url, admin_key, base_model_path, tenants=50, adapters=1000)   # Population (JSON-ready)
    pop.save(path); Population.load(path)

Adapter ``j`` belongs to tenant ``j % tenants`` and is named ``z<j>``; its popularity rank is ``j`` (Zipf).
"""
from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx

from load_tests.adapters import rank1_adapter


@dataclass
class Population:
    tenants: list[dict]                 # {"id", "key", "name"}
    adapters: list[dict]                # {"tenant": index, "name"}; list order = popularity rank
    burst_tenants: list[dict] = field(default_factory=list)    # tenants with a low requests_per_minute quota
    burst_rpm: int = 0

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def load(cls, path: str) -> "Population":
        with open(path) as f:
            return cls(**json.load(f))


def new_tenant(http: httpx.Client, admin_key: str, *, quotas: dict | None = None) -> dict:
    admin = {"Authorization": f"Bearer {admin_key}"}
    name = f"load-{uuid.uuid4().hex[:10]}"
    r = http.post("/admin/tenants", json={"name": name, **({"quotas": quotas} if quotas else {})}, headers=admin)
    r.raise_for_status()
    tid = r.json()["id"]
    r = http.post(f"/admin/tenants/{tid}/keys", json={"name": "load"}, headers=admin)
    r.raise_for_status()
    return {"id": tid, "key": r.json()["key"], "name": name}


def upload(http: httpx.Client, key: str, name: str, files: dict[str, bytes]) -> httpx.Response:
    """POST /v1/adapters (multipart) with the two PEFT files."""
    return http.post("/v1/adapters", data={"name": name}, headers={"Authorization": f"Bearer {key}"},
                     files=[("files", (n, b)) for n, b in files.items()])


def populate(url: str, admin_key: str, base_model_path: str, *, tenants: int = 50, adapters: int = 1000,
             burst_tenants: int = 2, burst_rpm: int = 30, workers: int = 8, timeout_s: float = 60) -> Population:
    """Creates the tenants (plus ``burst_tenants`` with ``burst_rpm``) and uploads ``adapters`` rank-1 adapters."""
    if tenants < 1 or adapters < 1:
        raise ValueError(f"need at least one tenant and one adapter, got {tenants} and {adapters}")
    with httpx.Client(base_url=url, timeout=timeout_s) as http:
        ts = [new_tenant(http, admin_key) for _ in range(tenants)]
        bursty = [new_tenant(http, admin_key, quotas={"requests_per_minute": burst_rpm})
                  for _ in range(burst_tenants)]
        ads = [{"tenant": j % tenants, "name": f"z{j:04d}"} for j in range(adapters)]

        def one(j: int) -> None:
            a = ads[j]
            files = rank1_adapter(base_model_path, value=0.01 * (1 + j % 13))
            r = upload(http, ts[a["tenant"]]["key"], a["name"], files)
            if r.status_code != 201:
                raise RuntimeError(f"upload of {a['name']} answered {r.status_code}: {r.text[:300]}")

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(adapters)))
    return Population(tenants=ts, adapters=ads, burst_tenants=bursty, burst_rpm=burst_rpm)
