"""A local platform stack on loopback ports, owned by the caller, every part of it breakable:

    PostgreSQL   own throwaway cluster (initdb + pg_ctl), or without the binaries a fresh database on the machine's
                 behind a cuttable proxy; ``own_postgres=False``: a fresh database on the machine's, not breakable
    Redis        own ``redis-server`` (memory only)
    S3           moto's server behind a ``FaultProxy`` (up / down / slow), for the platform and the engines
    engines      ``loraplex engine serve --enable-lora`` processes on the tiny llama checkpoint (kill / restart)
    platform     ``create_app`` under uvicorn in a thread of this process (tests can look inside)

    stack = LocalStack(tmp_dir, engines=2); stack.start(); ...; stack.stop()
    stack.info   # invariants.Stack: URLs and names for the load client and the invariant checks
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import httpx

from load_tests.invariants import Stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN_KEY = "load-admin-key-0123456789"


class EngineProcess:
    """One engine server process on a fixed port, so a restart comes back where the router expects it."""

    def __init__(self, model: str, s3_endpoint: str, cache_dir: str, *, port: int, max_loras: int = 4) -> None:
        self.model, self.s3_endpoint, self.cache_dir, self.port = model, s3_endpoint, cache_dir, port
        self.max_loras = max_loras
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, LORAPLEX_S3_ENDPOINT_URL=self.s3_endpoint, LORAPLEX_S3_ACCESS_KEY_ID="testing",
                   LORAPLEX_S3_SECRET_ACCESS_KEY="testing", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loraplex.cli", "engine", "serve", "--model", self.model, "--port", str(self.port),
             "--device", "cpu", "--dtype", "float32", "--enable-lora", "--max-loras", str(self.max_loras),
             "--max-lora-rank", "8", "--max-cpu-loras", "32", "--adapter-cache-dir", self.cache_dir,
             "--log-level", "warning"], env=env, cwd=ROOT)

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine on {self.port} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"engine on {self.port} not ready after {timeout} s")

    def stats(self) -> dict:
        return httpx.get(self.url + "/v1/stats", timeout=5).json()

    def residency(self) -> dict:
        return httpx.get(self.url + "/v1/adapters", timeout=5).json()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class LocalStack:
    """Everything the load scenarios and fault tests need, started in dependency order and stopped in reverse."""

    def __init__(self, root: str, *, engines: int = 2, own_postgres: bool = True, max_loras: int = 4,
                 settings_overrides: dict | None = None) -> None:
        self.root, self.num_engines, self.own_postgres = root, engines, own_postgres
        self.max_loras, self.overrides = max_loras, settings_overrides or {}
        self.redis = self.pg = self.moto = self.proxy = self.server = None
        self.engines: list[EngineProcess] = []
        self._pg_db: str | None = None

    def start(self) -> "LocalStack":
        from loraplex.engine.testing.tiny import make_tiny_checkpoint
        from tests.utils.faults import FaultProxy, RedisProcess, own_postgres
        from tests.utils.services import MotoServer, create_database, free_port

        os.makedirs(self.root, exist_ok=True)
        self.model = make_tiny_checkpoint("llama", os.path.join(self.root, "tiny-llama"))
        self.redis = RedisProcess()
        if self.own_postgres:
            self.pg = own_postgres()
            self.database_url = self.pg.url
        else:
            self.database_url, self._pg_db = create_database()
        from loraplex.commands.db import run

        run("upgrade", "head", url=self.database_url)
        self.moto = MotoServer()
        self.proxy = FaultProxy(self.moto.port)
        self.bucket = f"load-{uuid.uuid4().hex[:10]}"
        self.moto.client().create_bucket(Bucket=self.bucket)
        self.engines = [EngineProcess(self.model, self.proxy.endpoint, os.path.join(self.root, f"cache-{i}"),
                                      port=free_port(), max_loras=self.max_loras) for i in range(self.num_engines)]
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_ready()
        self.start_platform()
        return self

    def settings(self):
        from loraplex.platform.core.config import Settings

        values = dict(environment="test", admin_key=ADMIN_KEY, secret_key="load-secret-key-0123456789",
                      data_dir=os.path.join(self.root, "data"), database_url=self.database_url,
                      redis_url=self.redis.url, quota_key_prefix=f"loraplex-load:{uuid.uuid4().hex[:8]}",
                      quota_timeout_s=0.5, quota_lease_reap_s=2.0, blob_backend="s3",
                      s3_endpoint_url=self.proxy.endpoint,
                      s3_bucket=self.bucket, s3_access_key_id="testing", s3_secret_access_key="testing",
                      s3_part_size=64 * 1024, s3_max_attempts=2, s3_connect_timeout_s=1.0, s3_read_timeout_s=3.0,
                      base_model_path=self.model,
                      engine_urls=[e.url for e in self.engines], residency_poll_s=0.5, usage_flush_s=0.2,
                      max_rank=16)
        values.update(self.overrides)
        return Settings(**values)

    def start_platform(self) -> None:
        from loraplex.platform.main import create_app
        from tests.platform.gateway.conftest import LiveServer

        self._settings = self.settings()
        self.server = LiveServer(create_app(self._settings))

    @property
    def info(self) -> Stack:
        s = self._settings
        return Stack(url=self.server.url, admin_key=ADMIN_KEY, database_url=self.database_url,
                     redis_url=self.redis.url, quota_key_prefix=s.quota_key_prefix, s3_endpoint=self.moto.endpoint,
                     s3_bucket=self.bucket, engine_urls=[e.url for e in self.engines], base_model_path=self.model,
                     base_model="tiny-llama", max_model_len=256)

    def stop(self) -> None:
        from tests.utils.services import drop_database

        for step in (lambda: self.server and self.server.stop(), *(e.stop for e in self.engines),
                     lambda: self.proxy and self.proxy.close(), lambda: self.moto and self.moto.stop(),
                     lambda: self.redis and self.redis.kill(), lambda: self.pg and self.pg.destroy(),
                     lambda: self._pg_db and drop_database(self._pg_db)):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - stop the rest
                print(f"stack stop step failed: {e!r}", file=sys.stderr)
