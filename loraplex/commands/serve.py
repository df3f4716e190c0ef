"""``loraplex serve``: runs the control plane's API with uvicorn (settings from LORAPLEX_* env vars)."""
from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the control plane API (uvicorn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--upgrade-db", action="store_true", help="run `loraplex db upgrade` first")

    def _main(args) -> int:
        import uvicorn

        if args.upgrade_db:
            from loraplex.commands.db import run

            run("upgrade", "head")
        uvicorn.run("loraplex.platform.main:create_app", factory=True, host=args.host, port=args.port,
                    log_level="info")
        return 0

    p.set_defaults(func=_main)
