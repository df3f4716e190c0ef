"""PEFT's semantics of a LoRA adapter, computed from the raw ``adapter_config.json`` and safetensors tensors: the
reference the upload-time numerical check (``numerical_check.py``) holds the engine's conversion against.

It is written apart from the engine's adapter code (``loraplex.engine.lora.format`` / ``weights``) on purpose, so
that a bug there cannot hide in both sides: it parses the config dict itself, matches targets and patterns with
PEFT's rules, reads the tensors as stored and computes each module's delta the way PEFT's layers do
(tests/platform/uploads/test_numerical_check.py holds it against ``peft`` itself on every family):

    plain module  (``lora.Linear``):   delta(x) = scaling * B (A x)               A [r, in], B [out, r]
    fused experts (``lora.ParamWrapper`` of ``target_parameters``), expert e:
                  delta_e(x) = scaling * B_e (A_e x),  A_e = A[e*r:(e+1)*r]       A [r*E, in] (expert-major rows)
                                                       B_e = B[:, e::E]           B [out, r*E] (rank-major columns)
                  (PEFT's ``get_delta_weight``: einsum "o r e, e r i" over A.reshape(E, r, in), B.reshape(out, r, E))
    scaling = alpha / r, or alpha / sqrt(r) with use_rslora; r and alpha after rank_pattern / alpha_pattern:
    the first pattern (file order) matching the module key ``model.layers.3.self_attn.q_proj`` (or the parameter
    key ``model.layers.3.mlp.experts.gate_up_proj``) as ``(.*\\.)?(pattern)`` wins -- PEFT's ``get_pattern_key``.
    Missing ``r`` / ``lora_alpha`` take LoraConfig's defaults (8 / 8).

A tensor pair PEFT would not apply (its module is not targeted by ``target_modules`` / ``target_parameters``, is
excluded by ``exclude_modules`` or lies outside ``layers_to_transform``) contributes nothing. ``fan_in_fan_out``
only changes how PEFT stores a merged base weight, never ``B (A x)``, so it plays no part here. Outputs are in
the Hugging Face module's order: GPT-OSS's fused ``gate_up_proj`` interleaves gate (even) and up (odd) columns,
the other families concatenate [gate; up] (``gate_up_columns``). Patterns are matched by RE2 (linear time: they
are the tenant's text).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from loraplex.engine.config import ModelConfig

PEFT_DEFAULT_R, PEFT_DEFAULT_ALPHA = 8, 8
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
GATE_UP_INTERLEAVED = frozenset({"gpt_oss"})   # HF families whose fused experts interleave gate / up columns
_NAME = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.([A-Za-z0-9_.]+?))\.((?:base_layer\.)*)"
                   r"lora_([AB])\.weight$")


@dataclass(frozen=True)
class PeftModule:
    """One LoRA pair of the file as PEFT reads it. ``applied`` False: PEFT loads no layer for it (``why``)."""

    key: str           # model.layers.3.self_attn.q_proj, or model.layers.3.mlp.experts.down_proj
    layer: int
    target: str        # self_attn.q_proj, or mlp.experts.down_proj
    lora_a: str        # tensor names
    lora_b: str
    rank: int
    scaling: float
    num_experts: int   # 0: a plain module
    applied: bool = True
    why: str = ""


def _re2():
    import re2

    return re2


class PeftConfigView:
    """The fields of a PEFT ``LoraConfig`` (as a saved ``adapter_config.json`` dict) that decide the math."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.r = int(d.get("r", PEFT_DEFAULT_R))
        self.alpha = float(d.get("lora_alpha", PEFT_DEFAULT_ALPHA))
        self.use_rslora = bool(d.get("use_rslora") or False)
        self.target_modules = d.get("target_modules") or ()
        self.target_parameters = tuple(d.get("target_parameters") or ())
        self.exclude_modules = d.get("exclude_modules") or ()
        layers = d.get("layers_to_transform")
        self.layers_to_transform = None if layers is None else {layers} if isinstance(layers, int) else set(layers)
        self.rank_pattern = dict(d.get("rank_pattern") or {})
        self.alpha_pattern = dict(d.get("alpha_pattern") or {})
        self._compiled: dict[str, Any] = {}

    def _fullmatch(self, pattern: str, key: str) -> bool:
        if pattern not in self._compiled:
            self._compiled[pattern] = _re2().compile(pattern)
        return self._compiled[pattern].fullmatch(key) is not None

    def _pattern_value(self, patterns: dict[str, Any], key: str, default: Any) -> Any:
        for pattern, value in patterns.items():             # file order; the first match wins
            if self._fullmatch(rf"(?:.*\.)?(?:{pattern})", key):
                return value
        return default

    def rank_alpha(self, key: str) -> tuple[int, float]:
        return (int(self._pattern_value(self.rank_pattern, key, self.r)),
                float(self._pattern_value(self.alpha_pattern, key, self.alpha)))

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def _listed(self, names: Any, key: str) -> bool:
        if isinstance(names, str):
            return self._fullmatch(names, key)
        return any(key == t or key.endswith("." + t) for t in names)

    def targets_module(self, key: str, layer: int) -> str:
        """'' when PEFT wraps module ``key``, else why not."""
        if self.exclude_modules and self._listed(self.exclude_modules, key):
            return "exclude_modules excludes it"
        if not self.target_modules or not self._listed(self.target_modules, key):
            return "target_modules does not name it"
        if not isinstance(self.target_modules, str) and self.layers_to_transform is not None \
                and layer not in self.layers_to_transform:
            return "layers_to_transform leaves its layer out"
        return ""

    def targets_parameter(self, key: str) -> str:
        if any(key == t or key.endswith("." + t) for t in self.target_parameters):
            return ""
        return "target_parameters does not name it"


