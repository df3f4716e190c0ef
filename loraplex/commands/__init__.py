"""Sub-commands of the ``loraplex`` CLI. Every module here defines ``register(subparsers)``; they are found
by listing this package, so adding a command is adding a file."""
from __future__ import annotations

import importlib
import pkgutil


def register_all(subparsers) -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").register(subparsers)
