"""Maps the repository's top-level folders into the ``loraplex`` namespace.

    engine/   -> loraplex.engine
    kernels/  -> loraplex.kernels
    platform/ -> loraplex.platform   (no __init__.py of its own: it would shadow the stdlib ``platform``)
"""
import os

from setuptools import setup

ROOTS = {"loraplex": "loraplex", "loraplex.engine": "engine", "loraplex.kernels": "kernels",
         "loraplex.platform": "platform"}


def _packages() -> list[str]:
    found = []
    for package, folder in ROOTS.items():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            if dirpath == folder or any(f.endswith(".py") for f in filenames):
                rel = os.path.relpath(dirpath, folder)
                found.append(package if rel == "." else package + "." + rel.replace(os.sep, "."))
    return found


setup(
    packages=_packages(),
    package_dir=ROOTS,
    package_data={"loraplex.platform": ["**/*.html", "**/*.js", "**/*.css", "**/*.json", "**/*.md", "**/LICENSE*"],
                  "loraplex.engine": ["**/*.json"]},
    include_package_data=True,
)
