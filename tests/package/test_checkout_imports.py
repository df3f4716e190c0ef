"""Run from a checkout, the repository root is on ``sys.path`` and its top-level folders (``kernels/``, ...) are
importable under their bare names; ``import loraplex`` gives such a name back to an installed distribution that
owns it (transformers imports Hugging Face's ``kernels``). Each case runs in a fresh interpreter without site
packages, with a stand-in ``kernels`` distribution in a folder of its own."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, *extra_path: str) -> str:
    # -S: no site packages (the standard library only), then the root first and the stand-in's folder last
    script = f"import sys; sys.path[:0] = [{ROOT!r}]; sys.path += {list(extra_path)!r}\n" + code
    done = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _installed_kernels(tmp_path) -> str:
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("ORIGIN = 'installed'\n")
    (site / "kernels-1.0.dist-info").mkdir()
    (site / "kernels-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 1.0\n")
    return str(site)


def test_an_installed_distribution_keeps_its_name_over_the_checkouts_folder(tmp_path):
    site = _installed_kernels(tmp_path)
    code = ("import loraplex; lazy = 'kernels' not in sys.modules; import kernels; "
            "print(lazy, getattr(kernels, 'ORIGIN', kernels.__file__))")
    assert _run(code, site) == "True installed"  # nothing imported until the name is
    # loraplex's own kernels are still the checkout's, under loraplex.kernels; sys.path is left as it was
    code = ("before = list(sys.path); import loraplex, loraplex.kernels.intmath as m; "
            "print(m.__file__.startswith(loraplex._root), sys.path == before)")
    assert _run(code, site) == "True True"


def test_without_an_installed_distribution_the_name_stays_the_checkouts(tmp_path):
    code = "import loraplex, kernels, os; print(os.path.dirname(os.path.dirname(kernels.__file__)) == loraplex._root)"
    assert _run(code, str(tmp_path)) == "True"


def test_a_checkout_folder_on_the_path_does_not_shadow_it_either(tmp_path):
    """A script or runner that puts ``tests/`` on sys.path, where ``tests/kernels`` is a package."""
    site = _installed_kernels(tmp_path)
    code = (f"sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); import loraplex, kernels; "
            "print(getattr(kernels, 'ORIGIN', kernels.__file__))")
    assert _run(code, site) == "installed"
