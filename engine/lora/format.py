"""PEFT LoRA adapter format checks, torch-free (the control plane validates uploads with them; the engine reuses
them at load).

    cfg = parse_adapter_config(json_bytes, max_rank=64)
    header = read_safetensors_header("adapter_model.safetensors")     # header only, never the tensor data
    spec = check_adapter(cfg, header, model_config, max_rank=64, base_model_name="Qwen/Qwen3-30B-A3B")

Tensor layout, as ``peft`` writes it (verified with peft 0.21 on tiny gpt_oss, qwen3_moe, mixtral, llama and qwen3
models; see tests/engine/lora/test_format.py):

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight        (r, in)
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight        (out, r)
    base_model.model.model.layers.{i}.mlp.experts[.base_layer]*.lora_A.weight   (r·E, in)
    base_model.model.model.layers.{i}.mlp.experts[.base_layer]*.lora_B.weight   (out, r·E)

Fused-expert targets (``target_parameters``: ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``) are
wrapped one inside the other on the same ``experts`` module, so their tensor names differ only by the number of
``base_layer.`` segments (the first parameter PEFT wraps, gate_up_proj, is the innermost). The names alone do
not say which is which; the shapes do: gate_up_proj is in=H, out=2·I and down_proj is in=I, out=H (I = the
per-expert intermediate size), which can never both match one pair. ``check_adapter`` resolves each pair by
shape and records the tensor names per module in ``AdapterSpec.modules``.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.patterns import MAX_PATTERNS, PatternError, check_full_pattern, compile_suffix_pattern

MAX_HEADER_BYTES = 16 * 1024 * 1024
# Bounds on what an adapter's files may declare, checked before any work grows with them.
MAX_CONFIG_BYTES = 1024 * 1024
MAX_CONFIG_DEPTH = 32            # PEFT's configs nest 3 deep (loftq_config, eva_config)
MAX_RANK_ABSOLUTE = 4096         # whatever the deployment allows: r, rank_pattern values
# PEFT's LoraConfig defaults: a config that leaves out r or lora_alpha means these (never alpha = r).
PEFT_DEFAULT_R, PEFT_DEFAULT_ALPHA = 8, 8
MAX_LORA_SCALING = 1024.0        # |alpha / r| (alpha / sqrt(r) for rsLoRA); see docs/adapters.md, "Limits"
MAX_TARGETS = 64                 # entries of target_modules / target_parameters
MAX_TENSORS = 65536              # tensors in one safetensors header (a 128-layer model with 9 targets has 2,304)
MAX_TENSOR_NAME_CHARS = 512
MAX_TENSOR_DIMS = 8
MAX_TENSOR_DIM = 1 << 40
ATTENTION_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
DENSE_MLP_TARGETS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
EXPERT_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + DENSE_MLP_TARGETS + EXPERT_TARGETS
ALLOWED_DTYPES = ("F32", "F16", "BF16")
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# Flags of LoraConfig that change the math in ways loraplex does not serve: flag -> what to do instead.
_REFUSED_FLAGS = {
    "use_dora": "DoRA adapters are not supported; retrain with use_dora=False",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported; retrain with "
                       "modules_to_save=None",
    "lora_bias": "LoRA bias (lora_bias=True) is not supported; retrain with lora_bias=False",
    "trainable_token_indices": "trainable_token_indices is not supported; retrain without it",
    "fan_in_fan_out": "fan_in_fan_out=True (Conv1D weights) is not supported; the base model uses nn.Linear",
    "layer_replication": "layer_replication is not supported; retrain without it",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) is not supported; retrain as plain LoRA",
}
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.([A-Za-z0-9_.]+?)\.((?:base_layer\.)*)lora_([AB])\.weight$")


class AdapterFormatError(ValueError):
    """An adapter that loraplex cannot serve. ``code`` is a short machine-readable reason; the message names
    the problem and what to fix."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


