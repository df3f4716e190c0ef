"""loraplex: multi-tenant LoRA hosting on one shared base model.

Sub-packages live at the repository root (``engine/``, ``kernels/``, ``platform/``) and are mapped into this
namespace by ``setup.py``. When running straight from a checkout without installing (the GPU machine), the
repository root is added to this package's search path so ``loraplex.engine`` resolves to ``engine/``.
"""
import os as _os

__version__ = "0.1.0"

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "engine")) and _root not in __path__:
    __path__.append(_root)
