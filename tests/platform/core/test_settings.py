"""Settings: defaults are the embedded deployment; default secrets are refused outside development."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from loraplex.platform.core.config import Settings


def test_embedded_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = Settings(_env_file=None)
    assert s.environment == "development" and s.blob_backend == "local"
    assert s.sqlalchemy_url == f"sqlite:///{tmp_path}/loraplex-data/loraplex.db"
    assert s.blob_path == f"{tmp_path}/loraplex-data/blobs"


@pytest.mark.parametrize("env", ["test", "production"])
def test_default_secrets_refused_outside_development(env):
    with pytest.raises(ValidationError, match="LORAPLEX_ADMIN_KEY is the default 'changethis'"):
        Settings(_env_file=None, environment=env)
    with pytest.raises(ValidationError, match="LORAPLEX_SECRET_KEY is the default"):
        Settings(_env_file=None, environment=env, admin_key="a-real-secret")
    Settings(_env_file=None, environment=env, admin_key="a-real-secret", secret_key="another-secret")


def test_env_vars(monkeypatch):
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("LORAPLEX_BLOB_BACKEND", "s3")
    monkeypatch.setenv("LORAPLEX_MAX_RANK", "128")
    monkeypatch.setenv("LORAPLEX_BASE_MODEL_PATH", "/models/Qwen3-30B-A3B/")
    s = Settings(_env_file=None)
    assert s.sqlalchemy_url == "postgresql+psycopg://u@h/db" and s.blob_backend == "s3" and s.max_rank == 128
    assert s.served_model_name == "Qwen3-30B-A3B"
