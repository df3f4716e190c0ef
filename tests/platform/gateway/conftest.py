"""Gateway fixtures: a tiny llama checkpoint with a tokenizer (built locally), real PEFT adapters of it, and the
whole app served by a real uvicorn server on a loopback port (in a thread, so tests can look at the gateway's
quota store, engines and usage writer), talked to with the official ``openai`` client and httpx."""
from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid

import httpx
import pytest

from tests.utils.services import free_port

ADMIN_KEY = "admin-test-key-0123456789"


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> str:
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("models") / "tiny-llama"))


def make_adapter(base: str, out_dir: str, *, seed: int, r: int = 4, alpha: float = 8) -> str:
    """A PEFT LoRA of ``base`` with random non-zero weights (attention + MLP), saved as PEFT saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    get_peft_model(model, cfg).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def adapters(tiny_base, tmp_path_factory) -> dict[str, str]:
    return {name: make_adapter(tiny_base, str(tmp_path_factory.mktemp(f"adapter-{name}")), seed=seed)
            for name, seed in (("a", 1), ("b", 2))}


def settings_for(tmp_path, base: str | None, **kw):
    from loraplex.platform.core.config import Settings

    values = dict(environment="test", admin_key=ADMIN_KEY, secret_key="test-secret-key-0123456789",
                  data_dir=str(tmp_path / "data"), base_model_path=base, engine_mode="null", max_rank=16,
                  residency_poll_s=0.2, usage_flush_s=0.2)
    values.update(kw)
    return Settings(**values)


class LiveServer:
    """The app under a real uvicorn server on 127.0.0.1 (its own thread and event loop)."""

    def __init__(self, app) -> None:
        import uvicorn

        from loraplex.platform.api.header_limit import SERVER_LIMITS

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", **SERVER_LIMITS))   # as deployed
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the app did not start (see the log above)")
            time.sleep(0.02)
        self.http = httpx.Client(base_url=self.url, timeout=30)

    @property
    def gateway(self):
        return self.app.state.gateway

    def call(self, coro, timeout: float = 10):
        """Run a coroutine on the server's loop (e.g. to read the quota store)."""
        return asyncio.run_coroutine_threadsafe(coro, self.gateway.notifier.loop).result(timeout)

    def admin(self) -> dict:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    def new_tenant(self, quotas: dict | None = None) -> tuple[str, str]:
        """(tenant id, API key)."""
        body = {"name": f"t-{uuid.uuid4().hex[:8]}", **({"quotas": quotas} if quotas else {})}
        r = self.http.post("/admin/tenants", json=body, headers=self.admin())
        assert r.status_code == 201, r.text
        tid = r.json()["id"]
        r = self.http.post(f"/admin/tenants/{tid}/keys", json={"name": "k"}, headers=self.admin())
        assert r.status_code == 201, r.text
        return tid, r.json()["key"]

    def upload(self, key: str, name: str, folder: str) -> dict:
        files = [("files", (n, open(os.path.join(folder, n), "rb").read()))
                 for n in ("adapter_config.json", "adapter_model.safetensors")]
        r = self.http.post("/v1/adapters", data={"name": name}, files=files,
                           headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 201, r.text
        return r.json()

    def record_engine_requests(self, replica: str = "embedded") -> list:
        """The ``EngineRequest`` of every generation sent to ``replica`` from now on, in order."""
        sent: list = []
        client = self.gateway.router.replicas[replica].client
        generate = client.generate

        def recording(request):
            sent.append(request)
            return generate(request)

        client.generate = recording
        return sent

    def openai(self, key: str, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture
def serve(tmp_path):
    """``serve(settings=None, **create_app kwargs) -> LiveServer`` on SQLite + a local blob folder (migrated);
    stopped after the test."""
    from loraplex.commands.db import run
    from loraplex.platform.main import create_app

    servers: list[LiveServer] = []

    def start(settings=None, **kw) -> LiveServer:
        settings = settings or settings_for(tmp_path, None)
        run("upgrade", "head", url=settings.sqlalchemy_url)
        server = LiveServer(create_app(settings, **kw))
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()
