"""Wire types of the engine's internal API, as plain dataclasses over JSON dicts (no torch, no web stack).

    POST /v1/generate   GenerateRequest.to_dict()  ->  NDJSON lines, one chunk dict each:
      (body: {"request_id", "tenant_id", "tenant_weight", "prompt", "sampling", "adapter"})
      {"request_id", "token_ids": [new ids], "text": "new text", "finished", "finish_reason",
       "prompt_tokens", "completion_tokens", "cached_tokens"}
      an error after the stream started is a last line {"request_id", "finished": true, "error": {"message","type"}}

``sampling`` holds ``SamplingParams`` fields by name; among them (absent = off, so older clients are unaffected):

      "structured": {"json_schema": {...}, "strict": true} | {"json_object": true} | {"regex": "..."} |
                    {"grammar": "<Lark or GBNF>"} | {"choice": ["a", "b"]}       (engine/structured/spec.py)
      "logit_bias": {"<token id>": bias in [-100, 100], ...}                       (JSON object keys are strings)
      "speculative": false       opt out of speculative decoding on an engine that speculates (absent = true)

A grammar that does not compile (unsupported keyword, syntax error) is a 400 ``invalid_request`` naming the
problem, sent before any token, like every other invalid sampling field.

The top-level ``token_ids`` / ``text`` / ``finish_reason`` are the first completion's (what clients of one
sequence read); ``completion_tokens`` counts the output tokens of every completion reported. A request with
``n > 1``, ``best_of`` or ``logprobs`` also gets, per chunk, the completions that changed in it:

      "outputs": [{"index", "token_ids": [new ids], "text": "new text", "finish_reason" (once, when it ended),
                   "cumulative_logprob", "logprobs": [entry per new token] | null}]

and a request with ``prompt_logprobs`` gets on its last chunk ``"prompt_logprobs": [null, entry, ...]`` (one per
prompt token; the first has none). A logprob entry is ``{"id", "token" (its text), "logprob", "rank",
"top": [[id, token, logprob], ...]}`` (best first); the values are the model's raw distribution. A token whose
text alone is not valid UTF-8 (part of a character: U+FFFD) also has its raw bytes: ``"bytes": [..]`` in an
entry, a fourth element in a ``top`` item.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from loraplex.engine.fairness import MAX_TENANT_WEIGHT

ERROR_TYPES = ("invalid_request", "adapter_load_error", "adapter_fetch_unavailable", "engine_unavailable",
               "engine_error")


class RequestFormatError(ValueError):
    """A request body that does not fit the protocol; the message names the field and what to send."""


def _need(d: dict, key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    value = d.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise RequestFormatError(f"{key!r} must be {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise RequestFormatError(f"{key!r} must be {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


@dataclass(frozen=True)
class AdapterSpec:
    """The adapter reference the platform sends: ``adapter_id`` ("<tenant>/<adapter>/<version>"), the blob ``uri``
    (file:// or s3://), the ``sha256`` of its safetensors, and (informational) ``rank`` and ``targets``."""

    adapter_id: str
    uri: str
    sha256: str | None = None
    rank: int | None = None
    targets: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: Any) -> "AdapterSpec":
        if not isinstance(d, dict):
            raise RequestFormatError(f"'adapter' must be an object {{adapter_id, uri, sha256, rank, targets}} or "
                                     f"null, got {type(d).__name__}")
        targets = d.get("targets") or []
        if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
            raise RequestFormatError(f"'adapter.targets' must be a list of module names, got {targets!r}")
        adapter_id = _need(d, "adapter_id", str)
        uri = _need(d, "uri", str)
        if not adapter_id or "://" not in uri:
            raise RequestFormatError(f"adapter needs a non-empty 'adapter_id' and a 'uri' with a scheme "
                                     f"(file://, s3://), got {adapter_id!r}, {uri!r}")
        return cls(adapter_id=adapter_id, uri=uri, sha256=_need(d, "sha256", str, optional=True),
                   rank=_need(d, "rank", int, optional=True), targets=tuple(targets))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: ``prompt`` is text or token ids; ``sampling`` is ``SamplingParams`` as a dict;
    ``tenant_id`` and ``tenant_weight`` (a number > 0, default 1) place it in the engine's tenant-fair
    scheduling (a tenant of weight 2 gets twice the service of one of weight 1 when both are backlogged)."""

    request_id: str
    prompt: str | list[int]
    sampling: dict = field(default_factory=dict)
    adapter: AdapterSpec | None = None
    tenant_id: str | None = None
    tenant_weight: float = 1.0

    @classmethod
    def from_dict(cls, d: Any) -> "GenerateRequest":
        if not isinstance(d, dict):
            raise RequestFormatError(f"the request body must be a JSON object, got {type(d).__name__}")
        request_id = _need(d, "request_id", str)
        if not request_id:
            raise RequestFormatError("'request_id' must be a non-empty string")
        prompt = d.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            raise RequestFormatError("'prompt' must be a string or a list of token ids (integers)")
        sampling = d.get("sampling") or {}
        if not isinstance(sampling, dict):
            raise RequestFormatError(f"'sampling' must be an object of SamplingParams fields, got {sampling!r}")
        adapter = d.get("adapter")
        weight = _need(d, "tenant_weight", (int, float), optional=True)
        if weight is not None and not 0 < weight <= MAX_TENANT_WEIGHT:
            raise RequestFormatError(f"'tenant_weight' must be a number in (0, {MAX_TENANT_WEIGHT:g}], got {weight!r}")
        return cls(request_id=request_id, prompt=prompt, sampling=dict(sampling),
                   adapter=AdapterSpec.from_dict(adapter) if adapter is not None else None,
                   tenant_id=_need(d, "tenant_id", str, optional=True),
                   tenant_weight=1.0 if weight is None else float(weight))

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "tenant_id": self.tenant_id, "tenant_weight": self.tenant_weight,
                "prompt": self.prompt, "sampling": self.sampling,
                "adapter": self.adapter.to_dict() if self.adapter else None}


def chunk_dict(request_id: str, token_ids: list[int], text: str, *, finished: bool, finish_reason: str | None,
               prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, outputs: list[dict] | None = None,
               prompt_logprobs: list[dict | None] | None = None) -> dict:
    d = {"request_id": request_id, "token_ids": token_ids, "text": text, "finished": finished,
         "finish_reason": finish_reason, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "cached_tokens": cached_tokens}
    if outputs is not None:
        d["outputs"] = outputs
    if prompt_logprobs is not None:
        d["prompt_logprobs"] = prompt_logprobs
    return d


def output_dict(index: int, token_ids: list[int], text: str, *, finish_reason: str | None = None,
                cumulative_logprob: float = 0.0, logprobs: list[dict] | None = None) -> dict:
    """One completion's part of a chunk (``chunk_dict(outputs=[...])``)."""
    return {"index": index, "token_ids": token_ids, "text": text, "finish_reason": finish_reason,
            "cumulative_logprob": cumulative_logprob, "logprobs": logprobs}


