"""One PEFT adapter folder -> ``AdapterWeights``: per (layer, target) low-rank factors in the engine's layout.

    weights = load_adapter_weights("/cache/tenant-a/v3", model_config, max_rank=16, dtype=torch.bfloat16)
    slots.load(0, weights)

Every factor sits at the module's own rank, and all of them are views into one flat tensor (``flat``: module keys
in sorted order, A then B, B stored rank-major, each factor 16-byte aligned; ``layout``), so an adapter moves to
the GPU in one copy and costs there what its factors need (``nbytes``, plus alignment padding, none at the usual
model sizes).

Shape legend: r the module's rank, E experts, K in features, N out features.

    plain target  (self_attn.q_proj, mlp.down_proj, ...):   lora_a [r, K],     lora_b [N, r]
    expert target (mlp.experts.gate_up_proj / down_proj):   lora_a [E, r, K],  lora_b [E, N, r]

Conversions made once, here, so the step does none:
- the module's scaling (alpha / r, or alpha / sqrt(r) for rsLoRA, after rank_pattern / alpha_pattern) is folded
  into lora_b, so slots of any rank and scaling share one kernel call (the kernels' ``scaling`` stays 1);
- PEFT's expert factors are un-flattened: lora_A (r·E, K) is expert-major (row e·r + j), lora_B (N, r·E) is
  rank-major (column j·E + e) -- the order PEFT's own ``ParamWrapper`` reshapes them in;
- GPT-OSS stores gate_up interleaved (gate at even, up at odd output columns) and the loader de-interleaves w13
  to [gate rows; up rows]; the rows of its gate_up lora_b are de-interleaved the same way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator

import torch

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.format import (AdapterFormatError, AdapterSpec, LoraModule, check_adapter,
                                         parse_adapter_config, read_safetensors_header)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ALIGN_BYTES = 16  # every packed factor starts on such a boundary (the LoRA kernels read them with vector loads)


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def rank_major(b_shape: torch.Size) -> torch.Size:
    """B [.., N, r] stored rank-major: [.., r, N]."""
    return torch.Size((*b_shape[:-2], b_shape[-1], b_shape[-2]))


def packed_numel(layout: list) -> int:
    """Elements of a flat tensor holding ``layout`` (``AdapterWeights.layout``)."""
    if not layout:
        return 0
    _, _, _, b_off, b_shape = layout[-1]
    return b_off + b_shape.numel()


@dataclass
class LoraTensors:
    """The factors of one adapted module; scaling already folded into ``lora_b``."""

    lora_a: torch.Tensor  # [r, K] or [E, r, K]
    lora_b: torch.Tensor  # [N, r] or [E, N, r]

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-2]


@dataclass
class AdapterWeights:
    """One adapter converted to the engine's layout (CPU tensors; ``pin_memory()`` before H2D copies on CUDA)."""

    adapter_id: str
    rank: int                                   # largest rank of any module
    nbytes: int                                 # of all factors: what the adapter takes on the GPU
    spec: AdapterSpec
    modules: dict[tuple[int, str], LoraTensors] = field(default_factory=dict)  # (layer, target) -> factors
    flat: torch.Tensor | None = None            # every factor, packed (``pack``): one host->device copy

    @property
    def targets(self) -> tuple[str, ...]:
        return self.spec.targets

    def pack(self) -> "AdapterWeights":
        """Moves every factor into one flat tensor (``layout``) and makes the modules views of it."""
        if self.flat is not None:
            return self
        dtypes = {t.dtype for m in self.modules.values() for t in (m.lora_a, m.lora_b)}
        if len(dtypes) > 1:
            raise ValueError(f"adapter {self.adapter_id!r} mixes dtypes {sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else torch.float32
        lay = self.layout(torch.empty((), dtype=dtype).element_size())
        flat = torch.zeros(packed_numel(lay), dtype=dtype)
        for key, a_off, a_shape, b_off, b_shape in lay:
            t = self.modules[key]
            flat[a_off:a_off + a_shape.numel()].view(a_shape).copy_(t.lora_a)
            flat[b_off:b_off + b_shape.numel()].view(rank_major(b_shape)).copy_(t.lora_b.transpose(-1, -2))
        self.flat = flat
        self._view_modules()
        return self

    def layout(self, elem_size: int | None = None) -> list[tuple[tuple[int, str], int, torch.Size, int, torch.Size]]:
        """(key, A offset, A shape, B offset, B shape) in ``flat``, in elements: sorted keys, A then B, each
        factor starting on an ``ALIGN_BYTES`` boundary (for ``elem_size``-byte elements; default: the factors'
        own). A is stored as it is ([.., r, K]), B rank-major (as B^T [.., r, N]; its shape here is B's own
        [.., N, r]): the layout a ``LoRATable`` reads."""
        if elem_size is None:
            first = next(iter(self.modules.values()), None)
            elem_size = first.lora_a.element_size() if first is not None else 4
        align = max(1, ALIGN_BYTES // elem_size)
        out, off = [], 0
        for key in sorted(self.modules):
            t = self.modules[key]
            a, b = t.lora_a.shape, t.lora_b.shape
            b_off = _round_up(off + a.numel(), align)
            out.append((key, off, a, b_off, b))
            off = _round_up(b_off + b.numel(), align)
        return out

    def _view_modules(self) -> None:
        for key, a_off, a_shape, b_off, b_shape in self.layout(self.flat.element_size()):
            self.modules[key] = LoraTensors(
                lora_a=self.flat[a_off:a_off + a_shape.numel()].view(a_shape),
                lora_b=self.flat[b_off:b_off + b_shape.numel()].view(rank_major(b_shape)).transpose(-1, -2))

    def pin_memory(self) -> "AdapterWeights":
        """Packs and page-locks the factors in place (for asynchronous copies to the GPU)."""
        self.pack()
        self.flat = self.flat.pin_memory()
        self._view_modules()
        return self


def load_adapter_weights(folder: str | os.PathLike, model_config: ModelConfig, *, max_rank: int,
                         dtype: torch.dtype, base_model_name: str | None = None,
                         adapter_id: str | None = None) -> AdapterWeights:
    """Validates a PEFT folder against the base model (``loraplex.engine.lora.format``) and reads its tensors.

    Raises AdapterFormatError whose message says what is wrong: an invalid or unsupported config, a truncated
    or foreign file, shapes that do not fit the base model, a rank over ``max_rank``, NaN/Inf weights.
    ``adapter_id`` defaults to the folder's name.
    """
    folder = os.fspath(folder)
    cfg_path, st_path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, WEIGHTS_FILE)
    for path in (cfg_path, st_path):
        if not os.path.isfile(path):
            raise AdapterFormatError(f"adapter folder {folder!r} has no {os.path.basename(path)}; a PEFT LoRA "
                                     f"folder holds {CONFIG_FILE} and {WEIGHTS_FILE}", code="missing_file")
    with open(cfg_path, "rb") as f:
        config = parse_adapter_config(f.read(), max_rank=max_rank)
    header = read_safetensors_header(st_path)
    spec = check_adapter(config, header, model_config, max_rank=max_rank, base_model_name=base_model_name)
    modules = {(mod.layer, mod.target): t for mod, t in converted_modules(st_path, spec, model_config, dtype=dtype)}
    nbytes = sum(t.lora_a.nbytes + t.lora_b.nbytes for t in modules.values())
    return AdapterWeights(adapter_id=adapter_id or os.path.basename(folder.rstrip("/")), rank=spec.rank,
                          nbytes=nbytes, spec=spec, modules=modules).pack()


def converted_modules(weights_path: str | os.PathLike, spec: AdapterSpec, model_config: ModelConfig, *,
                      dtype: torch.dtype) -> Iterator[tuple[LoraModule, LoraTensors]]:
    """The conversion ``load_adapter_weights`` makes, one module of ``spec`` at a time (memory bounded by the
    largest module): the platform's upload-time numerical check runs exactly this on each upload."""
    path = os.fspath(weights_path)
    for mod in spec.modules:
        a, b = _read_pair(path, mod)
        yield mod, _convert(mod, a, b, model_config, dtype)


def _read_pair(path: str, mod: LoraModule) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            a, b = f.get_tensor(mod.lora_a), f.get_tensor(mod.lora_b)
    except Exception as e:  # the header was checked; this is corrupt data
        raise AdapterFormatError(f"cannot read {mod.lora_a!r} / {mod.lora_b!r} from {WEIGHTS_FILE}: {e}; upload "
                                 "the file exactly as PEFT saved it", code="not_safetensors") from None
    for name, t in ((mod.lora_a, a), (mod.lora_b, b)):
        if not torch.isfinite(t).all():
            raise AdapterFormatError(f"tensor {name!r} holds NaN or Inf values; the adapter is broken (check the "
                                     "training run for divergence)", code="non_finite")
    return a.float(), b.float()


def _convert(mod: LoraModule, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig,
             dtype: torch.dtype) -> LoraTensors:
    """a (r, K) / b (N, r), or a (r·E, K) / b (N, r·E) for experts -> the engine layout, scaling folded into b."""
    r, e = mod.rank, mod.num_experts
    b = b * mod.scaling
    if e:
        a = a.reshape(e, r, mod.in_features)                                  # [E, r, K]
        b = b.reshape(mod.out_features, r, e).permute(2, 0, 1)                # [E, N, r]
        if cfg.family == "gpt_oss" and mod.target == "mlp.experts.gate_up_proj":
            b = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)                    # interleaved -> [gate; up]
    return LoraTensors(lora_a=a.to(dtype).contiguous(), lora_b=b.to(dtype).contiguous())


__all__ = ["AdapterWeights", "LoraTensors", "load_adapter_weights", "packed_numel", "rank_major", "ALIGN_BYTES",
           "CONFIG_FILE", "WEIGHTS_FILE"]
