"""``/readyz`` is 200 only while the registry database answers and an engine replica is ready; ``/healthz`` stays
liveness only. Real app with its lifespan (TestClient as a context manager), SQLite registry, engines as a real
``loraplex engine serve --null`` process, a port nothing listens on and a replica still loading."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from loraplex.platform.engines.errors import EngineUnavailableError
from loraplex.platform.engines.http_client import HttpEngineClient
from loraplex.platform.routing import Replica
from tests.platform.conftest import make_settings
from tests.utils.services import free_port, wait_for_port


class LoadingEngine:
    """An engine client whose replica is up but still loading its model (``/health`` 503)."""

    async def health(self):
        raise EngineUnavailableError("engine at http://10.0.0.7:8100 is not ready: loading the model")

    async def residency(self):
        raise EngineUnavailableError("loading")

    async def close(self):
        return None


@pytest.fixture(scope="module")
def null_engine():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "engine", "serve", "--null", "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_for_port(port, timeout=30, proc=proc)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(10)


def app_with(tmp_path, replicas=None, **settings):
    from loraplex.commands.db import run
    from loraplex.platform.main import create_app

    s = make_settings(data_dir=str(tmp_path / "data"), **settings)
    if "database_url" not in settings:
        run("upgrade", "head", url=s.sqlalchemy_url)
    return create_app(s, replicas=replicas)


def not_ready(r) -> str:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "not_ready" and err["type"] == "service_unavailable", err
    return err["message"]


def test_ready_with_a_ready_engine_and_the_database(tmp_path, null_engine):
    dead = f"http://127.0.0.1:{free_port()}"
    replicas = [Replica("dead", HttpEngineClient(dead, connect_timeout_s=0.5)),
                Replica("live", HttpEngineClient(null_engine, connect_timeout_s=0.5))]
    with TestClient(app_with(tmp_path, replicas=replicas)) as client:
        assert client.get("/readyz").json() == {"status": "ready"}
        assert client.get("/healthz").json() == {"status": "ok"}


def test_not_ready_while_no_engine_answers_ready(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    replicas = [Replica("dead", HttpEngineClient(dead, connect_timeout_s=0.5)), Replica("loading", LoadingEngine())]
    with TestClient(app_with(tmp_path, replicas=replicas)) as client:
        message = not_ready(client.get("/readyz"))
        assert "no engine replica is ready (none of 2" in message
        assert "10.0.0.7" not in message and dead not in message      # internal addresses stay in the log
        assert client.get("/healthz").status_code == 200              # liveness is unaffected


def test_embedded_null_engine_is_ready_and_no_engines_means_database_only(tmp_path):
    with TestClient(app_with(tmp_path, engine_mode="null")) as client:
        assert client.get("/readyz").json() == {"status": "ready"}
    with TestClient(app_with(tmp_path / "none", engine_mode="none")) as client:
        assert client.get("/readyz").json() == {"status": "ready"}


def test_not_ready_when_the_engine_could_not_be_built(tmp_path):
    with TestClient(app_with(tmp_path, engine_mode="embedded", base_model_path=None)) as client:
        assert "no engine replica could be built" in not_ready(client.get("/readyz"))


def test_not_ready_without_the_database(tmp_path):
    url = f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/registry?connect_timeout=1"   # nothing listens
    with TestClient(app_with(tmp_path, engine_mode="null", database_url=url)) as client:
        message = not_ready(client.get("/readyz"))
        assert "registry database is unavailable (OperationalError)" in message
        assert client.get("/healthz").status_code == 200


def test_not_ready_before_the_lifespan_ran(tmp_path):
    client = TestClient(app_with(tmp_path, engine_mode="null"))     # no `with`: no lifespan, no gateway
    assert "gateway is not running" in not_ready(client.get("/readyz"))
