"""loraplex: multi-tenant LoRA hosting on one shared base model.

Sub-packages live at the repository root (``engine/``, ``kernels/``, ``platform/``) and are mapped into this
namespace by ``setup.py``. When running straight from a checkout without installing (the GPU machine), the
repository root is added to this package's search path so ``loraplex.engine`` resolves to ``engine/``.

Where the repository root itself is on ``sys.path`` (``python -m`` from the checkout, pytest), those folders are
also importable under their bare names and hide installed distributions of the same name: transformers (5.25 on)
imports Hugging Face's ``kernels`` distribution, and would get ``kernels/``. Importing this package first gives
such a name to the installed distribution, when it is imported (loraplex's own code always imports
``loraplex.kernels``).
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "engine")) and _root not in __path__:
    __path__.append(_root)


class _InstalledFirst:
    """Meta-path finder: the top-level names of the checkout's folders resolve to an installed distribution of that
    name when there is one (searched on ``sys.path`` without the repository root and the checkout's folders), else
    as before. Costs nothing until such a name is imported."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if path is not None or fullname not in self.names:
            return None
        from importlib.machinery import PathFinder

        rest = [p for p in _sys.path if not _in_checkout(p)]
        if len(rest) == len(_sys.path):
            return None  # no checkout folder on sys.path: the normal search is already right
        return PathFinder.find_spec(fullname, rest)  # None: not installed, the normal search goes on


def _in_checkout(entry: str) -> bool:
    """Whether a sys.path entry is the repository root or a folder of the checkout (``tests/``, for one, holds a
    ``kernels`` package of its own), not a site-packages folder inside it (a virtualenv)."""
    full = _os.path.abspath(entry or _os.curdir)
    if full != _root and not full.startswith(_root + _os.sep):
        return False
    parts = full.split(_os.sep)
    return "site-packages" not in parts and "dist-packages" not in parts


if _os.path.isdir(_os.path.join(_root, "kernels")) and not any(isinstance(f, _InstalledFirst) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _InstalledFirst(("kernels",)))
