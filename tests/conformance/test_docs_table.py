"""docs/platform.md's compatibility table is the one ``parameters.py`` generates (regenerate it with
``compat_table()`` when the table changes)."""
from __future__ import annotations

from pathlib import Path

from loraplex.platform.inference.parameters import compat_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "platform.md"


def test_the_docs_table_is_generated_from_parameters_py():
    text = DOC.read_text()
    start, end = "<!-- compat-table:start -->\n", "<!-- compat-table:end -->"
    assert start in text and end in text
    shown = text.split(start, 1)[1].split(end, 1)[0]
    assert shown == compat_table(), "docs/platform.md's compatibility table is stale: paste compat_table() in"
