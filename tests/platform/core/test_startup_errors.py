"""Refusals at start, each one line without a traceback: `loraplex serve` on a registry whose schema is not
upgraded (the command to run), an unreachable registry, a base model folder without config.json, a setting that
does not parse; `loraplex db upgrade` says what it did."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def loraplex(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    base.update(PYTHONPATH=ROOT, LORAPLEX_DATA_DIR=str(tmp_path / "data"), LORAPLEX_ENGINE_MODE="none", **env)
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args], cwd=ROOT, env=base, capture_output=True,
                          text=True, timeout=120)


def one_line_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_serve_refuses_a_registry_that_is_not_upgraded_then_db_upgrade_says_what_it_did(tmp_path):
    url = f"sqlite:///{tmp_path}/reg.db"
    line = one_line_error(loraplex(tmp_path, "serve", LORAPLEX_DATABASE_URL=url))
    assert "has no loraplex schema" in line and "run `loraplex db upgrade`" in line, line
    up = loraplex(tmp_path, "db", "upgrade", LORAPLEX_DATABASE_URL=url)
    assert up.returncode == 0 and "upgraded from an empty database to revision 0005" in up.stdout, up.stderr
    again = loraplex(tmp_path, "db", "upgrade", LORAPLEX_DATABASE_URL=url)
    assert "already at revision 0005" in again.stdout
    down = loraplex(tmp_path, "db", "downgrade", "0004", LORAPLEX_DATABASE_URL=url)
    assert "downgraded from 0005 to revision 0004" in down.stdout
    line = one_line_error(loraplex(tmp_path, "serve", LORAPLEX_DATABASE_URL=url))
    assert "is at schema revision 0004" in line and "needs revision 0005" in line


def test_serve_refuses_bad_settings_in_one_line(tmp_path):
    line = one_line_error(loraplex(tmp_path, "serve", LORAPLEX_MAX_RANK="lots"))
    assert line.startswith("loraplex serve: error: LORAPLEX_MAX_RANK:"), line
    line = one_line_error(loraplex(tmp_path, "serve", LORAPLEX_BASE_MODEL_PATH=str(tmp_path / "nowhere")))
    assert "has no config.json" in line
    line = one_line_error(loraplex(tmp_path, "serve", LORAPLEX_DATABASE_URL="postgresql+psycopg://u:secret@127.0.0.1:1/x"))
    assert "unreachable" in line and "secret" not in line
    line = one_line_error(loraplex(tmp_path, "db", "upgrade", LORAPLEX_MAX_RANK="lots"))
    assert line.startswith("loraplex db: error: LORAPLEX_MAX_RANK:"), line


def test_serve_lets_the_app_answer_oversized_headers(tmp_path, monkeypatch):
    """`loraplex serve` starts uvicorn with the header allowance the app's 431 needs (h11's own cap would answer a
    plain-text 400 first)."""
    import uvicorn

    from loraplex.cli import main
    from loraplex.platform.api.header_limit import MAX_HEADER_BYTES, SERVER_LIMITS
    from loraplex.platform.core.config import get_settings

    for key in [k for k in os.environ if k.startswith("LORAPLEX_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LORAPLEX_ENGINE_MODE", "none")
    get_settings.cache_clear()
    started: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.append(kw))
    try:
        assert main(["serve", "--upgrade-db", "--port", "0"]) == 0
    finally:
        get_settings.cache_clear()
    assert len(started) == 1 and started[0]["h11_max_incomplete_event_size"] > MAX_HEADER_BYTES
    assert {k: started[0][k] for k in SERVER_LIMITS} == SERVER_LIMITS