# ---- adapter_config.json ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraConfig:
    """The parts of a PEFT ``adapter_config.json`` that loraplex uses."""

    r: int
    alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()  # a list of names, or one regular expression (PEFT allows both)
    target_parameters: tuple[str, ...] = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None
    _rank_matchers: tuple = field(default=(), repr=False, compare=False)   # ((matcher, rank), ...) in file order
    _alpha_matchers: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rank_pattern and not self._rank_matchers:
            object.__setattr__(self, "_rank_matchers", _matchers(self.rank_pattern, "rank_pattern"))
        if self.alpha_pattern and not self._alpha_matchers:
            object.__setattr__(self, "_alpha_matchers", _matchers(self.alpha_pattern, "alpha_pattern"))

    _memo: dict = field(default_factory=dict, repr=False, compare=False)   # (map, key) -> value

    def rank_for(self, key: str) -> int:
        """Rank of the module or parameter ``key`` (``model.layers.0.self_attn.q_proj``), after ``rank_pattern``."""
        if ("r", key) not in self._memo:
            self._memo["r", key] = int(_pattern_value(self._rank_matchers, key, self.r))
        return self._memo["r", key]

    def alpha_for(self, key: str) -> float:
        if ("alpha", key) not in self._memo:
            self._memo["alpha", key] = float(_pattern_value(self._alpha_matchers, key, self.alpha))
        return self._memo["alpha", key]

    def scaling_for(self, key: str) -> float:
        return lora_scaling(self.alpha_for(key), self.rank_for(key), self.use_rslora)


def lora_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """alpha / r, or alpha / sqrt(r) for rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _matchers(patterns: dict[str, Any], where: str) -> tuple:
    try:
        return tuple((compile_suffix_pattern(p, where=where), v) for p, v in patterns.items())
    except PatternError as e:
        raise AdapterFormatError(str(e), code="bad_pattern") from None


def _pattern_value(matchers: tuple, key: str, default: Any) -> Any:
    # Same rule as PEFT: the first pattern (in file order) that matches a dotted suffix of the key (patterns.py).
    for matches, value in matchers:
        if matches(key):
            return value
    return default


def parse_adapter_config(data: bytes | str | dict, *, max_rank: int | None = None) -> LoraConfig:
    """Parses and checks a PEFT ``adapter_config.json`` (bytes, text or the parsed dict).

    Bounded before parsing work grows: at most ``MAX_CONFIG_BYTES``, nesting ``MAX_CONFIG_DEPTH``; duplicate keys,
    NaN / Infinity and lone surrogates are refused; ``r`` and ``rank_pattern`` values are integers in
    [1, ``MAX_RANK_ABSOLUTE``] (and ``max_rank``), ``lora_alpha`` and ``alpha_pattern`` values finite and positive
    with a scaling of at most ``MAX_LORA_SCALING``; a missing ``r`` / ``lora_alpha`` takes PEFT's default (8 / 8);
    patterns are matched in linear time (``patterns.py``)."""
    if isinstance(data, dict):
        d = data
        _check_json_tree(d, "adapter_config.json")
    else:
        if len(data) > MAX_CONFIG_BYTES:
            raise AdapterFormatError(f"adapter_config.json is {len(data)} bytes, over the {MAX_CONFIG_BYTES}-byte "
                                     "limit; upload the file PEFT's save_pretrained wrote", code="config_invalid")
        d = load_json(data, what="adapter_config.json", code="config_invalid", max_depth=MAX_CONFIG_DEPTH)
    if not isinstance(d, dict):
        raise AdapterFormatError("adapter_config.json must be a JSON object", code="config_invalid")
    peft_type = d.get("peft_type", "")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterFormatError(f"peft_type is {_short(peft_type)}; only LoRA adapters (peft_type \"LORA\") "
                                 "are supported", code="config_unsupported")
    for flag, advice in _REFUSED_FLAGS.items():
        if d.get(flag):
            code = "dora" if flag == "use_dora" else "config_unsupported"
            raise AdapterFormatError(f"{flag}={_short(d[flag])}: {advice}", code=code)
    bias = d.get("bias", "none")
    if bias != "none":
        raise AdapterFormatError(f"bias={_short(bias)}: trained biases are not supported; retrain with "
                                 "bias=\"none\"", code="config_unsupported")
    use_rslora = d.get("use_rslora", False)
    if use_rslora is not None and not isinstance(use_rslora, bool):
        raise AdapterFormatError(f"use_rslora must be true or false, got {_short(use_rslora)}", code="config_invalid")
    use_rslora = bool(use_rslora)
    r = _rank(d.get("r", PEFT_DEFAULT_R), "r", max_rank)
    alpha = _alpha(d.get("lora_alpha", PEFT_DEFAULT_ALPHA), "lora_alpha", r, use_rslora)
    rank_pattern = _pattern_map(d.get("rank_pattern"), "rank_pattern",
                                lambda v, key: _rank(v, f"rank_pattern[{key!r}]", max_rank))
    alpha_pattern = _pattern_map(d.get("alpha_pattern"), "alpha_pattern",
                                 lambda v, key: _alpha(v, f"alpha_pattern[{key!r}]", None, use_rslora))
    target_modules = d.get("target_modules") or ()
    if isinstance(target_modules, str):
        try:
            check_full_pattern(target_modules, where="target_modules")
        except PatternError as e:
            raise AdapterFormatError(str(e), code="bad_pattern") from None
    else:
        target_modules = _name_list(target_modules, "target_modules")
        for t in target_modules:
            if not _is_known_module_target(t):
                raise AdapterFormatError(
                    f"unsupported target {t!r} in target_modules; supported: "
                    f"{', '.join(t.rsplit('.', 1)[-1] for t in ATTENTION_TARGETS + DENSE_MLP_TARGETS)} "
                    "(and mlp.experts.gate_up_proj / mlp.experts.down_proj through target_parameters)",
                    code="unsupported_target")
    target_parameters = _name_list(d.get("target_parameters") or (), "target_parameters")
    for t in target_parameters:
        if _expert_param(t) is None:
            raise AdapterFormatError(f"unsupported target {t!r} in target_parameters; supported: "
                                     f"{', '.join(EXPERT_TARGETS)}", code="unsupported_target")
    if not target_modules and not target_parameters:
        raise AdapterFormatError("adapter_config.json names no target_modules and no target_parameters",
                                 code="config_invalid")
    base = d.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise AdapterFormatError(f"base_model_name_or_path must be a string, got {_short(base)}",
                                 code="config_invalid")
    return LoraConfig(r=r, alpha=alpha, use_rslora=use_rslora, target_modules=target_modules,
                      target_parameters=target_parameters, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                      base_model_name_or_path=base or None)


def _short(value: Any) -> str:
    """``repr`` of a tenant's value for a message, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rank(value: Any, name: str, max_rank: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AdapterFormatError(f"{name} must be a positive integer, got {_short(value)}", code="config_invalid")
    limit = min(max_rank, MAX_RANK_ABSOLUTE) if max_rank is not None else MAX_RANK_ABSOLUTE
    if value > limit:
        raise AdapterFormatError(f"{name}: rank {value if value < 10**12 else _short(value)} exceeds this "
                                 f"deployment's limit of {limit}; retrain with r <= {limit}", code="rank_too_high")
    return value


