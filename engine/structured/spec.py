"""What a request's output must match: ``StructuredOutput``, validated on construction (torch-free, no grammar library).

    StructuredOutput(json_schema={"type": "object", ...})            # strict by default
    StructuredOutput(json_schema=schema, strict=False)               # unsupported keywords ignored, not refused
    StructuredOutput(json_object=True)                               # any JSON object
    StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}")
    StructuredOutput(grammar='start: "yes" | "no"')                  # Lark (llguidance's dialect) or GBNF
    StructuredOutput(choice=["positive", "negative"])
    StructuredOutput.from_dict({"json_schema": {...}, "strict": True})   # the wire form; to_dict() gives it back

Exactly one of ``json_schema``, ``json_object``, ``regex``, ``grammar``, ``choice`` is set. ``strict`` matters for
JSON schemas only: True (default) refuses a schema with a keyword the grammar library does not implement
(``uniqueItems``, ``not``, ``if``/``then``, ``contains``, unknown ``format`` values, remote ``$ref``), naming it;
False compiles it anyway and leaves those keywords unchecked (every other keyword is still enforced).
``cache_key`` hashes the kind and the normalised payload (JSON with sorted keys), so equal schemas written in a
different key order share one compiled grammar.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_SPEC_BYTES = 256 * 1024   # a schema / grammar / regex / choice list, serialised
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    json_schema: dict | bool | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    strict: bool = True
    _key: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if self._is_set(k)]
        if len(set_kinds) != 1:
            got = ", ".join(set_kinds) if set_kinds else "none"
            raise ValueError(f"structured output needs exactly one of {', '.join(KINDS)}; got {got}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"structured.strict must be true or false, got {self.strict!r}")
        kind = set_kinds[0]
        payload = self._check(kind)
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if len(text.encode()) > MAX_SPEC_BYTES:
            raise ValueError(f"structured.{kind} is {len(text.encode())} bytes serialised; the limit is "
                             f"{MAX_SPEC_BYTES}")
        strict = self.strict if kind == "json_schema" else True
        digest = hashlib.sha256(f"{kind}\0{int(strict)}\0{text}".encode()).hexdigest()
        object.__setattr__(self, "_key", f"{kind}:{digest}")

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    def _check(self, kind: str) -> Any:
        """Validate the payload's shape; returns it in normalised (JSON-able) form."""
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured.json_object must be true or false, got {self.json_object!r}")
        if kind == "json_schema":
            schema = self.json_schema
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured.json_schema must be a JSON Schema object, got "
                                 f"{type(schema).__name__}")
            try:
                return json.loads(json.dumps(schema, allow_nan=False))
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured.json_schema is not plain JSON: {e}") from None
            except RecursionError:
                msg = "structured.json_schema is nested too deeply; flatten it (use $defs and $ref)"
                raise ValueError(msg) from None
        if kind == "json_object":
            return True
        if kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"structured.{kind} must be a non-empty string, got {value!r}")
            return value
        choice = self.choice
        if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
            raise ValueError(f"structured.choice must be a list of strings, got {choice!r}")
        if not choice or len(choice) > MAX_CHOICES:
            raise ValueError(f"structured.choice must have 1 to {MAX_CHOICES} strings, got {len(choice)}")
        if not all(isinstance(c, str) and c for c in choice):
            raise ValueError("structured.choice must hold non-empty strings only")
        object.__setattr__(self, "choice", tuple(choice))
        return list(choice)

    @property
    def kind(self) -> str:
        """Which of ``KINDS`` this is."""
        return next(k for k in KINDS if self._is_set(k))

    @property
    def cache_key(self) -> str:
        """``"<kind>:<sha256>"`` of the kind, ``strict`` (schemas) and the normalised payload."""
        return self._key

    @classmethod
    def from_dict(cls, d: Any) -> "StructuredOutput":
        """From the wire form ``{"json_schema": {...}, "strict": bool}`` / ``{"json_object": true}`` /
        ``{"regex": str}`` / ``{"grammar": str}`` / ``{"choice": [str, ...]}``; unknown keys are a ValueError."""
        if isinstance(d, StructuredOutput):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"structured must be an object with one of {', '.join(KINDS)}, got "
                             f"{type(d).__name__}")
        valid = (*KINDS, "strict")
        unknown = sorted(k for k in d if k not in valid)
        if unknown:
            raise ValueError(f"unknown structured field(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
        return cls(**d)

    def to_dict(self) -> dict:
        kind = self.kind
        d: dict[str, Any] = {kind: list(self.choice) if kind == "choice" else getattr(self, kind)}
        if kind == "json_schema":
            d["strict"] = self.strict
        return d
