"""engine/progress.py: one set of tqdm defaults; off without a terminal unless LORAPLEX_PROGRESS=1."""
from __future__ import annotations

import io

from loraplex.engine.progress import byte_progress, progress, progress_enabled


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_enabled_follows_the_env_then_the_terminal(monkeypatch):
    monkeypatch.delenv("LORAPLEX_PROGRESS", raising=False)
    assert progress_enabled(Tty()) is True and progress_enabled(io.StringIO()) is False
    monkeypatch.setenv("LORAPLEX_PROGRESS", "0")
    assert progress_enabled(Tty()) is False
    monkeypatch.setenv("LORAPLEX_PROGRESS", "on")
    assert progress_enabled(io.StringIO()) is True


def test_bars_count_and_draw_when_enabled(monkeypatch):
    out = Tty()
    with progress(total=5, desc="Tuning fused_moe", unit="config", enabled=True, file=out, mininterval=0) as bar:
        for _ in range(5):
            bar.update(1)
    assert bar.n == 5 and "Tuning fused_moe" in out.getvalue() and "config" in out.getvalue()
    monkeypatch.setenv("LORAPLEX_PROGRESS", "0")
    quiet = io.StringIO()
    assert list(progress(range(3), desc="x", file=quiet)) == [0, 1, 2] and quiet.getvalue() == ""
    out = Tty()
    with byte_progress(3 * 1024 * 1024, "Fetching adapter", enabled=True, file=out, mininterval=0) as bar:
        bar.update(3 * 1024 * 1024)
    assert "3.00M" in out.getvalue() and "Fetching adapter" in out.getvalue()
