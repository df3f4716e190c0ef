"""``loraplex adapters``: manage your LoRA adapters on a loraplex platform (upload, list, version history,
aliases, rollback, delete, import from S3 or an HTTPS folder).

    loraplex adapters upload ./out/support-bot --name support-bot     # a PEFT folder, or a .tar.gz / .zip of it
    loraplex adapters list
    loraplex adapters versions support-bot
    loraplex adapters alias support-bot prod 3                        # support-bot:prod now serves version 3
    loraplex adapters rollback support-bot 2                          # support-bot (= :latest) serves version 2
    loraplex adapters delete support-bot:3                            # one version; `support-bot` alone: all
    loraplex adapters import support-bot s3://my-bucket/runs/42/ --region eu-west-1
"""
from __future__ import annotations

import argparse
import os
import sys

from loraplex.commands._tenant import CONNECTION_HELP, connection_args, emit, run_with_client

VERSION_COLUMNS = [("version", "number"), ("status", "status"), ("aliases", "aliases"), ("sha256", "sha"),
                   ("size", "size_bytes"), ("uploaded", "created_at"), ("by key", "by"), ("source", "source")]


def register(subparsers) -> None:
    p = subparsers.add_parser("adapters", help="upload, list, alias, roll back, delete and import your adapters",
                              description=__doc__.replace("``", "") + "\n" + CONNECTION_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="adapters_command", required=True, metavar="COMMAND")

    def cmd(name: str, help: str, fn, description: str | None = None) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=description or help)
        c.set_defaults(func=run_with_client(fn))
        return c

    c = cmd("upload", "upload a PEFT folder or archive as a new version", _upload,
            "Upload adapter_config.json + adapter_model.safetensors (a folder PEFT's save_pretrained wrote) or one "
            ".tar.gz / .tgz / .tar / .zip of that folder as a new version of NAME. It is validated before anything "
            "is stored; on success `latest` (the bare name) serves it. The same bytes as an existing version answer "
            "that version. Interrupted uploads are retried with the same Idempotency-Key, so a retry never makes a "
            "second version.")
    c.add_argument("path", metavar="PATH", help="the PEFT folder or archive")
    c.add_argument("--name", required=True, help="the adapter's name (a-z, 0-9, '.', '_', '-'; up to 64)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    connection_args(c)
    c = cmd("list", "list your adapters with their latest version and aliases", _list)
    connection_args(c)
    c = cmd("versions", "an adapter's version history: who uploaded each version and when, sha256, size, aliases",
            _versions)
    c.add_argument("name", metavar="NAME")
    connection_args(c)
    c = cmd("alias", "point an alias (e.g. prod) at a version; requests for NAME:ALIAS serve it from then on", _alias)
    c.add_argument("name", metavar="NAME")
    c.add_argument("alias", metavar="ALIAS", help="a-z, 0-9, '_', '-', starting with a letter; `latest` is the bare "
                                                  "name")
    c.add_argument("version", metavar="VERSION", type=int, nargs="?",
                   help="the version number (omit with --delete)")
    c.add_argument("--delete", action="store_true", help="remove the alias instead")
    connection_args(c)
    c = cmd("rollback", "serve an earlier version under the bare name (moves `latest`)", _rollback)
    c.add_argument("name", metavar="NAME")
    c.add_argument("version", metavar="VERSION", type=int)
    connection_args(c)
    c = cmd("delete", "delete one version (NAME:VERSION) or the whole adapter (NAME)", _delete,
            "Delete NAME:VERSION (its aliases go; `latest` moves to the newest ready version; the adapter goes with "
            "its last version unless --keep-adapter) or NAME with every version, alias and stored weight.")
    c.add_argument("target", metavar="NAME[:VERSION]")
    c.add_argument("--keep-adapter", action="store_true",
                   help="keep the adapter (and its numbering) when its last version is deleted")
    connection_args(c)
    c = cmd("import", "import a Hub-layout folder from your S3 bucket or an HTTPS URL as a new version", _import,
            "Import adapter_config.json + adapter_model.safetensors from s3://bucket/prefix/ or https://host/path/ "
            "(the platform fetches them; the same checks as an upload). S3 credentials given here are used for this "
            "import only and never stored; without them the operator's configured role is used, if the operator "
            "allows it for that bucket.")
    c.add_argument("name", metavar="NAME")
    c.add_argument("source", metavar="SOURCE", help="s3://bucket/prefix/ or https://host/path/")
    c.add_argument("--aws-access-key-id", default=os.environ.get("AWS_ACCESS_KEY_ID"),
                   help="S3 credentials (default: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN)")
    c.add_argument("--aws-secret-access-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY"))
    c.add_argument("--aws-session-token", default=os.environ.get("AWS_SESSION_TOKEN"))
    c.add_argument("--region", default=os.environ.get("AWS_REGION"), help="the bucket's region")
    c.add_argument("--endpoint-url", help="an S3-compatible endpoint the operator allows (default: AWS)")
    c.add_argument("--bearer-token", help="HTTPS sources: an Authorization bearer token (e.g. a Hub token)")
    c.add_argument("--no-wait", action="store_true", help="return once the platform accepted the import")
    connection_args(c)