def _hf_modules(model: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """(in, out) of every LoRA-targetable Linear of one layer of the Hugging Face model."""
    h = model.hidden_size
    out = {"self_attn.q_proj": (h, model.q_size), "self_attn.k_proj": (h, model.kv_size),
           "self_attn.v_proj": (h, model.kv_size), "self_attn.o_proj": (model.q_size, h)}
    if not (model.is_moe and model.is_moe_layer(layer)):
        i = model.intermediate_size
        out.update({"mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)})
    return out


def _hf_expert_params(model: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each fused expert parameter of one layer (none on a dense layer)."""
    if not (model.is_moe and model.is_moe_layer(layer)):
        return {}
    h, i = model.hidden_size, model.moe_intermediate_size
    return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}


def peft_modules(config: dict[str, Any], shapes: dict[str, tuple[int, ...]], model: ModelConfig) -> list[PeftModule]:
    """Every LoRA pair of a safetensors file (``shapes``: tensor name -> shape) as PEFT would load it onto the
    base model ``model``. Raises ValueError for what PEFT itself would refuse to load (a lone lora_A or lora_B,
    shapes that do not fit the module at its rank)."""
    cfg = PeftConfigView(config)
    pairs: dict[tuple[str, int], dict[str, str]] = {}
    for name in shapes:
        m = _NAME.match(name)
        if m is None:
            raise ValueError(f"tensor {name!r} is not a LoRA weight PEFT would load onto model.layers")
        pairs.setdefault((m[1], m[4].count("base_layer.")), {})[m[5]] = name
    out = []
    for (module_key, _depth), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{next(iter(ab.values()))!r} has no lora_{'B' if 'A' in ab else 'A'} partner")
        a_shape, b_shape = shapes[ab["A"]], shapes[ab["B"]]
        layer = int(module_key.split(".")[2])
        module = module_key.split(".", 3)[3]
        if module == "mlp.experts":
            out.append(_expert_pair(cfg, model, module_key, layer, ab, a_shape, b_shape))
        else:
            out.append(_plain_pair(cfg, model, module_key, layer, module, ab, a_shape, b_shape))
    return out


def _plain_pair(cfg, model, key, layer, module, ab, a_shape, b_shape) -> PeftModule:
    dims = _hf_modules(model, layer).get(module) if layer < model.num_layers else None
    why = "the base model has no such module" if dims is None else cfg.targets_module(key, layer)
    r, alpha = cfg.rank_alpha(key)
    if not why and (tuple(a_shape) != (r, dims[0]) or tuple(b_shape) != (dims[1], r)):
        raise ValueError(f"{key}: lora_A {list(a_shape)} / lora_B {list(b_shape)} do not fit PEFT's layer "
                         f"(r={r}, in={dims[0]}, out={dims[1]})")
    return PeftModule(key=key, layer=layer, target=module, lora_a=ab["A"], lora_b=ab["B"], rank=r,
                      scaling=cfg.scaling(r, alpha), num_experts=0, applied=not why, why=why)


def _expert_pair(cfg, model, module_key, layer, ab, a_shape, b_shape) -> PeftModule:
    fan_in, fan_out = a_shape[-1], b_shape[0]
    params = _hf_expert_params(model, layer) if layer < model.num_layers else {}
    param = next((p for p, dims in params.items() if dims == (fan_in, fan_out)), None)
    target = f"mlp.experts.{param or '?'}"
    key = f"{module_key}.{param or '?'}"
    why = "no fused expert parameter of the base model has these shapes" if param is None \
        else cfg.targets_parameter(key)
    r, alpha = cfg.rank_alpha(key)
    e = model.num_experts
    if not why and (tuple(a_shape) != (r * e, fan_in) or tuple(b_shape) != (fan_out, r * e)):
        raise ValueError(f"{key}: lora_A {list(a_shape)} / lora_B {list(b_shape)} do not fit PEFT's ParamWrapper "
                         f"(r={r} x {e} experts)")
    return PeftModule(key=key, layer=layer, target=target, lora_a=ab["A"], lora_b=ab["B"], rank=r,
                      scaling=cfg.scaling(r, alpha), num_experts=e, applied=not why, why=why)


_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_tensor(f: BinaryIO, dtype: str, shape: tuple[int, ...], begin: int, end: int) -> torch.Tensor:
    """One tensor read from an open safetensors file by its absolute byte range (no memory map: only these bytes
    are ever resident)."""
    f.seek(begin)
    data = bytearray(f.read(end - begin))
    if len(data) != end - begin:
        raise ValueError(f"the file ends inside a tensor (bytes {begin}-{end})")
    if not data:
        return torch.zeros(shape, dtype=_TORCH_DTYPES[dtype])
    return torch.frombuffer(data, dtype=_TORCH_DTYPES[dtype]).reshape(shape)


def peft_delta(module: PeftModule, a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What PEFT adds to the module's output (float64, Hugging Face column order): a plain module's for inputs
    ``x`` [T, in] -> [T, out]; a fused-expert parameter's for ``x`` [E, T, in] (inputs per expert) -> [E, T, out].
    A pair PEFT does not apply adds zero."""
    x = x.double()
    if not module.applied:
        return torch.zeros(*x.shape[:-1], b.shape[0], dtype=torch.float64)
    a, b = a.double(), b.double()
    if not module.num_experts:
        return module.scaling * ((x @ a.T) @ b.T)
    r, e = module.rank, module.num_experts
    a_e = a.reshape(e, r, a.shape[-1])                                   # A rows e*r + j: expert-major
    b_e = b.reshape(b.shape[0], r, e).permute(2, 1, 0).contiguous()      # B columns j*E + e: rank-major -> [E, r, out]
    return module.scaling * torch.bmm(torch.bmm(x, a_e.transpose(1, 2)), b_e)


def gate_up_columns(family: str, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate columns, up columns) of a fused expert ``gate_up_proj`` output of ``width`` = 2I in the Hugging Face
    model of ``family``."""
    if family in GATE_UP_INTERLEAVED:
        return torch.arange(0, width, 2), torch.arange(1, width, 2)
    return torch.arange(width // 2), torch.arange(width // 2, width)
