"""docs/platform.md's error-code table ("### Errors") names every ``code`` the API answers, and nothing else.

The codes are read from the source: string literals given as ``code=`` (or ``error_code=`` / ``duplicate_code=``:
codes stored or raised later) to a call or assigned to a variable named ``code`` (through ``a if c else b``,
``x or "default"``, dict values, ``{...}[key]`` and ``{...}.get(k, default)``), and the ``(code, message)`` tuples
of functions documented as returning them, over ``platform/`` and the adapter-format checks the upload route runs
(``engine/lora/format.py``); plus the engine's error types, which the gateway passes on as codes. A code built at
run time (an f-string) is not seen: keep codes literal.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from loraplex.engine.server.protocol import ERROR_TYPES

REPO = Path(__file__).resolve().parents[2]
# engine/lora/weights.py's codes stay inside the engine (a load failure is answered adapter_load_error)
SOURCES = [*sorted((REPO / "platform").rglob("*.py")), REPO / "engine" / "lora" / "format.py"]
NOT_API = {"platform/metrics/middleware.py"}    # reads the codes of answers (upload metrics), answers none
CODE = re.compile(r"^[a-z][a-z0-9_]*$")


def _values(node: ast.AST) -> set[str]:
    """String literals ``node`` can evaluate to."""
    if isinstance(node, ast.Constant):
        return {node.value} if isinstance(node.value, str) and CODE.match(node.value) else set()
    if isinstance(node, ast.IfExp):
        return _values(node.body) | _values(node.orelse)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_values(v) for v in node.values))
    if isinstance(node, ast.Dict):
        return set().union(*(_values(v) for v in node.values))
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
        return _values(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and isinstance(node.func.value, ast.Dict):
        return _values(node.func.value) | (_values(node.args[1]) if len(node.args) > 1 else set())
    return set()


def _codes_of(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found |= set().union(*(_values(kw.value) for kw in node.keywords
                                   if kw.arg and (kw.arg == "code" or kw.arg.endswith("_code"))))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name) and target.id == "code":
                    found |= _values(node.value)
                elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    found |= set().union(*(_values(v) for t, v in zip(target.elts, node.value.elts)
                                           if isinstance(t, ast.Name) and t.id == "code"))
        elif isinstance(node, ast.FunctionDef) and (ast.get_docstring(node) or "").startswith("``(code, message)``"):
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Tuple) and ret.value.elts:
                    found |= _values(ret.value.elts[0])
    return found


def source_codes() -> dict[str, set[str]]:
    """code -> files answering it."""
    out: dict[str, set[str]] = {}
    for path in SOURCES:
        rel = str(path.relative_to(REPO))
        if rel in NOT_API:
            continue
        for code in _codes_of(ast.parse(path.read_text(), filename=rel)):
            out.setdefault(code, set()).add(rel)
    for code in ERROR_TYPES:
        out.setdefault(code, set()).add("engine/server/protocol.py (ERROR_TYPES)")
    return out


def documented_codes() -> set[str]:
    text = (REPO / "docs" / "platform.md").read_text()
    section = text.split("### Errors", 1)[1].split("\n#", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    assert table and table[0].startswith("| code | status |"), "no error-code table under ### Errors"
    rows = table[1:]                                       # the separator row starts with "|-", not "| "
    return {code for row in rows for code in re.findall(r"`([a-z][a-z0-9_]*)`", row.split(" | ")[0])}


def test_the_scan_finds_the_codes_it_must():
    codes = source_codes()
    assert {"conversion_mismatch", "not_ready", "missing_adapter_config", "rate_limit_exceeded",
            "quota_store_unavailable", "lora_unavailable", "missing_required_parameter", "forbidden",
            "adapter_load_error"} <= codes.keys()
    assert not {"use_dora", "store_unavailable", ""} & codes.keys()       # a compared flag, a dict key


def test_every_code_the_api_answers_is_in_the_table_and_only_those():
    codes, documented = source_codes(), documented_codes()
    missing = {c: sorted(files) for c, files in codes.items() if c not in documented}
    assert not missing, f"codes answered but not in docs/platform.md's error table: {missing}"
    assert not documented - codes.keys(), f"codes in the table that nothing answers: {documented - codes.keys()}"
