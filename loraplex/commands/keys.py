"""``loraplex keys``: your tenant's API keys (self-service with a key of the tenant).

    loraplex keys list
    loraplex keys create ci-nightly          # prints the new key once: store it now
    loraplex keys revoke 0f3c...             # by id (from `keys list`); it stops working at once
"""
from __future__ import annotations

import argparse

from loraplex.commands._tenant import CONNECTION_HELP, connection_args, emit, run_with_client

COLUMNS = [("id", "id"), ("name", "name"), ("prefix", "prefix"), ("created", "created_at"),
           ("last used", "last_used_at"), ("revoked", "revoked_at")]


def register(subparsers) -> None:
    p = subparsers.add_parser("keys", help="list, create and revoke your tenant's API keys",
                              description=__doc__.replace("``", "") + "\n" + CONNECTION_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    c = sub.add_parser("list", help="every key of your tenant (never the keys themselves)")
    c.set_defaults(func=run_with_client(_list))
    connection_args(c)
    c = sub.add_parser("create", help="a new key (shown once)")
    c.add_argument("name", metavar="NAME", help="what the key is for, e.g. ci-nightly")
    c.set_defaults(func=run_with_client(_create))
    connection_args(c)
    c = sub.add_parser("revoke", help="revoke a key by id (it stops working at once)")
    c.add_argument("key_id", metavar="KEY_ID")
    c.set_defaults(func=run_with_client(_revoke))
    connection_args(c)


def _short(rows: list[dict]) -> list[dict]:
    return [{**r, **{k: (r.get(k) or "")[:19] or None for k in ("created_at", "last_used_at", "revoked_at")}}
            for r in rows]


def _list(client, args) -> int:
    rows = client.list_keys()
    emit(args, rows, _short(rows), COLUMNS)
    return 0


def _create(client, args) -> int:
    row = client.create_key(args.name)
    emit(args, row, line=f"key {row['name']!r} (id {row['id']}): {row['key']}\n"
                         "store it now: it is not shown again")
    return 0


def _revoke(client, args) -> int:
    row = client.revoke_key(args.key_id)
    emit(args, row, line=f"key {row['name']!r} ({row['prefix']}) revoked")
    return 0
