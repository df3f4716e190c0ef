"""Speculative decoding settings of one engine (``EngineConfig.speculative``), validated on construction.

    SpeculativeConfig(method="ngram", num_speculative_tokens=3)                     # prompt lookup, no model
    SpeculativeConfig(method="draft", draft_model="/models/small", num_speculative_tokens=4)
    SpeculativeConfig(method="draft", draft_model="/models/small", draft_adapters={"t/a/1": "/adapters/t/a/1"})
    SpeculativeConfig(method="eagle", draft_head="/models/target-eagle-head", num_speculative_tokens=3)
    SpeculativeConfig(method="eagle3", draft_head="/models/EAGLE3-LLaMA3.1-Instruct-8B", num_speculative_tokens=3)
    SpeculativeConfig(method="replay", replay_acceptance_rate=acceptance_rate_for(2.5, 3), num_speculative_tokens=3)

``replay`` is for benchmarks only: it proposes the tokens of a recorded non-speculative run (given to the
proposer by the benchmark) and, with ``replay_forced``, accepts them at the set rate whatever the target says, so
that the cost of proposing and verifying can be measured at a chosen acceptance length on dummy weights.
"""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft", "eagle", "eagle3", "replay")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """``method``: "ngram" (prompt lookup), "draft" (a small causal LM sharing the tokenizer, ``draft_model``),
    "eagle" (a draft head on the target's hidden states, ``draft_head``: eagle_head.py), "eagle3" (a published
    EAGLE-3 draft on the target's aux hidden states, ``draft_head``: eagle3_checkpoint.py) or "replay" (benchmarks).
    ``num_speculative_tokens``: k, the most drafts a sequence verifies per step.

    ``verify_cuda_graphs``: verify steps as flattened decode rows through CUDA graphs (row j of a sequence's k + 1
    tokens is a one-token decode at its position; docs/engine.md, "Speculative decoding"); False (the default)
    runs every verify step eagerly. ``verify_graph_max_rows``: the largest verify step (sequences x (k + 1)) with
    a graph; larger ones run eagerly."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    # ngram: the longest suffix of ngram_max .. ngram_min tokens that occurred before proposes what followed it
    ngram_min: int = 1
    ngram_max: int = 4
    # draft: an HF folder of one of the engine's families with the target's vocabulary
    draft_model: str | None = None
    # draft and eagle3: the draft's KV pool (default: max_num_seqs full sequences) and catch-up tokens per step
    draft_num_kv_blocks: int | None = None
    draft_max_batched_tokens: int | None = None  # default: max_num_batched_tokens
    draft_load_format: str = "auto"              # auto | safetensors | dummy (benchmarks)
    # per-adapter drafts: target adapter_id -> the folder of a LoRA of the draft model (or a folder holding it in a
    # ``draft/`` subfolder, draft_lora.py); None: no LoRA on the draft; {} attaches it for drafts registered later
    draft_adapters: dict[str, str] | None = None
    draft_max_lora_rank: int = 16
    discover_draft_adapters: bool = False        # also use the draft/ folder beside each file:// adapter, if any
    # eagle: the folder of a draft head trained on this target's hidden states (eagle_head.py); eagle3: the folder
    # of a published EAGLE-3 draft of this target (config.json + weights, eagle3_checkpoint.py)
    draft_head: str | None = None
    draft_heads: dict[str, str] | None = None    # adapter id -> a head trained under that adapter (rest: draft_head)
    # replay (benchmarks): P(a replayed draft is accepted), independently per position
    replay_acceptance_rate: float = 0.8
    replay_forced: bool = True                   # the plan decides acceptance; False: the target decides
    replay_seed: int = 0
    verify_cuda_graphs: bool = False
    verify_graph_max_rows: int = 256

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; choose one of {', '.join(METHODS)}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("ngram_min", self.ngram_min, 1, 64)
        _check_int("ngram_max", self.ngram_max, self.ngram_min, 64)
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model: the folder of a small causal LM that "
                             "shares the target's tokenizer")
        if self.method != "draft" and self.draft_model:
            raise ValueError(f"draft_model is set but the speculative method is {self.method!r}; use method='draft'")
        if self.method == "eagle" and not self.draft_head:
            raise ValueError("speculative method 'eagle' needs draft_head: the folder of a draft head trained on the "
                             "target's hidden states (config.json + model.safetensors)")
        if self.method == "eagle3" and not self.draft_head:
            raise ValueError("speculative method 'eagle3' needs draft_head: the folder of a published EAGLE-3 draft "
                             "of the target (config.json + model.safetensors or pytorch_model.bin)")
        if self.method == "eagle3" and self.draft_heads:
            raise ValueError("draft_heads is set but method 'eagle3' serves one draft for every adapter; use "
                             "draft_head")
        if self.method not in ("eagle", "eagle3") and (self.draft_head or self.draft_heads):
            raise ValueError(f"draft_head(s) set but the speculative method is {self.method!r}; use method='eagle' "
                             "or 'eagle3'")
        if self.draft_heads is not None and (not isinstance(self.draft_heads, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.draft_heads.items())):
            raise ValueError(f"draft_heads must map adapter ids to head folders (non-empty strings), got "
                             f"{self.draft_heads!r}")
        for name in ("draft_num_kv_blocks", "draft_max_batched_tokens"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 1, 1 << 40)
        if self.draft_adapters is not None:
            if self.method != "draft":
                raise ValueError(f"draft_adapters is set but the speculative method is {self.method!r}; per-adapter "
                                 "drafts are LoRAs of a draft model: use method='draft'")
            if not isinstance(self.draft_adapters, dict) or not all(
                    isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.draft_adapters.items()):
                raise ValueError("draft_adapters must map adapter ids to draft LoRA folders (non-empty strings), got "
                                 f"{self.draft_adapters!r}")
        _check_int("draft_max_lora_rank", self.draft_max_lora_rank, 1, 1024)
        if not isinstance(self.discover_draft_adapters, bool):
            raise ValueError(f"discover_draft_adapters must be a bool, got {self.discover_draft_adapters!r}")
        if self.discover_draft_adapters and self.method != "draft":
            raise ValueError(f"discover_draft_adapters is set but the speculative method is {self.method!r}; "
                             "per-adapter drafts are LoRAs of a draft model: use method='draft'")
        if self.draft_load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"draft_load_format {self.draft_load_format!r}: expected auto, safetensors or dummy")
        rate = self.replay_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"replay_acceptance_rate must be in [0, 1], got {rate!r}")
        self.replay_acceptance_rate = float(rate)
        for name in ("replay_forced", "verify_cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("replay_seed", self.replay_seed, 0, 2**63 - 1)
        _check_int("verify_graph_max_rows", self.verify_graph_max_rows, 1, 1 << 16)

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, or its dict form (an EngineConfig read from JSON)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"unknown speculative setting(s) {', '.join(unknown)}; valid: "
                                 f"{', '.join(cls.__dataclass_fields__)}")
            return cls(**value)
        raise ValueError(f"speculative must be None, a SpeculativeConfig or a dict, got {type(value).__name__}")


def expected_acceptance_length(rate: float, k: int) -> float:
    """Mean tokens per verify step when each of k drafts is accepted independently with probability ``rate``
    (until the first rejection) plus the target's own token: 1 + rate + rate^2 + ... + rate^k."""
    return 1.0 + sum(rate ** i for i in range(1, k + 1))


def acceptance_rate_for(length: float, k: int) -> float:
    """The per-draft acceptance rate giving mean acceptance length ``length`` (in [1, k + 1]) with k drafts."""
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"acceptance length {length} is outside [1, {k + 1}] for k={k} drafts; raise k")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_acceptance_length(mid, k) < length else (lo, mid)
    return (lo + hi) / 2


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
