"""Load a base model: build it on the meta device, then fill its parameters from memory-mapped safetensors.

    model, cfg = load_model(path, device="cuda", dtype=torch.bfloat16)
    model, cfg = load_model(path, load_format="dummy")      # config.json only; random weights (benchmarks)

Every checkpoint tensor maps to a ``Target``: a parameter of the engine's model, optionally one expert and a
row range of it (fused qkv / gate_up / w13), and a transform (GPT-OSS's [E, H, 2I] interleaved gate_up is
transposed and de-interleaved). The set of expected names comes from the config, so missing and unexpected
tensors are reported before any data is copied; a shape mismatch names the tensor, its file and both shapes.

MXFP4 checkpoints (GPT-OSS as published: config.json's ``quantization_config {"quant_method": "mxfp4"}``)
hold each MoE layer's experts as ``*_blocks`` / ``*_scales`` codes (the layout: ``quantization/mxfp4_checkpoint.py``);
the rest is float. Those layers' experts are never built as float modules: their codes are copied into uint8
tensors allocated for them and become ``Mxfp4FusedExperts``, so no float expert weight exists at any point.
Converting them to another format is ``quantization.apply_quantization``'s job.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from loraplex.engine.config import ConfigError, ModelConfig
from loraplex.engine.models import get_model_class
from loraplex.engine.models.transformer import CausalLM
from loraplex.engine.progress import progress as progress_bar
from loraplex.engine.quantization.mxfp4_checkpoint import (
    gpt_oss_gate_up_codes,
    install_mxfp4_experts,
    merge_blocks,
    stage_mxfp4_experts,
)
from loraplex.kernels.mxfp4 import BLOCK_SIZE

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LOAD_FORMATS = ("auto", "safetensors", "dummy")
CHECKPOINT_QUANTIZATIONS = ("mxfp4",)  # quant_method values of config.json's quantization_config that load


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names the file or tensor, expected vs actual."""


@dataclass(frozen=True)
class Target:
    param: str                                  # engine parameter name
    expert: int | None = None                   # index into dim 0 of a stacked expert tensor
    rows: tuple[int, int] | None = None         # [start, end) along the (per-expert) first dim
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    src_shape: tuple[int, ...] | None = None    # the shape on disk, checked before the transform (MXFP4 codes)
    src_dtype: torch.dtype | None = None        # the dtype on disk, exactly (MXFP4 codes); else any float
    src_layout: str = ""                        # the on-disk layout, for error messages


# ------------------------------------------------------------------------------------------ name mapping


