"""The ``loraplex`` command line. Sub-commands register themselves (``loraplex/commands/``); each lives in its own
module."""
from __future__ import annotations

import argparse
import sys

DESCRIPTION = """loraplex hosts many tenants' LoRA fine-tunes of one shared base model, each behind an OpenAI-compatible
endpoint, on shared GPUs.

Try it:        loraplex demo                     (a tiny random model on CPU, no services needed)
Operate it:    loraplex db upgrade && loraplex serve
Use it:        loraplex adapters upload ./my-lora --name support-bot     (LORAPLEX_URL, LORAPLEX_API_KEY)

Run `loraplex COMMAND --help` for a command's options."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from loraplex.commands import register_all

    register_all(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except _settings_errors() as e:     # a LORAPLEX_* setting refused: one line per setting, no traceback
        from loraplex.commands.serve import _one_line

        print(f"loraplex {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _settings_errors() -> tuple[type[BaseException], ...]:
    """pydantic's ValidationError where the platform is installed; nothing on a GPU image without the web stack
    (the engine and bench commands run there)."""
    try:
        from pydantic import ValidationError
    except ImportError:
        return ()
    return (ValidationError,)


if __name__ == "__main__":
    sys.exit(main())
