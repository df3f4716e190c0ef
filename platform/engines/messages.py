"""What the platform sends to an engine and gets back (plain dataclasses; the JSON wire form is
``to_wire``/``from_wire``, the same dicts as ``loraplex.engine.server.protocol``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AdapterReference:
    """An adapter version as the engine needs it: ``adapter_id`` ("<tenant>/<adapter>/<version>", globally unique),
    the blob ``uri`` (file:// or s3://), ``sha256`` of its safetensors (verified after fetch), ``rank``, ``targets``."""

    adapter_id: str
    uri: str
    sha256: str | None = None
    rank: int | None = None
    targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.adapter_id or "://" not in self.uri:
            raise ValueError(f"an adapter reference needs an adapter_id and a uri with a scheme, got "
                             f"{self.adapter_id!r}, {self.uri!r}")
        object.__setattr__(self, "targets", tuple(self.targets))

    def to_wire(self) -> dict:
        return {"adapter_id": self.adapter_id, "uri": self.uri, "sha256": self.sha256, "rank": self.rank,
                "targets": list(self.targets)}


@dataclass(frozen=True)
class EngineRequest:
    """One generation: ``prompt`` as token ids (the gateway tokenizes, so quotas count exactly) or text;
    ``sampling`` holds ``SamplingParams`` fields (max_tokens, temperature, top_p, top_k, seed, stop_token_ids,
    ignore_eos); ``adapter`` None = the base model; ``tenant_weight`` (> 0) is the tenant's share of the engine's
    tenant-fair scheduling (its quota record's ``scheduling_weight``)."""

    request_id: str
    tenant_id: str | None
    prompt: list[int] | str
    sampling: dict[str, Any] = field(default_factory=dict)
    adapter: AdapterReference | None = None
    tenant_weight: float = 1.0

    def to_wire(self) -> dict:
        return {"request_id": self.request_id, "tenant_id": self.tenant_id, "tenant_weight": self.tenant_weight,
                "prompt": self.prompt, "sampling": self.sampling,
                "adapter": self.adapter.to_wire() if self.adapter else None}


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprob: the chosen token (id, text, logprob, rank, ``bytes``) and its ``top`` alternatives
    ``(id, text, logprob, bytes)``, best first. ``bytes`` is None unless the engine sent the raw bytes of a token
    that is part of a UTF-8 character (its text alone is U+FFFD); else the text's UTF-8 is the token's bytes."""

    id: int
    token: str
    logprob: float
    rank: int = 1
    top: tuple[tuple[int, str, float, tuple[int, ...] | None], ...] = ()
    bytes: tuple[int, ...] | None = None

    @property
    def token_bytes(self) -> list[int]:
        return list(self.bytes) if self.bytes is not None else list(self.token.encode("utf-8"))

    @classmethod
    def from_wire(cls, d: dict | None) -> "TokenLogprob | None":
        if d is None:
            return None
        top = tuple((int(t[0]), str(t[1]), float(t[2]), tuple(t[3]) if len(t) > 3 and t[3] is not None else None)
                    for t in d.get("top", ()))
        raw = d.get("bytes")
        return cls(id=int(d["id"]), token=str(d.get("token") or ""), logprob=float(d["logprob"]),
                   rank=int(d.get("rank", 1)), top=top, bytes=tuple(raw) if raw is not None else None)


@dataclass(frozen=True)
class OutputDelta:
    """One completion's part of a chunk: its ``index``, new tokens and text, ``finish_reason`` (in the chunk that
    ended it), ``cumulative_logprob`` so far and the new tokens' ``logprobs`` (None unless asked)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def from_wire(cls, d: dict) -> "OutputDelta":
        lps = d.get("logprobs")
        return cls(index=int(d.get("index", 0)), token_ids=list(d.get("token_ids", [])), text=d.get("text", ""),
                   finish_reason=d.get("finish_reason"), cumulative_logprob=float(d.get("cumulative_logprob") or 0.0),
                   logprobs=None if lps is None else [TokenLogprob.from_wire(e) for e in lps])


@dataclass(frozen=True)
class EngineChunk:
    """This step's new tokens of one request; the last chunk has ``finished=True`` and a ``finish_reason``
    ("stop", "length", "abort"). Token counts are cumulative (usage metering reads the last chunk);
    ``completion_tokens`` counts every completion's tokens.

    ``outputs``: the completions that changed in this chunk (an engine that sends none: one built from the
    top-level fields, index 0); ``prompt_logprobs``: on the last chunk of a request that asked for them."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    outputs: list[OutputDelta] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def from_wire(cls, d: dict) -> "EngineChunk":
        finished, reason = bool(d.get("finished")), d.get("finish_reason")
        token_ids, text = list(d.get("token_ids", [])), d.get("text", "")
        if d.get("outputs") is not None:
            outputs = [OutputDelta.from_wire(o) for o in d["outputs"]]
        elif token_ids or text or finished:
            outputs = [OutputDelta(0, token_ids, text, reason if finished else None)]
        else:
            outputs = []
        plp = d.get("prompt_logprobs")
        return cls(request_id=d["request_id"], token_ids=token_ids, text=text, finished=finished,
                   finish_reason=reason, prompt_tokens=int(d.get("prompt_tokens", 0)),
                   completion_tokens=int(d.get("completion_tokens", 0)), cached_tokens=int(d.get("cached_tokens", 0)),
                   outputs=outputs, prompt_logprobs=None if plp is None else [TokenLogprob.from_wire(e) for e in plp])


@dataclass(frozen=True)
class Residency:
    """What an engine holds: ``gpu`` {slot: adapter_id}, ``cpu`` ids, ``loading``, ``failed`` {id: reason},
    ``pinned``. ``raw`` is the engine's whole report (counters included)."""

    enabled: bool
    gpu: dict[int, str]
    cpu: list[str]
    loading: list[str]
    failed: dict[str, str]
    pinned: list[str]
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def resident_ids(self) -> frozenset[str]:
        """Adapters a request can use without a fetch (GPU slots and CPU tier): what the router prefers."""
        return frozenset(self.gpu.values()) | frozenset(self.cpu)

    @classmethod
    def from_wire(cls, d: dict) -> "Residency":
        return cls(enabled=bool(d.get("enabled", True)), gpu={int(k): v for k, v in (d.get("gpu") or {}).items()},
                   cpu=list(d.get("cpu") or []), loading=list(d.get("loading") or []),
                   failed=dict(d.get("failed") or {}), pinned=list(d.get("pinned") or []), raw=d)


@dataclass(frozen=True)
class EngineHealth:
    """``ready`` once the model is loaded; ``limits`` what the engine can serve (``limits.EngineLimits``; None
    when it reports none)."""

    ready: bool
    model: str | None = None
    detail: str | None = None
    in_flight: int | None = None
    limits: Any = None

    @classmethod
    def from_wire(cls, d: dict) -> "EngineHealth":
        from loraplex.platform.engines.limits import EngineLimits

        return cls(ready=bool(d.get("ready")), model=d.get("model"), detail=d.get("detail"),
                   in_flight=d.get("in_flight"), limits=EngineLimits.from_wire(d.get("limits")))
