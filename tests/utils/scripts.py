"""Load a benchmark or check script (a file under benchmarks/, not a package module) as a module for its tests."""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script(*parts: str) -> ModuleType:
    """The module of ``benchmarks/<parts...>.py`` (e.g. ``load_script("engine", "train_tiny")``), executed once per
    call and registered in ``sys.modules`` under its file name (dataclasses and pickling look their module up)."""
    path = os.path.join(ROOT, "benchmarks", *parts[:-1], f"{parts[-1]}.py")
    spec = importlib.util.spec_from_file_location(parts[-1], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
