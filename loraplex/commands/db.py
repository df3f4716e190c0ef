"""``loraplex db upgrade|downgrade|current``: runs the registry's Alembic migrations (migrations/) against the
database of the settings (LORAPLEX_DATABASE_URL) or ``--url``."""
from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def alembic_config():
    """An Alembic ``Config`` for the repository's migrations."""
    from alembic.config import Config

    cfg = Config(os.path.join(REPO_ROOT, "alembic.ini"))
    cfg.set_main_option("script_location", os.path.join(REPO_ROOT, "migrations"))
    cfg.attributes["configure_logger"] = False
    return cfg


def run(action: str, revision: str, url: str | None = None) -> None:
    """Runs ``upgrade`` / ``downgrade`` to ``revision`` (or ``current``)."""
    from alembic import command

    from loraplex.platform.core.config import get_settings
    from loraplex.platform.db.session import make_engine

    cfg = alembic_config()
    engine = make_engine(url or get_settings().sqlalchemy_url)
    with engine.begin() as connection:
        cfg.attributes["connection"] = connection
        if action == "upgrade":
            command.upgrade(cfg, revision)
        elif action == "downgrade":
            command.downgrade(cfg, revision)
        else:
            command.current(cfg, verbose=True)
    engine.dispose()


def register(subparsers) -> None:
    p = subparsers.add_parser("db", help="registry database migrations (Alembic)")
    p.add_argument("action", choices=["upgrade", "downgrade", "current"])
    p.add_argument("revision", nargs="?", default=None, help="target revision (upgrade: head, downgrade: -1)")
    p.add_argument("--url", default=None, help="database URL (default: LORAPLEX_DATABASE_URL / the SQLite file)")

    def _main(args) -> int:
        default = "head" if args.action == "upgrade" else "-1"
        run(args.action, args.revision or default, url=args.url)
        return 0

    p.set_defaults(func=_main)