def _alpha(value: Any, name: str, rank: int | None, use_rslora: bool) -> float:
    """A positive finite alpha; with ``rank``, its scaling alpha / r (alpha / sqrt(r) with rsLoRA) must be at most
    MAX_LORA_SCALING (a pattern's alpha is checked per module, where its rank is known: ``check_adapter``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AdapterFormatError(f"{name} must be a positive number, got {_short(value)}", code="config_invalid")
    try:
        alpha = float(value)
    except OverflowError:
        alpha = math.inf
    if not math.isfinite(alpha) or alpha <= 0:
        raise AdapterFormatError(f"{name} must be a positive finite number, got {_short(value)}",
                                 code="config_invalid")
    if rank is not None:
        check_scaling(lora_scaling(alpha, rank, use_rslora), f"{name}={alpha:g} with r={rank}")
    return alpha


def check_scaling(scaling: float, what: str) -> None:
    if not math.isfinite(scaling) or not 0 < scaling <= MAX_LORA_SCALING:
        raise AdapterFormatError(f"{what} gives a LoRA scaling of {scaling:g}, outside (0, {MAX_LORA_SCALING:g}]; "
                                 "lora_alpha is usually r or 2*r (scaling 1-2): retrain or fix lora_alpha",
                                 code="config_invalid")


def _pattern_map(value: Any, name: str, check) -> dict:
    if value is None or value == {}:
        return {}
    if not isinstance(value, dict):
        raise AdapterFormatError(f"{name} must map module patterns to numbers, got {_short(value)}",
                                 code="config_invalid")
    if len(value) > MAX_PATTERNS:
        raise AdapterFormatError(f"{name} has {len(value)} patterns, over the limit of {MAX_PATTERNS}; merge them "
                                 "into fewer patterns", code="config_invalid")
    return {str(k): check(v, k) for k, v in value.items()}


def _name_list(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) and 0 < len(t) <= 256 for t in value):
        raise AdapterFormatError(f"{name} must be a list of module names (or one pattern string), got "
                                 f"{_short(value)}", code="config_invalid")
    if len(value) > MAX_TARGETS:
        raise AdapterFormatError(f"{name} lists {len(value)} entries, over the limit of {MAX_TARGETS}",
                                 code="config_invalid")
    return tuple(value)


class _DuplicateKey(ValueError):
    pass


class _NonFiniteNumber(ValueError):
    pass


def _unique_pairs(pairs: list) -> dict:
    d = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


def _no_constant(name: str):
    raise _NonFiniteNumber(name)


def load_json(raw: bytes | str, *, what: str, code: str, max_depth: int | None = None,
              duplicate_code: str | None = None) -> Any:
    """``json.loads`` for a tenant's file: malformed text, a duplicate key, NaN / Infinity, integers past Python's
    digit limit and nesting too deep for the parser's recursion (or past ``max_depth``, with lone surrogates in
    any string, when given) are ``AdapterFormatError(code)`` naming ``what``."""
    try:
        value = json.loads(raw, object_pairs_hook=_unique_pairs, parse_constant=_no_constant)
    except _DuplicateKey as e:
        raise AdapterFormatError(f"{what} has the key {_short(e.args[0])} twice; a JSON object names each key once "
                                 "(save the file again)", code=duplicate_code or code) from None
    except _NonFiniteNumber as e:
        raise AdapterFormatError(f"{what} holds {e.args[0]}, which is not a JSON number; write a finite number",
                                 code=code) from None
    except RecursionError:
        raise AdapterFormatError(f"{what} nests too deep to parse; upload the file as PEFT / safetensors wrote it",
                                 code=code) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, and int() past sys.get_int_max_str_digits()
        raise AdapterFormatError(f"{what} is not valid JSON ({str(e)[:200]}); upload the file PEFT's "
                                 "save_pretrained wrote", code=code) from None
    if max_depth is not None:
        _check_json_tree(value, what, max_depth=max_depth, code=code)
    return value


def _check_json_tree(value: Any, what: str, *, max_depth: int = MAX_CONFIG_DEPTH, code: str = "config_invalid") -> None:
    """Iteratively: nesting at most ``max_depth``, no lone surrogate in any string and no number that overflowed
    to infinity (``1e999``): neither can be stored as JSON."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise AdapterFormatError(f"{what} nests deeper than {max_depth} levels; upload the file PEFT wrote",
                                     code=code)
        if isinstance(node, dict):
            for k, v in node.items():
                _check_text(k, what, code)
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list, str, float)))
        elif isinstance(node, str):
            _check_text(node, what, code)
        elif isinstance(node, float) and not math.isfinite(node):
            raise AdapterFormatError(f"{what} holds a number too large for a float (it reads as {node}); write a "
                                     "finite number", code=code)


