"""loraplex: multi-tenant LoRA hosting on one shared base model.

Sub-packages live at the repository root (``engine/``, ``kernels/``, ``platform/``) and are mapped into this
namespace by ``setup.py``. When running straight from a checkout without installing (the GPU machine), the
repository root is added to this package's search path so ``loraplex.engine`` resolves to ``engine/``.

Where the repository root itself is on ``sys.path`` (``python -m`` from the checkout, pytest), those folders are
also importable under their bare names and hide installed distributions of the same name: transformers (5.25 on)
imports Hugging Face's ``kernels`` distribution, and would get ``kernels/``. Importing this package first gives
such a name to the installed distribution (loraplex's own code always imports ``loraplex.kernels``).
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "engine")) and _root not in __path__:
    __path__.append(_root)


def _claim_installed(name: str) -> None:
    """Import the installed distribution ``name`` with the repository root off ``sys.path`` (so it, not the
    checkout's folder of that name, is ``sys.modules[name]``); nothing when none is installed or the root is not on
    ``sys.path``."""
    import importlib
    import importlib.metadata

    if name in _sys.modules or not _os.path.isdir(_os.path.join(_root, name)):
        return
    on_root = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) == _root]
    if not on_root:
        return
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return
    saved = list(_sys.path)
    _sys.path[:] = [p for p in saved if p not in on_root]
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a broken install is for its importer to report, not this package
        _sys.modules.pop(name, None)
    finally:
        _sys.path[:] = saved


_claim_installed("kernels")
