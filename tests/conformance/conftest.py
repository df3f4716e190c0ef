"""Conformance fixtures: the whole app under uvicorn with the embedded engine on the tiny llama (CPU, float32), one
per test session, a tenant with two PEFT adapters, and a recorder of what the gateway sent the engine, so a test
can show a parameter's effect on the answer or on the engine's ``SamplingParams``."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.platform.gateway.conftest import LiveServer, make_adapter, settings_for
from tests.security.live_stack import stack  # noqa: F401  (PostgreSQL + Redis + S3 stack, null engine)


@dataclass
class Live:
    server: LiveServer
    key: str
    adapters: tuple[str, str]
    sent: list            # EngineRequest of every engine request, in order

    @property
    def model(self) -> str:
        return self.server.gateway.model_name

    def client(self):
        return self.server.openai(self.key)

    def last_sampling(self) -> dict:
        return self.sent[-1].sampling


@pytest.fixture(scope="session")
def live(tmp_path_factory) -> Live:
    from loraplex.commands.db import run
    from loraplex.engine.testing.tiny import make_tiny_checkpoint
    from loraplex.platform.main import create_app

    tmp = tmp_path_factory.mktemp("conformance")
    base = make_tiny_checkpoint("llama", str(tmp / "tiny-llama"))
    settings = settings_for(tmp, base, engine_mode="embedded", engine_device="cpu", engine_dtype="float32")
    run("upgrade", "head", url=settings.sqlalchemy_url)
    server = LiveServer(create_app(settings))
    try:
        _, key = server.new_tenant()
        names = ("conf-a", "conf-b")
        for seed, name in enumerate(names, start=1):
            server.upload(key, name, make_adapter(base, str(tmp / name), seed=seed))
        sent = server.record_engine_requests()
        yield Live(server, key, names, sent)
    finally:
        server.stop()