def _check_text(text: Any, what: str, code: str) -> None:
    if isinstance(text, str) and not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise AdapterFormatError(f"{what} holds the string {_short(text)} with a lone surrogate (an unpaired "
                                     "\\ud800-\\udfff escape); write valid UTF-8", code=code) from None


def _is_known_module_target(t: str) -> bool:
    short = t.rsplit(".", 1)[-1]
    return any(s.rsplit(".", 1)[-1] == short and (t == short or t.endswith(s) or s.endswith(t))
               for s in ATTENTION_TARGETS + DENSE_MLP_TARGETS)


def _expert_param(t: str) -> str | None:
    """``mlp.experts.gate_up_proj`` for any accepted spelling of an expert target, else None."""
    for full in EXPERT_TARGETS:
        short = full.rsplit(".", 1)[-1]
        if t == short or t.endswith("experts." + short):
            return full
    return None


def check_base_model(adapter_base: str | None, deployment_base: str | None, aliases: tuple[str, ...] = ()) -> None:
    """The adapter's ``base_model_name_or_path`` must name the deployment's base model.

    Rule: case-insensitive, it equals the deployment's name or an alias, or its last path component equals the
    last path component of one of them (``/data/Qwen3-8B`` matches ``Qwen/Qwen3-8B``). A missing name is
    accepted (the tensor shapes must still fit the base model)."""
    if not adapter_base or not deployment_base:
        return
    def norm(s: str) -> str:
        return s.strip().rstrip("/").lower()
    names = [norm(n) for n in (deployment_base, *aliases) if n]
    mine = norm(adapter_base)
    if mine in names or mine.rsplit("/", 1)[-1] in {n.rsplit("/", 1)[-1] for n in names}:
        return
    raise AdapterFormatError(
        f"adapter was trained on base model {adapter_base!r} but this deployment serves {deployment_base!r}; "
        f"retrain on {deployment_base!r} (or set base_model_name_or_path to it if it is the same model)",
        code="base_model_mismatch")


