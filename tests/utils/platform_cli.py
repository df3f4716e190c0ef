"""`loraplex serve` refusing its settings, as an operator sees it."""
from __future__ import annotations


def refused_serve_line(monkeypatch, capsys, env: dict[str, str]) -> str:
    """Run ``loraplex serve --port 0`` under ``env`` (LORAPLEX_* variables); it must exit 2 before serving and
    print one line, no traceback: that line."""
    from loraplex.cli import main
    from loraplex.platform.core.config import get_settings

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    try:
        assert main(["serve", "--port", "0"]) == 2
    finally:
        get_settings.cache_clear()
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err