def _gpt_oss_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[E, H, 2I] with gate/up interleaved on the last dim -> [E, 2I, H] = [gate rows; up rows]."""
    t = t.transpose(1, 2)
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def _gpt_oss_gate_up_bias(t: torch.Tensor) -> torch.Tensor:  # [E, 2I] interleaved -> [gate; up]
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def _transpose_experts(t: torch.Tensor) -> torch.Tensor:  # [E, I, H] -> [E, H, I]
    return t.transpose(1, 2)


def _attention_targets(cfg: ModelConfig, p: str) -> dict[str, Target]:
    q, kv = cfg.q_size, cfg.kv_size
    out: dict[str, Target] = {}
    suffixes = ("weight", "bias") if cfg.attention_bias else ("weight",)
    for s in suffixes:
        out[f"{p}.self_attn.q_proj.{s}"] = Target(f"{p}.self_attn.qkv_proj.{s}", rows=(0, q))
        out[f"{p}.self_attn.k_proj.{s}"] = Target(f"{p}.self_attn.qkv_proj.{s}", rows=(q, q + kv))
        out[f"{p}.self_attn.v_proj.{s}"] = Target(f"{p}.self_attn.qkv_proj.{s}", rows=(q + kv, q + 2 * kv))
        out[f"{p}.self_attn.o_proj.{s}"] = Target(f"{p}.self_attn.o_proj.{s}")
    if cfg.qk_norm:
        for n in ("q_norm", "k_norm"):
            out[f"{p}.self_attn.{n}.weight"] = Target(f"{p}.self_attn.{n}.weight")
    if cfg.attention_sinks:
        out[f"{p}.self_attn.sinks"] = Target(f"{p}.self_attn.sinks")
    return out


def _dense_mlp_targets(cfg: ModelConfig, p: str) -> dict[str, Target]:
    i = cfg.intermediate_size
    out: dict[str, Target] = {}
    for s in ("weight", "bias") if cfg.mlp_bias else ("weight",):
        out[f"{p}.mlp.gate_proj.{s}"] = Target(f"{p}.mlp.gate_up_proj.{s}", rows=(0, i))
        out[f"{p}.mlp.up_proj.{s}"] = Target(f"{p}.mlp.gate_up_proj.{s}", rows=(i, 2 * i))
        out[f"{p}.mlp.down_proj.{s}"] = Target(f"{p}.mlp.down_proj.{s}")
    return out


def _gpt_oss_mxfp4_targets(cfg: ModelConfig, ex: str) -> dict[str, Target]:
    """The MXFP4 codes of one GPT-OSS expert module ``ex``, into the uint8 tensors of its Mxfp4FusedExperts."""
    e, h, i, b = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, BLOCK_SIZE
    u8 = torch.uint8
    return {
        f"{ex}.gate_up_proj_blocks": Target(f"{ex}.w13_blocks", transform=gpt_oss_gate_up_codes,
                                            src_shape=(e, 2 * i, h // b, b // 2), src_dtype=u8,
                                            src_layout="[E, 2I, H/32, 16] uint8 MXFP4 codes"),
        f"{ex}.gate_up_proj_scales": Target(f"{ex}.w13_scales", transform=gpt_oss_gate_up_codes,
                                            src_shape=(e, 2 * i, h // b), src_dtype=u8,
                                            src_layout="[E, 2I, H/32] uint8 E8M0 scales"),
        f"{ex}.down_proj_blocks": Target(f"{ex}.w2_blocks", transform=merge_blocks,
                                         src_shape=(e, h, i // b, b // 2), src_dtype=u8,
                                         src_layout="[E, H, I/32, 16] uint8 MXFP4 codes"),
        f"{ex}.down_proj_scales": Target(f"{ex}.w2_scales", src_shape=(e, h, i // b), src_dtype=u8,
                                         src_layout="[E, H, I/32] uint8 E8M0 scales"),
    }


def _moe_targets(cfg: ModelConfig, p: str, fused_on_disk: bool, mxfp4: bool = False) -> dict[str, Target]:
    """Expert and router names for one MoE layer ``p`` (e.g. ``model.layers.3``); ``mxfp4``: GPT-OSS experts
    as MXFP4 codes and scales."""
    i = cfg.moe_intermediate_size
    ex = f"{p}.mlp.experts"
    out: dict[str, Target] = {}
    if cfg.family == "gpt_oss":
        out[f"{p}.mlp.router.weight"] = Target(f"{p}.mlp.router.weight")
        out[f"{p}.mlp.router.bias"] = Target(f"{p}.mlp.router.bias")
        if mxfp4:
            out.update(_gpt_oss_mxfp4_targets(cfg, ex))
        else:
            out[f"{ex}.gate_up_proj"] = Target(f"{ex}.w13", transform=_gpt_oss_gate_up)
            out[f"{ex}.down_proj"] = Target(f"{ex}.w2", transform=_transpose_experts)
        out[f"{ex}.gate_up_proj_bias"] = Target(f"{ex}.b13", transform=_gpt_oss_gate_up_bias)
        out[f"{ex}.down_proj_bias"] = Target(f"{ex}.b2")
        return out
    if fused_on_disk:  # transformers-5 in-memory names: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        out[f"{p}.mlp.gate.weight"] = Target(f"{p}.mlp.gate.weight")
        out[f"{ex}.gate_up_proj"] = Target(f"{ex}.w13")
        out[f"{ex}.down_proj"] = Target(f"{ex}.w2")
        return out
    if cfg.family == "mixtral":
        src = f"{p}.block_sparse_moe"
        out[f"{src}.gate.weight"] = Target(f"{p}.mlp.gate.weight")
        names = ("w1", "w3", "w2")
    else:
        src = f"{p}.mlp"
        out[f"{src}.gate.weight"] = Target(f"{p}.mlp.gate.weight")
        names = ("gate_proj", "up_proj", "down_proj")
    for e in range(cfg.num_experts):
        gate, up, down = (f"{src}.experts.{e}.{n}.weight" for n in names)
        out[gate] = Target(f"{ex}.w13", expert=e, rows=(0, i))
        out[up] = Target(f"{ex}.w13", expert=e, rows=(i, 2 * i))
        out[down] = Target(f"{ex}.w2", expert=e)
    return out


def checkpoint_targets(cfg: ModelConfig, names: set[str] | None = None,
                       quantization: str | None = None) -> dict[str, Target]:
    """Every tensor name the checkpoint of ``cfg`` must hold, mapped to where it goes in the engine's model.
    ``names`` (the checkpoint's names) picks between on-disk variants (per-expert vs fused experts).
    ``quantization="mxfp4"`` (config.json's quant_method): a MoE layer's experts are MXFP4 codes unless the
    checkpoint holds that layer's float ``gate_up_proj`` (a layer left unquantised)."""
    names = names or set()
    out: dict[str, Target] = {"model.embed_tokens.weight": Target("model.embed_tokens.weight"),
                              "model.norm.weight": Target("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = Target("lm_head.weight")
    fused_experts = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        out[f"{p}.input_layernorm.weight"] = Target(f"{p}.input_layernorm.weight")
        out[f"{p}.post_attention_layernorm.weight"] = Target(f"{p}.post_attention_layernorm.weight")
        out.update(_attention_targets(cfg, p))
        if cfg.is_moe and cfg.is_moe_layer(layer):
            mxfp4 = quantization == "mxfp4" and f"{p}.mlp.experts.gate_up_proj" not in names
            out.update(_moe_targets(cfg, p, fused_experts, mxfp4))
        else:
            out.update(_dense_mlp_targets(cfg, p))
    return out


# ------------------------------------------------------------------------------------------ files


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from ``model.safetensors.index.json`` or the single file."""
    index = os.path.join(path, INDEX_FILE)
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightLoadError(f"{index} is not a valid safetensors index (need a 'weight_map'): {e}") from None
        files = {name: os.path.join(path, fname) for name, fname in weight_map.items()}
        for fname in sorted(set(files.values())):
            if not os.path.isfile(fname):
                raise WeightLoadError(f"shard file {fname} listed in {INDEX_FILE} is missing")
        return files
    if os.path.isfile(single):
        return {name: single for name in _open(single).keys()}
    raise WeightLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path!r}; "
                          "only safetensors checkpoints are supported (or use load_format='dummy')")


def _open(fname: str):
    from safetensors import safe_open

    try:
        return safe_open(fname, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError for truncated / corrupt headers
        raise WeightLoadError(f"cannot read safetensors file {fname} (truncated or corrupt?): {e}") from None


# ------------------------------------------------------------------------------------------ model building


def _build_meta(cfg: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        return get_model_class(cfg.family)(cfg)


def _materialize(model: CausalLM, device: torch.device | str, dtype: torch.dtype) -> None:
    """Replace every meta parameter by an empty one on ``device`` (tied parameters stay tied)."""
    done: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), requires_grad=False)
            mod._parameters[name] = done[id(p)]
    model.materialize_buffers(device)


def _dest(params: dict[str, torch.Tensor], t: Target) -> torch.Tensor:
    d = params[t.param]
    d = d.data if isinstance(d, nn.Parameter) else d
    if t.expert is not None:
        d = d[t.expert]
    if t.rows is not None:
        d = d[t.rows[0]:t.rows[1]]
    return d


def checkpoint_quantization(path: str) -> str | None:
    """The weight format config.json declares: None (float) or "mxfp4" (GPT-OSS's MXFP4 experts). Raises
    ConfigError for any other ``quantization_config``."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else qc
    if method not in CHECKPOINT_QUANTIZATIONS:
        raise ConfigError(f"{path}/config.json declares quantization {method!r}; loraplex loads unquantised "
                          f"(bf16 / fp16 / fp32) checkpoints and MXFP4 ones (quant_method 'mxfp4', GPT-OSS as "
                          "published): use a bf16 checkpoint")
    return method


def _check_mxfp4_config(cfg: ModelConfig, path: str) -> None:
    if cfg.family != "gpt_oss":
        raise ConfigError(f"{path}/config.json declares MXFP4 quantization for a {cfg.family} model; MXFP4 "
                          "checkpoints load for gpt_oss only (the published GPT-OSS layout)")
    for what, k in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.moe_intermediate_size)):
        if k % BLOCK_SIZE:
            raise ConfigError(f"{path}/config.json: an MXFP4 checkpoint needs {what} to be a multiple of "
                              f"{BLOCK_SIZE} (one scale per {BLOCK_SIZE} weights), got {k}")


def _check_no_codes(path: str, names: set[str]) -> None:
    mx = sorted(n for n in names if n.endswith("_blocks") or n.endswith("_scales"))
    if mx:
        raise WeightLoadError(f"{path} holds MXFP4-quantised tensors (e.g. {mx[0]!r}) but its config.json has no "
                              "quantization_config {\"quant_method\": \"mxfp4\"}: add it (as published GPT-OSS "
                              "checkpoints have it) or use a bf16 checkpoint")


def _load_safetensors(model: CausalLM, cfg: ModelConfig, path: str, *, device, dtype: torch.dtype,
                      quantization: str | None, progress: bool) -> None:
    files = checkpoint_files(path)
    if quantization is None:
        _check_no_codes(path, set(files))
    targets = checkpoint_targets(cfg, set(files), quantization)
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(targets) - set(files))
    if missing:
        raise WeightLoadError(f"checkpoint {path} is missing {len(missing)} tensor(s) the {cfg.family} config "
                              f"needs, e.g. {missing[:3]}")
    unexpected = sorted(n for n in set(files) - set(targets) - optional if not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise WeightLoadError(f"checkpoint {path} has {len(unexpected)} unexpected tensor(s) for the "
                              f"{cfg.family} config, e.g. {unexpected[:3]} (in {files[unexpected[0]]})")
    prefixes = sorted(t.param.removesuffix(".w13_blocks") for t in targets.values()
                      if t.param.endswith(".w13_blocks"))
    staged, sites = stage_mxfp4_experts(model, prefixes, device, dtype)
    _materialize(model, device, dtype)
    params = {**dict(model.named_parameters(remove_duplicate=False)), **staged}
    by_file: dict[str, list[str]] = {}
    for name in targets:
        by_file.setdefault(files[name], []).append(name)
    # progress=False: never a bar; True: loraplex's rule (a terminal on stderr, or LORAPLEX_PROGRESS=1)
    with progress_bar(total=len(targets), desc="Loading weights", unit="tensor",
                      enabled=None if progress else False) as bar:
        _copy_tensors(params, targets, by_file, cfg, bar)
    install_mxfp4_experts(staged, sites, dtype)


def _read(f, fname: str, name: str, t: Target, dest: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Checkpoint tensor ``name`` checked against ``t``, on ``dest``'s device, in the engine's layout."""
    try:
        src = f.get_tensor(name)
    except Exception as e:
        raise WeightLoadError(f"cannot read tensor {name!r} from {fname} (truncated or corrupt?): {e}") from None
    if t.src_dtype is not None and src.dtype != t.src_dtype:
        raise WeightLoadError(f"tensor {name!r} in {fname} has dtype {src.dtype}, expected "
                              f"{t.src_layout or t.src_dtype}")
    if t.src_dtype is None and dest.is_floating_point() and not src.is_floating_point():
        raise WeightLoadError(f"tensor {name!r} in {fname} has dtype {src.dtype}, expected a floating-point tensor "
                              f"for {t.param}")
    if t.src_shape is not None and tuple(src.shape) != t.src_shape:
        raise WeightLoadError(f"tensor {name!r} in {fname} has shape {tuple(src.shape)}, expected {t.src_shape} "
                              f"({t.src_layout} of the {cfg.family} config)")
    if dest.device.type != "cpu":
        src = src.to(dest.device)  # the layout transform runs where the weights go
    if t.transform is not None:
        try:
            src = t.transform(src)
        except (IndexError, RuntimeError) as e:
            raise WeightLoadError(f"tensor {name!r} in {fname} has shape {tuple(src.shape)}, which does "
                                  f"not fit the {cfg.family} layout of {t.param}: {e}") from None
    return src


def _copy_tensors(params: dict, targets: dict, by_file: dict[str, list[str]], cfg: ModelConfig, bar) -> None:
    for fname, names in sorted(by_file.items()):
        f = _open(fname)
        for name in names:
            t = targets[name]
            dest = _dest(params, t)
            src = _read(f, fname, name, t, dest, cfg)
            if tuple(src.shape) != tuple(dest.shape):
                raise WeightLoadError(f"tensor {name!r} in {fname} has shape {tuple(src.shape)} (after layout "
                                      f"conversion), expected {tuple(dest.shape)} for {t.param}")
            dest.copy_(src)
            bar.update(1)


def weights_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (each storage once; LoRA wrappers' bases included)."""
    seen: dict[int, int] = {}
    mods = list(model.modules())
    mods += [m.base for m in mods if hasattr(m, "_base")]
    for m in mods:
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and not t.is_meta:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _init_dummy(model: CausalLM, seed: int = 0) -> None:
    """Deterministic random weights, drawn on the parameters' device: matrices ~ N(0, 1/fan_in) (unit-variance
    outputs), norms 1, biases and sinks N(0, 0.02), embeddings N(0, 1)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        if p.device not in gens:
            gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        if p.dim() == 1 or name.endswith(("b13", "b2")):
            std = 0.02
        elif name.endswith("embed_tokens.weight"):
            std = 1.0
        else:
            std = p.shape[-1] ** -0.5
        p.data.normal_(0.0, std, generator=gens[p.device])


def load_model(path: str | os.PathLike, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               load_format: str = "auto", progress: bool = True) -> tuple[CausalLM, ModelConfig]:
    """Build the engine's model for the checkpoint folder ``path`` and load its weights.

    load_format: "auto"/"safetensors" read ``model.safetensors`` or a sharded index; "dummy" needs only
    config.json and fills deterministic random weights. An MXFP4 checkpoint's experts load as
    ``Mxfp4FusedExperts`` (codes as published; dummy weights: random float experts quantised to MXFP4).
    Raises ConfigError (bad/unknown config, unsupported quantization_config) or WeightLoadError (missing/corrupt
    file, missing/unexpected tensor, shape or dtype mismatch, MXFP4 codes without a quantization_config).
    Returns (model in eval mode on ``device`` with ``dtype`` float parameters, its ModelConfig).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    path = os.fspath(path)
    cfg = ModelConfig.from_pretrained(path)
    quantization = checkpoint_quantization(path)
    if quantization == "mxfp4":
        _check_mxfp4_config(cfg, path)
    start = time.perf_counter()
    model = _build_meta(cfg)
    with torch.no_grad():
        if load_format == "dummy":
            _materialize(model, device, dtype)
            _init_dummy(model)
            if quantization is not None:
                from loraplex.engine.quantization import apply_quantization

                apply_quantization(model, quantization)
        else:
            _load_safetensors(model, cfg, path, device=device, dtype=dtype, quantization=quantization,
                              progress=progress)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the layout transforms' temporaries, before the KV pool is sized from free memory
    logger.info("weights: %.2f GiB on %s (%s checkpoint%s) loaded in %.1f s", weights_bytes(model) / 2**30,
                device, quantization or "float", ", dummy" if load_format == "dummy" else "",
                time.perf_counter() - start)
    return model.eval(), cfg


__all__ = ["CHECKPOINT_QUANTIZATIONS", "WeightLoadError", "Target", "checkpoint_files", "checkpoint_quantization",
           "checkpoint_targets", "load_model", "weights_bytes", "LOAD_FORMATS"]