# ---- safetensors header ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors header checked against the file size: every tensor's bytes lie inside the file, tensors
    tile the data section with no gap or overlap, and the file is exactly as long as the header promises."""

    header_bytes: int
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return 8 + self.header_bytes


def read_safetensors_header(source: str | os.PathLike | BinaryIO, *,
                            max_header_bytes: int = MAX_HEADER_BYTES) -> SafetensorsHeader:
    """Reads and checks a safetensors header without reading tensor data.

    Layout: 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets}}``,
    then the data section (offsets are relative to its start)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return read_safetensors_header(f, max_header_bytes=max_header_bytes)
    f = source
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise AdapterFormatError(f"adapter_model.safetensors is {size} bytes, too short to be a safetensors file; "
                                 "save the adapter with safe_serialization=True", code="not_safetensors")
    # A pickle (0x80 + protocol) or torch zip ("PK\x03\x04") start is only a hint: 0x80 is also a valid low byte
    # of the header length, so the pickle message is given only when the file does not parse as safetensors.
    looks_pickled = head[:4] == b"PK\x03\x04" or (head[0] == 0x80 and 2 <= head[1] <= 5)

    def refuse(message: str, code: str) -> AdapterFormatError:
        if looks_pickled:
            return AdapterFormatError("adapter_model.safetensors is a PyTorch pickle checkpoint, not safetensors; "
                                      "save the adapter with save_pretrained(..., safe_serialization=True)",
                                      code="not_safetensors")
        return AdapterFormatError(message, code=code)

    n = int.from_bytes(head, "little")
    if n > max_header_bytes:
        raise refuse(f"safetensors header declares {n} bytes, over the {max_header_bytes}-byte limit; "
                     "this is not a valid adapter file (save it again with safetensors)", "header_too_large")
    if 8 + n > size:
        raise refuse(f"adapter_model.safetensors is truncated: its header declares {n} bytes but the "
                     f"file has {size - 8} after the length; upload the complete file", "truncated")
    raw = f.read(n)
    try:
        d = load_json(raw, what="the safetensors header", code="not_safetensors", duplicate_code="duplicate_tensor")
    except AdapterFormatError as e:
        if e.code == "duplicate_tensor" and not looks_pickled:
            raise
        raise refuse("adapter_model.safetensors does not start with a safetensors JSON header; "
                     "save the adapter with safe_serialization=True", "not_safetensors") from None
    if not isinstance(d, dict):
        raise AdapterFormatError("safetensors header is not a JSON object; save the adapter again with safetensors",
                                 code="not_safetensors")
    metadata = d.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise AdapterFormatError("safetensors header field __metadata__ must be a JSON object of strings, got "
                                 f"{type(metadata).__name__}; save the adapter again with safetensors",
                                 code="not_safetensors")
    for k, v in metadata.items():
        if not isinstance(v, str):
            raise AdapterFormatError(f"safetensors __metadata__ value of {_short(k)} is a {type(v).__name__}, not a "
                                     "string; save the adapter again with safetensors", code="not_safetensors")
        _check_text(k, "the safetensors __metadata__", "not_safetensors")
        _check_text(v, "the safetensors __metadata__", "not_safetensors")
    if len(d) > MAX_TENSORS:
        raise AdapterFormatError(f"the safetensors header lists {len(d)} tensors, over the limit of {MAX_TENSORS}; "
                                 "this is not a LoRA adapter of a supported model", code="not_safetensors")
    data_start, data_len = 8 + n, size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, t in d.items():
        tensors[name] = _tensor_info(name, t, data_start, data_len)
    covered = 0
    for t in sorted(tensors.values(), key=lambda t: t.begin):
        if t.begin != data_start + covered:
            raise AdapterFormatError(f"tensor {t.name!r} starts at data offset {t.begin - data_start} but the "
                                     f"previous tensor ends at {covered}: overlapping or gapped data; save the "
                                     "adapter again with safetensors", code="not_safetensors")
        covered += t.nbytes
    if covered != data_len:  # covered < data_len: _tensor_info bounds every tensor by data_len
        raise AdapterFormatError(f"adapter_model.safetensors has {data_len - covered} bytes after the last tensor; "
                                 "upload the file exactly as safetensors wrote it", code="not_safetensors")
    return SafetensorsHeader(header_bytes=n, file_size=size, tensors=tensors, metadata=dict(metadata))


