"""The README's main job: ``loraplex demo`` on embedded defaults exits 0 within two minutes and prints three
answers (the base model and two adapters), says that the model is a random one and what the answers show, prints
the full tenant and admin keys, the API docs address and the dashboard's with a one-time login link, and keeps its
settings in demo.env (0600) so the printed keys stay valid against its registry."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_runs_the_whole_platform(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}  # embedded defaults only
    # the README promises the demo within two minutes: the timeout is that bound (a run takes about 20 s on two
    # shared cores; subprocess.TimeoutExpired fails the test)
    proc = subprocess.run([sys.executable, "-m", "loraplex.cli", "demo", "--work-dir", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answers = [(m, a) for m, _, a in re.findall(r"^\[(.+?)\] (['\"])(.*)\2$", proc.stdout, flags=re.M)]
    assert [m for m, _ in answers] == ["tiny-qwen3_moe", "poet", "pirate"], proc.stdout
    assert len({a for _, a in answers}) == 3, proc.stdout  # each adapter changes the answer
    assert re.search(r"^API docs: http://127\.0\.0\.1:\d+/docs", proc.stdout, flags=re.M), proc.stdout
    assert re.search(r"^dashboard: http://127\.0\.0\.1:(\d+)/admin/dashboard   one-time login link \(10 min\): "
                     r"http://127\.0\.0\.1:\1/admin/dashboard\?login=\d+\.[\w-]+\.[0-9a-f]{64}", proc.stdout, flags=re.M), \
        proc.stdout
    assert "uploaded adapter poet v1" in proc.stdout and "uploaded adapter pirate v1" in proc.stdout
    assert "tiny random qwen3_moe model" in proc.stdout and "each adapter changes" in proc.stdout
    [key] = re.findall(r"its API key \(the platform keeps only a hash\): (lpx_\S+)$", proc.stdout, flags=re.M)
    [admin] = re.findall(r"^admin key: (\S+)", proc.stdout, flags=re.M)
    env_file = tmp_path / "demo" / "demo.env"
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    saved = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    assert saved["LORAPLEX_ADMIN_KEY"] == admin and saved["LORAPLEX_API_KEY"] == key
    assert f". {env_file}" in proc.stdout
    # the printed key authenticates against the demo's registry with the saved secret (what `loraplex serve` does)
    from loraplex.platform.crud.tenants import authenticate_key
    from loraplex.platform.db.session import make_engine
    from sqlalchemy.orm import Session

    engine = make_engine(saved["LORAPLEX_DATABASE_URL"])
    with Session(engine) as session:
        assert authenticate_key(session=session, key=key, secret=saved["LORAPLEX_SECRET_KEY"]) is not None
    engine.dispose()
