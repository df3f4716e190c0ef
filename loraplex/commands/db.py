"""``loraplex db upgrade|downgrade|current``: runs the registry's Alembic migrations (migrations/) against the
database of the settings (LORAPLEX_DATABASE_URL) or ``--url``.

``loraplex db janitor``: one janitor pass (``platform/uploads/janitor.py``) over the registry, the blob store and
this host's spool folder of the settings: interrupted uploads expired (their Idempotency-Keys freed), their blobs,
incomplete multipart uploads and orphan blobs removed. Prints the report as JSON; exit 0, or 1 on an outage. The
Helm chart runs it as a CronJob (``janitor.cronJob.enabled``)."""
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


def janitor(url: str | None = None, stale_after_s: float | None = None) -> dict:
    """One janitor pass with the settings (``url``/``stale_after_s`` override them); returns its report."""
    import logging

    from loraplex.platform.blobs import make_blob_store
    from loraplex.platform.core.config import get_settings
    from loraplex.platform.db.session import make_sessionmaker
    from loraplex.platform.uploads.janitor import Janitor
    from loraplex.platform.uploads.spool import Spool

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    update = {k: v for k, v in (("database_url", url), ("upload_stale_after_s", stale_after_s)) if v is not None}
    settings = settings.model_copy(update=update) if update else settings
    sessions = make_sessionmaker(settings)
    try:
        report = Janitor(sessions, make_blob_store(settings), stale_after_s=settings.upload_stale_after_s,
                         spool=Spool(settings.spool_path, lease_s=settings.spool_lease_s)).run_once()
    finally:
        sessions.kw["bind"].dispose()
    return report.as_dict()


def register(subparsers) -> None:
    p = subparsers.add_parser("db", help="registry database migrations (Alembic) and the janitor")
    p.add_argument("action", choices=["upgrade", "downgrade", "current", "janitor"])
    p.add_argument("revision", nargs="?", default=None, help="target revision (upgrade: head, downgrade: -1)")
    p.add_argument("--url", default=None, help="database URL (default: LORAPLEX_DATABASE_URL / the SQLite file)")
    p.add_argument("--stale-after", type=float, default=None, metavar="S",
                   help="janitor: expire uploads without a heartbeat for S seconds (default LORAPLEX_UPLOAD_STALE_AFTER_S)")

    def _main(args) -> int:
        if args.action == "janitor":
            import json

            try:
                print(json.dumps(janitor(url=args.url, stale_after_s=args.stale_after)))
            except Exception as e:  # noqa: BLE001 - an outage: the CronJob's next run retries
                print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
                return 1
            return 0
        default = "head" if args.action == "upgrade" else "-1"
        run(args.action, args.revision or default, url=args.url)
        return 0

    p.set_defaults(func=_main)