def _tensor_info(name: str, t: Any, data_start: int, data_len: int) -> TensorInfo:
    if len(name) > MAX_TENSOR_NAME_CHARS:
        raise AdapterFormatError(f"tensor name {name[:60]!r}... is {len(name)} characters, over the "
                                 f"{MAX_TENSOR_NAME_CHARS}-character limit; this is not a PEFT tensor name",
                                 code="not_safetensors")
    if not isinstance(t, dict):
        raise AdapterFormatError(f"safetensors entry {_short(name)} is not an object", code="not_safetensors")
    dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise AdapterFormatError(f"tensor {_short(name)} has unknown dtype {_short(dtype)}", code="not_safetensors")
    if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS
            or not all(type(s) is int and 0 <= s <= MAX_TENSOR_DIM for s in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
        raise AdapterFormatError(f"tensor {_short(name)} has a malformed shape or data_offsets (at most "
                                 f"{MAX_TENSOR_DIMS} non-negative dimensions)", code="not_safetensors")
    if offsets[1] > data_len:
        raise AdapterFormatError(f"adapter_model.safetensors is truncated: tensor {name!r} ends at data offset "
                                 f"{offsets[1]} but the file holds {data_len} bytes of data; upload the complete file",
                                 code="truncated")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise AdapterFormatError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape} {dtype}",
                                 code="not_safetensors")
    return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


# ---- adapter against the base model ----------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraModule:
    """One adapted module of one layer. ``num_experts`` > 0 for fused-expert targets, whose lora_A is
    (rank·E, in_features) and lora_B (out_features, rank·E): rank ``rank`` per expert."""

    layer: int
    target: str  # one of SUPPORTED_TARGETS
    rank: int
    alpha: float
    scaling: float
    in_features: int
    out_features: int
    lora_a: str  # tensor names in the safetensors file
    lora_b: str
    num_experts: int = 0


@dataclass(frozen=True)
class AdapterSpec:
    """What the registry and the engine need to know about a validated adapter."""

    rank: int  # the largest rank of any module
    alpha: float
    scaling: float  # of the config's r and lora_alpha; modules carry their own (rank_pattern / alpha_pattern)
    use_rslora: bool
    targets: tuple[str, ...]
    modules: tuple[LoraModule, ...]
    dtype: str
    num_parameters: int
    base_model_name_or_path: str | None

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({m.layer for m in self.modules}))


