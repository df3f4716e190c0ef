"""What the tenant commands (``loraplex adapters``, ``loraplex keys``) share: connection flags, the client, output
as a table or JSON, and one-line errors."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

CONNECTION_HELP = """connection (first found wins): --url/--api-key, the LORAPLEX_URL / LORAPLEX_API_KEY
environment variables, then the config file ~/.config/loraplex/config.toml ([default] or [profiles.NAME] with url
and api_key; LORAPLEX_CONFIG names another file)."""


def connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection")
    g.add_argument("--url", help="the platform's address (default: LORAPLEX_URL, the config file, or "
                                 "http://127.0.0.1:8000)")
    g.add_argument("--api-key", help="a tenant API key, lpx_... (default: LORAPLEX_API_KEY or the config file)")
    g.add_argument("--profile", help="a [profiles.NAME] table of the config file (default: LORAPLEX_PROFILE or "
                                     "[default])")
    g.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")


def run_with_client(fn: Callable[[Any, argparse.Namespace], int | None]) -> Callable[[argparse.Namespace], int]:
    """Wraps a command: builds the client from the flags, prints ``LoraplexError`` as one line (exit 1)."""
    def main(args: argparse.Namespace) -> int:
        from loraplex.client import LoraplexClient, LoraplexError

        try:
            with LoraplexClient(args.url, args.api_key, profile=args.profile) as client:
                return int(fn(client, args) or 0)
        except LoraplexError as e:
            print(f"loraplex: error: {e}", file=sys.stderr)
            return 1
    return main


def emit(args: argparse.Namespace, data: Any, rows: list[dict] | None = None,
         columns: list[tuple[str, str]] | None = None, line: str | None = None) -> None:
    """``--json``: the data as JSON; else a table of ``rows`` or one ``line``."""
    from loraplex.client import iter_table

    if args.json:
        print(json.dumps(data, indent=2, default=str))
    elif rows is not None and columns is not None:
        if rows:
            for text in iter_table(rows, columns):
                print(text)
        else:
            print("(none)")
    elif line is not None:
        print(line)
