"""Sub-commands of the ``loraplex`` CLI. Each module defines ``register(subparsers)``."""
from __future__ import annotations

import importlib

# Module names under loraplex.commands; each adds its own parser(s).
MODULES = ["generate"]


def register_all(subparsers) -> None:
    for name in MODULES:
        importlib.import_module(f"loraplex.commands.{name}").register(subparsers)