def _module_dims(model: ModelConfig, layer: int, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a target in a layer."""
    h, i_dense, i_moe = model.hidden_size, model.intermediate_size, model.moe_intermediate_size
    return {
        "self_attn.q_proj": (h, model.q_size), "self_attn.k_proj": (h, model.kv_size),
        "self_attn.v_proj": (h, model.kv_size), "self_attn.o_proj": (model.q_size, h),
        "mlp.gate_proj": (h, i_dense), "mlp.up_proj": (h, i_dense), "mlp.down_proj": (i_dense, h),
        "mlp.experts.gate_up_proj": (h, 2 * i_moe), "mlp.experts.down_proj": (i_moe, h),
    }[target]


def serving_targets(model: ModelConfig) -> tuple[str, ...]:
    """The LoRA targets an engine on ``model`` serves: attention always, dense MLP targets if any layer is dense,
    fused-expert targets if any layer is a mixture of experts."""
    layers = range(model.num_layers)
    moe = [model.is_moe_layer(i) for i in layers] if model.is_moe else [False] * model.num_layers
    return (ATTENTION_TARGETS + (DENSE_MLP_TARGETS if not all(moe) else ())
            + (EXPERT_TARGETS if any(moe) else ()))


def max_adapter_bytes(model: ModelConfig, *, max_rank: int, targets: tuple[str, ...] | None = None) -> int:
    """The largest ``adapter_model.safetensors`` an engine can hold: every target of every layer at ``max_rank``,
    in F32 (the widest accepted dtype), plus a header of ``MAX_HEADER_BYTES``."""
    targets = serving_targets(model) if targets is None else targets
    total = 0
    for layer in range(model.num_layers):
        moe = model.is_moe and model.is_moe_layer(layer)
        for target in targets:
            if (target in EXPERT_TARGETS) != moe and target not in ATTENTION_TARGETS:
                continue
            fan_in, fan_out = _module_dims(model, layer, target)
            total += max_rank * (fan_in + fan_out) * (model.num_experts if target in EXPERT_TARGETS else 1)
    return 8 + MAX_HEADER_BYTES + 4 * total


def check_adapter(config: LoraConfig, header: SafetensorsHeader, model: ModelConfig, *, max_rank: int,
                  base_model_name: str | None = None, base_model_aliases: tuple[str, ...] = ()) -> AdapterSpec:
    """Checks a parsed config and safetensors header against the base model; returns the adapter's spec."""
    check_base_model(config.base_model_name_or_path, base_model_name, base_model_aliases)
    if config.target_parameters and not model.is_moe:
        raise AdapterFormatError(f"target_parameters {list(config.target_parameters)} target fused experts, but the "
                                 f"base model ({model.family}) is dense; target only attention and MLP modules",
                                 code="unsupported_target")
    if not header.tensors:
        raise AdapterFormatError("adapter_model.safetensors holds no tensors", code="no_tensors")
    dtypes = sorted({t.dtype for t in header.tensors.values()})
    for dt in dtypes:
        if dt not in ALLOWED_DTYPES:
            raise AdapterFormatError(f"tensor dtype {dt} is not supported; save the adapter in one of "
                                     f"{', '.join(ALLOWED_DTYPES)}", code="bad_dtype")
    if len(dtypes) > 1:
        raise AdapterFormatError(f"tensors mix dtypes {', '.join(dtypes)}; save every tensor in one dtype",
                                 code="bad_dtype")
    pairs: dict[tuple[int, str, int], dict[str, TensorInfo]] = {}
    for t in header.tensors.values():
        m = _TENSOR_NAME.match(t.name)
        if not m:
            raise _unsupported_tensor(t.name)
        layer, module, depth, ab = int(m[1]), m[2], m[3].count("base_layer."), m[4]
        if layer >= model.num_layers:
            raise AdapterFormatError(f"tensor {_short(t.name)} is for layer {_short(layer)} but the base model has "
                                     f"{model.num_layers} layers; is this adapter for another base model?",
                                     code="bad_shape")
        if module != "mlp.experts" and (depth or module not in ATTENTION_TARGETS + DENSE_MLP_TARGETS):
            raise AdapterFormatError(f"tensor {t.name!r} adapts {module!r}, which loraplex does not serve; supported "
                                     f"targets: {', '.join(SUPPORTED_TARGETS)}", code="unsupported_target")
        pairs.setdefault((layer, module, depth), {})[ab] = t
    modules: list[LoraModule] = []
    for (layer, module, depth), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterFormatError(f"{next(iter(ab.values())).name!r} has no matching {missing} tensor; upload "
                                     "the complete adapter_model.safetensors", code="bad_shape")
        a, b = ab["A"], ab["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise AdapterFormatError(f"{a.name} {list(a.shape)} and {b.name} {list(b.shape)} do not form a LoRA "
                                     "pair: expected lora_A (r, in) and lora_B (out, r)", code="bad_shape")
        if module == "mlp.experts":
            modules.append(_expert_module(config, model, layer, a, b))
        else:
            modules.append(_plain_module(config, model, layer, module, a, b))
    seen: set[tuple[int, str]] = set()
    for mod in modules:
        if (mod.layer, mod.target) in seen:
            raise AdapterFormatError(f"layer {mod.layer} has two LoRA pairs for {mod.target}", code="bad_shape")
        seen.add((mod.layer, mod.target))
        check_scaling(mod.scaling, f"{mod.target} of layer {mod.layer}: alpha={mod.alpha:g} with r={mod.rank}")
    worst = max(m.rank for m in modules)
    if worst > max_rank:
        raise AdapterFormatError(f"rank {worst} exceeds this deployment's limit of {max_rank}; retrain with "
                                 f"r <= {max_rank}", code="rank_too_high")
    num_params = sum(math.prod(t.shape) for t in header.tensors.values())
    return AdapterSpec(rank=worst, alpha=config.alpha, scaling=lora_scaling(config.alpha, config.r, config.use_rslora),
                       use_rslora=config.use_rslora, targets=tuple(sorted({m.target for m in modules})),
                       modules=tuple(modules), dtype=dtypes[0], num_parameters=num_params,
                       base_model_name_or_path=config.base_model_name_or_path)


def _unsupported_tensor(name: str) -> AdapterFormatError:
    if "lora_magnitude_vector" in name:
        return AdapterFormatError(f"tensor {name!r} is a DoRA magnitude; DoRA is not supported, retrain with "
                                  "use_dora=False", code="dora")
    if "lora_embedding" in name:
        return AdapterFormatError(f"tensor {name!r} adapts an embedding; supported targets: "
                                  f"{', '.join(SUPPORTED_TARGETS)}", code="unsupported_target")
    if re.search(r"lora_[AB]\.bias$", name):
        return AdapterFormatError(f"tensor {name!r} is a LoRA bias; retrain with lora_bias=False",
                                  code="config_unsupported")
    return AdapterFormatError(f"tensor {name!r} is not a LoRA weight of a supported target; supported targets: "
                              f"{', '.join(SUPPORTED_TARGETS)} in model.layers.N", code="unsupported_target")


def _plain_module(config: LoraConfig, model: ModelConfig, layer: int, module: str, a: TensorInfo,
                  b: TensorInfo) -> LoraModule:
    if module in DENSE_MLP_TARGETS and model.is_moe_layer(layer):
        raise AdapterFormatError(f"layer {layer} of the base model is a mixture of experts and has no {module}; "
                                 "target mlp.experts.gate_up_proj / mlp.experts.down_proj with target_parameters",
                                 code="unsupported_target")
    if isinstance(config.target_modules, tuple) and config.target_modules and not any(
            module == t or module.endswith("." + t) or t.endswith(module) for t in config.target_modules):
        raise AdapterFormatError(f"tensor {a.name!r} adapts {module} but adapter_config.json's target_modules "
                                 f"{list(config.target_modules)} does not list it", code="bad_shape")
    fan_in, fan_out = _module_dims(model, layer, module)
    key = f"model.layers.{layer}.{module}"
    r = config.rank_for(key)
    if a.shape != (r, fan_in) or b.shape != (fan_out, r):
        raise AdapterFormatError(
            f"{module} of layer {layer}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the base model; "
            f"expected lora_A [{r}, {fan_in}] and lora_B [{fan_out}, {r}] (r={r}, in={fan_in}, out={fan_out}); "
            "was the adapter trained on this base model?", code="bad_shape")
    return LoraModule(layer=layer, target=module, rank=r, alpha=config.alpha_for(key),
                      scaling=config.scaling_for(key), in_features=fan_in, out_features=fan_out,
                      lora_a=a.name, lora_b=b.name)


def _expert_module(config: LoraConfig, model: ModelConfig, layer: int, a: TensorInfo, b: TensorInfo) -> LoraModule:
    if not model.is_moe_layer(layer):
        raise AdapterFormatError(f"tensor {a.name!r} adapts fused experts of layer {layer}, but that layer of the "
                                 f"base model ({model.family}) has no experts", code="unsupported_target")
    rows, fan_in, fan_out, e = a.shape[0], a.shape[1], b.shape[0], model.num_experts
    target = next((t for t in EXPERT_TARGETS if _module_dims(model, layer, t) == (fan_in, fan_out)), None)
    if target is None:
        h, i = model.hidden_size, model.moe_intermediate_size
        raise AdapterFormatError(
            f"experts of layer {layer}: lora_A {list(a.shape)} / lora_B {list(b.shape)} fit neither gate_up_proj "
            f"(lora_A [r*{e}, {h}], lora_B [{2 * i}, r*{e}]) nor down_proj (lora_A [r*{e}, {i}], lora_B [{h}, r*{e}]) "
            "of the base model; was the adapter trained on this base model?", code="bad_shape")
    if not any(_expert_param(t) == target for t in config.target_parameters):
        raise AdapterFormatError(f"tensor {a.name!r} adapts {target} but adapter_config.json's target_parameters "
                                 f"{list(config.target_parameters)} does not list it", code="bad_shape")
    key = f"model.layers.{layer}.{target}"
    r = config.rank_for(key)
    if rows != r * e:
        raise AdapterFormatError(f"{target} of layer {layer}: lora_A has {rows} rows, expected rank {r} x {e} "
                                 f"experts = {r * e}; was the adapter trained on this base model?", code="bad_shape")
    return LoraModule(layer=layer, target=target, rank=r, alpha=config.alpha_for(key),
                      scaling=config.scaling_for(key), in_features=fan_in, out_features=fan_out,
                      lora_a=a.name, lora_b=b.name, num_experts=e)
