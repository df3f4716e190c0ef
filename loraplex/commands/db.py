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


def run(action: str, revision: str, url: str | None = None) -> tuple[str | None, str | None]:
    """Runs ``upgrade`` / ``downgrade`` to ``revision`` (or ``current``); returns the revision before and after."""
    from alembic import command

    from loraplex.platform.core.config import get_settings
    from loraplex.platform.db.session import make_engine

    cfg = alembic_config()
    engine = make_engine(url or get_settings().sqlalchemy_url)
    with engine.begin() as connection:
        cfg.attributes["connection"] = connection
        before = _revision_of(connection)
        if action == "upgrade":
            command.upgrade(cfg, revision)
        elif action == "downgrade":
            command.downgrade(cfg, revision)
        else:
            command.current(cfg, verbose=True)
        after = _revision_of(connection)
    engine.dispose()
    return before, after


def _revision_of(connection) -> str | None:
    from alembic.migration import MigrationContext

    return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def schema_problem(url: str) -> str | None:
    """Why the registry at ``url`` cannot be served by this platform (unreachable, or not at the migrations' head),
    as one line with the command to run; None when it can."""
    from sqlalchemy.exc import SQLAlchemyError

    from loraplex.platform.db.session import make_engine

    safe = _redacted(url)
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            current = _revision_of(connection)
    except SQLAlchemyError as e:
        reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0][:200]
        return f"the registry database {safe} is unreachable ({reason}); check LORAPLEX_DATABASE_URL"
    finally:
        engine.dispose()
    head = head_revision()
    if current == head:
        return None
    state = "has no loraplex schema" if current is None else f"is at schema revision {current}"
    return (f"the registry database {safe} {state}; this platform needs revision {head}: run `loraplex db upgrade`"
            f" (or start with `loraplex serve --upgrade-db`)")


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - an unparseable URL is shown as the scheme only
        return url.split(":", 1)[0] + "://..."


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
    p = subparsers.add_parser("db", help="create or upgrade the registry database; clean up interrupted uploads",
                              description="upgrade: bring the registry database (LORAPLEX_DATABASE_URL, default the "
                                          "SQLite file under LORAPLEX_DATA_DIR) to the schema this version needs; "
                                          "downgrade: go back a revision (or to one); current: show the revision; "
                                          "janitor: one clean-up pass (interrupted uploads, orphan blobs), as JSON.")
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
        import sys

        from sqlalchemy.exc import SQLAlchemyError

        default = "head" if args.action == "upgrade" else "-1"
        url = args.url
        try:
            if url is None:
                from loraplex.platform.core.config import get_settings

                url = get_settings().sqlalchemy_url
            before, after = run(args.action, args.revision or default, url=url)
        except SQLAlchemyError as e:
            reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0][:200]
            print(f"loraplex db: error: the registry database {_redacted(url)} is unreachable or refused the "
                  f"migration ({reason})", file=sys.stderr)
            return 1
        if args.action != "current":
            what = "already at" if before == after else f"{args.action}d from {before or 'an empty database'} to"
            print(f"registry {_redacted(url)}: {what} revision {after or 'base (no loraplex tables)'}")
        return 0

    p.set_defaults(func=_main)