def logprob_dict(token_id: int, token: str, logprob: float, rank: int, top: list[tuple] = (),
                 raw_bytes: list[int] | None = None) -> dict:
    """One position's logprob entry: the chosen token (id, text, logprob, rank) and the ``top`` alternatives
    ``(id, text, logprob[, bytes])``; ``raw_bytes`` only for a token whose text alone is not valid UTF-8."""
    d = {"id": token_id, "token": token, "logprob": logprob, "rank": rank, "top": [list(t) for t in top]}
    if raw_bytes is not None:
        d["bytes"] = list(raw_bytes)
    return d


def error_dict(message: str, type_: str) -> dict:
    """``{"error": {"message", "type"}}``; ``type_`` is one of ``ERROR_TYPES``."""
    assert type_ in ERROR_TYPES, type_
    return {"error": {"message": message, "type": type_}}


def limits_dict(model_config: Any, *, lora: bool, max_lora_rank: int, max_loras: int | None,
                max_model_len: int | None, quantization: str | None,
                targets: tuple[str, ...] | None = None) -> dict:
    """An engine's serving limits, as ``GET /health`` reports them under ``"limits"``:

        {"lora": true, "max_lora_rank": 16, "max_loras": 4, "targets": ["self_attn.q_proj", ...],
         "dtypes": ["F32", "F16", "BF16"], "quantization": null, "max_adapter_bytes": 17095176,
         "max_model_len": 4096}

    ``targets``: the LoRA targets the engine's slots hold that the model has (default: every one the model has);
    ``max_adapter_bytes``: the largest adapter file those targets take at ``max_lora_rank`` in F32."""
    from loraplex.engine.lora.format import ALLOWED_DTYPES, max_adapter_bytes, serving_targets

    served = serving_targets(model_config)
    if targets is not None:
        served = tuple(t for t in served if t in targets)
    return {"lora": lora, "max_lora_rank": max_lora_rank if lora else 0, "max_loras": max_loras if lora else 0,
            "targets": list(served) if lora else [], "dtypes": list(ALLOWED_DTYPES), "quantization": quantization,
            "max_adapter_bytes": max_adapter_bytes(model_config, max_rank=max_lora_rank, targets=served)
            if lora else 0, "max_model_len": max_model_len}
