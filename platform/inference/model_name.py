"""``model`` parsing: "<adapter>", "<adapter>:<version>", "<adapter>:<alias>", or the base model's name.

    parse_model("support-bot", base_names=["Qwen3-8B"])      -> ModelTarget(adapter="support-bot", alias="latest")
    parse_model("support-bot:3", ...)                        -> ModelTarget(adapter="support-bot", version=3)
    parse_model("support-bot:prod", ...)                     -> ModelTarget(adapter="support-bot", alias="prod")
    parse_model("qwen3-8b", base_names=["Qwen3-8B"])         -> ModelTarget(base=True)   (case-insensitive)

Adapter names and aliases follow the registry's patterns (no colon), so the first ``:`` splits. A base model name
wins over an adapter of the same name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

# the registry's patterns (platform/schemas/adapters.py), repeated so parsing needs no web stack
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
ALIAS_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
DEFAULT_ALIAS = "latest"
MAX_VERSION = 2**31 - 1      # the registry's version numbers are 32-bit
MAX_MODEL_CHARS = 256


class ModelNameError(ValueError):
    """``model`` names no base model and is no valid adapter reference (the gateway answers 404 model_not_found)."""


@dataclass(frozen=True)
class ModelTarget:
    """What a request's ``model`` names: the base model, or an adapter by version number or alias."""

    base: bool = False
    adapter: str | None = None
    version: int | None = None
    alias: str | None = None

    def __str__(self) -> str:
        if self.base:
            return "<base>"
        return f"{self.adapter}:{self.version if self.version is not None else self.alias}"


def parse_model(model: str, *, base_names: Iterable[str]) -> ModelTarget:
    """Parse ``model``; raises ``ModelNameError`` saying what form is expected."""
    if not isinstance(model, str) or not model.strip():
        raise ModelNameError("'model' must be an adapter name (optionally ':<version>' or ':<alias>') or the base "
                             "model's name")
    if len(model) > MAX_MODEL_CHARS:
        raise ModelNameError(f"'model' is {len(model)} characters; adapter references are at most "
                             f"{MAX_MODEL_CHARS}")
    model = model.strip()
    if model.lower() in {b.lower() for b in base_names if b}:
        return ModelTarget(base=True)
    name, sep, suffix = model.partition(":")
    if not NAME_RE.match(name):
        raise ModelNameError(f"the model {model!r} does not exist: adapter names are lowercase letters, digits, "
                             "'.', '_' and '-' (up to 64), optionally followed by ':<version>' or ':<alias>'")
    if not sep:
        return ModelTarget(adapter=name, alias=DEFAULT_ALIAS)
    if suffix.isascii() and suffix.isdigit():
        version = int(suffix) if len(suffix) <= 10 else MAX_VERSION + 1   # never past int's digit limit
        if not 1 <= version <= MAX_VERSION:
            raise ModelNameError(f"the model {model!r} does not exist: versions start at 1 (up to {MAX_VERSION})")
        return ModelTarget(adapter=name, version=version)
    if not ALIAS_RE.match(suffix):
        raise ModelNameError(f"the model {model!r} does not exist: after ':' put a version number or an alias "
                             "(lowercase letters, digits, '_' and '-', starting with a letter)")
    return ModelTarget(adapter=name, alias=suffix)
