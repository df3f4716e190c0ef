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
    p = subparsers.add_parser("serve", help="run the platform: tenant and admin API, inference, dashboard",
                              description="Run the loraplex platform (uvicorn): the tenant and admin API, the "
                                          "OpenAI-compatible inference API and the admin dashboard. Settings come from "
                                          "LORAPLEX_* environment variables (or a .env file); docs/platform.md lists "
                                          "them. Refused at start, with one line saying what to fix: invalid settings, "
                                          "a base model folder without config.json, an unreachable registry, a "
                                          "registry whose schema is not upgraded.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--upgrade-db", action="store_true", help="upgrade the registry's schema first "
                                                             "(`loraplex db upgrade`)")

    def _main(args) -> int:
        import sys

        import uvicorn
        from pydantic import ValidationError

        from loraplex.platform.core.config import get_settings
        from loraplex.platform.gateway.engines import check_engine_settings

        from loraplex.commands.db import run, schema_problem
        from loraplex.platform.api.header_limit import SERVER_LIMITS

        try:   # refused settings: one line, no traceback
            settings = get_settings()
            _check_model_path(settings)
            check_engine_settings(settings)
        except (ValidationError, ValueError, OSError) as e:
            print(f"loraplex serve: error: {_one_line(e)}", file=sys.stderr)
            return 2
        if args.upgrade_db:
            from sqlalchemy.exc import SQLAlchemyError

            try:
                run("upgrade", "head", url=settings.sqlalchemy_url)
            except SQLAlchemyError:
                pass                     # schema_problem says why, in one line
        problem = schema_problem(settings.sqlalchemy_url)
        if problem is not None:
            print(f"loraplex serve: error: {problem}", file=sys.stderr)
            return 2
        uvicorn.run("loraplex.platform.main:create_app", factory=True, host=args.host, port=args.port,
                    log_level="info", log_config=log_config(), timeout_keep_alive=get_settings().keep_alive_s,
                    **SERVER_LIMITS)
        return 0

    p.set_defaults(func=_main)


def _check_model_path(settings) -> None:
    import os

    path = settings.base_model_path
    if path and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"LORAPLEX_BASE_MODEL_PATH={path!r} has no config.json; point it at a Hugging Face model "
                         "folder (config.json, *.safetensors, tokenizer files)")


def _one_line(e: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        errors = e.errors()
        return "; ".join(f"LORAPLEX_{'_'.join(str(x) for x in err['loc']).upper() or 'SETTINGS'}: "
                         f"{err['msg'].removeprefix('Value error, ')}" for err in errors)
    return str(e)
