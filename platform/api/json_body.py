"""Request bodies of the inference routes: JSON, nested at most ``MAX_DEPTH`` levels, every string valid UTF-8.

``json.loads`` alone lets through what later breaks a tokenizer, a database driver or a response encoder: a lone
surrogate (``"\\ud800"`` is valid JSON but no UTF-8 text), and nesting deep enough to exhaust the recursion limit
further down. Both are refused here with a 400 naming the field. Bodies are capped before this
(``body_limit.py``); above ``THREAD_BYTES`` the parse runs in a worker thread, off the event loop.
"""
from __future__ import annotations

import json
import re
from typing import Any

from starlette.concurrency import run_in_threadpool

from loraplex.platform.inference.errors import InferenceError

MAX_DEPTH = 32
THREAD_BYTES = 64 * 1024
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")   # only escapes can make lone surrogates in valid UTF-8 JSON


def _path(parts: list) -> str:
    """``parts`` as ``messages[0].content``; a lone surrogate in a key is written as its escape (``\\ud800``), so
    the error that names it is valid UTF-8 too."""
    out = ""
    for p in parts:
        if not isinstance(p, int):
            p = str(p).encode("utf-8", "backslashreplace").decode("utf-8")
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _check(value: Any, check_text: bool) -> None:
    stack: list[tuple[Any, list]] = [(value, [])]
    while stack:
        node, where = stack.pop()
        if len(where) > MAX_DEPTH:
            raise InferenceError(400, f"the request body nests deeper than {MAX_DEPTH} levels (at '{_path(where)}')",
                                 param=_path(where[:1]) or None, code="invalid_json")
        if isinstance(node, dict):
            for k, v in node.items():
                if check_text:
                    _text(k, where + [k])
                if isinstance(v, (dict, list)) or (check_text and isinstance(v, str)):
                    stack.append((v, where + [k]))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, (dict, list)) or (check_text and isinstance(v, str)):
                    stack.append((v, where + [i]))
        elif isinstance(node, str):
            _text(node, where)


def _text(text: str, where: list) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InferenceError(400, f"'{_path(where)}' holds a lone surrogate (an unpaired \\ud800-\\udfff escape); "
                             "send valid UTF-8 text", param=_path(where) or None, code="invalid_text") from None


def parse_json_body(raw: bytes) -> Any:
    """The parsed body; 400 for anything that is not JSON this API can process."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise InferenceError(400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json") \
            from None
    except (UnicodeDecodeError, ValueError):   # JSONDecodeError, and integers past Python's digit limit
        raise InferenceError(400, "the request body must be JSON (UTF-8, numbers of at most 4300 digits)",
                             code="invalid_json") from None
    _check(value, check_text=_SURROGATE_ESCAPE.search(raw) is not None)
    return value


async def parse_json_body_async(raw: bytes) -> Any:
    if len(raw) > THREAD_BYTES:
        return await run_in_threadpool(parse_json_body, raw)
    return parse_json_body(raw)