def _version_rows(history: dict) -> list[dict]:
    rows = []
    for v in history["data"]:
        by = v.get("created_by") or {}
        rows.append({**v, "sha": (v.get("sha256") or "")[:12], "aliases": ",".join(v.get("aliases") or []),
                     "by": by.get("name") or by.get("prefix"), "created_at": (v.get("created_at") or "")[:19]})
    return rows


def _upload(client, args) -> int:
    from loraplex.client import upload_files
    from loraplex.engine.progress import byte_progress

    total = sum(os.path.getsize(p) for p in upload_files(args.path))
    with byte_progress(total, f"Uploading {args.name}", enabled=None if not args.no_progress else False) as bar:
        sent = [0]

        def on_bytes(n: int) -> None:          # a retry sends the bytes again: the bar starts over
            if sent[0] + n > total:
                bar.reset()
                sent[0] = 0
            sent[0] += n
            bar.update(n)
        v = client.upload(args.path, name=args.name, on_bytes=on_bytes)
    note = " (identical to an existing version: nothing new stored)" if v["deduplicated"] else \
        " (already uploaded: replayed)" if v["replayed"] else ""
    emit(args, v, line=f"{v['adapter']} v{v['number']} {v['status']}: rank {v['rank']}, {v['size_bytes']} bytes, "
                       f"sha256 {v['sha256'][:12]}{note}")
    return 0


def _list(client, args) -> int:
    rows = client.list_adapters()
    emit(args, rows, [{**r, "aliases": ", ".join(f"{k}={v}" for k, v in r["aliases"].items())} for r in rows],
         [("name", "name"), ("latest", "latest_version"), ("aliases", "aliases"), ("created", "created_at")])
    return 0


def _versions(client, args) -> int:
    history = client.versions(args.name)
    emit(args, history, _version_rows(history), VERSION_COLUMNS)
    return 0


def _alias(client, args) -> int:
    if args.delete:
        client.delete_alias(args.name, args.alias)
        emit(args, {"adapter": args.name, "alias": args.alias, "deleted": True},
             line=f"{args.name}:{args.alias} removed")
        return 0
    if args.version is None:
        print("loraplex adapters alias: error: give VERSION (or --delete)", file=sys.stderr)
        return 2
    r = client.set_alias(args.name, args.alias, args.version)
    emit(args, r, line=_moved(r))
    return 0


def _moved(r: dict) -> str:
    before = f" (was {r['previous_version']})" if r.get("previous_version") is not None else ""
    return f"{r['adapter']}:{r['alias']} -> version {r['version']}{before}"


def _rollback(client, args) -> int:
    r = client.rollback(args.name, args.version)
    emit(args, r, line=_moved(r))
    return 0


def _delete(client, args) -> int:
    name, _, version = args.target.partition(":")
    if version and not version.isdigit():
        print(f"loraplex adapters delete: error: {args.target!r}: give NAME or NAME:VERSION (a number)",
              file=sys.stderr)
        return 2
    client.delete(name, int(version) if version else None, keep_adapter=args.keep_adapter)
    emit(args, {"deleted": args.target}, line=f"deleted {args.target}")
    return 0


def _import(client, args) -> int:
    creds = {k: v for k, v in (("aws_access_key_id", args.aws_access_key_id),
                               ("aws_secret_access_key", args.aws_secret_access_key),
                               ("aws_session_token", args.aws_session_token), ("region", args.region),
                               ("endpoint_url", args.endpoint_url), ("bearer_token", args.bearer_token)) if v}
    if not args.source.startswith("s3://"):
        creds = {k: v for k, v in creds.items() if k == "bearer_token"}
    job = client.import_adapter(args.name, args.source, credentials=creds or None, wait=not args.no_wait)
    v = job.get("version") or {}
    line = f"import {job['id']}: {job['status']}" + (f", {args.name} v{v['number']} ({v['size_bytes']} bytes)"
                                                     if v else "")
    emit(args, job, line=line + (" (identical to an existing version)" if job.get("deduplicated") else ""))
    return 0
