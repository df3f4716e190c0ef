"""``loraplex serve``: runs the control plane's API with uvicorn (settings from LORAPLEX_* env vars). The access log
never shows credentials: the values of query parameters like ``key``/``login``/``token`` are redacted
(``platform/core/access_log.py``). With ``LORAPLEX_METRICS_PORT`` the Prometheus scrape is served there too."""
from __future__ import annotations

import copy


def log_config() -> dict:
    """uvicorn's logging config with the query-string redaction filter on the access log."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_query"] = {"()": "loraplex.platform.core.access_log.RedactQueryFilter"}
    config["handlers"]["access"]["filters"] = ["redact_query"]
    return config


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the control plane API (uvicorn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--upgrade-db", action="store_true", help="run `loraplex db upgrade` first")

    def _main(args) -> int:
        import sys

        import uvicorn
        from pydantic import ValidationError

        from loraplex.platform.core.config import get_settings
        from loraplex.platform.gateway.engines import check_engine_settings

        try:   # refused settings: one line, no traceback
            check_engine_settings(get_settings())
        except (ValidationError, ValueError) as e:
            print(f"loraplex serve: error: {_one_line(e)}", file=sys.stderr)
            return 2
        if args.upgrade_db:
            from loraplex.commands.db import run

            run("upgrade", "head")
        uvicorn.run("loraplex.platform.main:create_app", factory=True, host=args.host, port=args.port,
                    log_level="info", log_config=log_config(), timeout_keep_alive=get_settings().keep_alive_s)
        return 0

    p.set_defaults(func=_main)


def _one_line(e: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        errors = e.errors()
        return "; ".join(f"LORAPLEX_{'_'.join(str(x) for x in err['loc']).upper() or 'SETTINGS'}: "
                         f"{err['msg'].removeprefix('Value error, ')}" for err in errors)
    return str(e)
