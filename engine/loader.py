"""Load a base model: build it on the meta device, then fill its parameters from memory-mapped safetensors.

    model, cfg = load_model(path, device="cuda", dtype=torch.bfloat16)
    model, cfg = load_model(path, load_format="dummy")      # config.json only; random weights (benchmarks)

Every checkpoint tensor maps to a ``Target``: a parameter of the engine's model, optionally one expert and a
row range of it (fused qkv / gate_up / w13), and a transform (GPT-OSS's [E, H, 2I] interleaved gate_up is
transposed and de-interleaved). The set of expected names comes from the config, so missing and unexpected
tensors are reported before any data is copied; a shape mismatch names the tensor, its file and both shapes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from loraplex.engine.config import ConfigError, ModelConfig
from loraplex.engine.models import get_model_class
from loraplex.engine.models.transformer import CausalLM
from loraplex.engine.progress import progress as progress_bar

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LOAD_FORMATS = ("auto", "safetensors", "dummy")


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names the file or tensor, expected vs actual."""


@dataclass(frozen=True)
class Target:
    param: str                                  # engine parameter name
    expert: int | None = None                   # index into dim 0 of a stacked expert tensor
    rows: tuple[int, int] | None = None         # [start, end) along the (per-expert) first dim
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


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


def _moe_targets(cfg: ModelConfig, p: str, fused_on_disk: bool) -> dict[str, Target]:
    """Expert and router names for one MoE layer ``p`` (e.g. ``model.layers.3``)."""
    i = cfg.moe_intermediate_size
    ex = f"{p}.mlp.experts"
    out: dict[str, Target] = {}
    if cfg.family == "gpt_oss":
        out[f"{p}.mlp.router.weight"] = Target(f"{p}.mlp.router.weight")
        out[f"{p}.mlp.router.bias"] = Target(f"{p}.mlp.router.bias")
        out[f"{ex}.gate_up_proj"] = Target(f"{ex}.w13", transform=_gpt_oss_gate_up)
        out[f"{ex}.gate_up_proj_bias"] = Target(f"{ex}.b13", transform=_gpt_oss_gate_up_bias)
        out[f"{ex}.down_proj"] = Target(f"{ex}.w2", transform=_transpose_experts)
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


def checkpoint_targets(cfg: ModelConfig, names: set[str] | None = None) -> dict[str, Target]:
    """Every tensor name the checkpoint of ``cfg`` must hold, mapped to where it goes in the engine's model.
    ``names`` (the checkpoint's names) picks between on-disk variants (per-expert vs fused experts)."""
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
            out.update(_moe_targets(cfg, p, fused_experts))
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


def _dest(params: dict[str, nn.Parameter], t: Target) -> torch.Tensor:
    d = params[t.param].data
    if t.expert is not None:
        d = d[t.expert]
    if t.rows is not None:
        d = d[t.rows[0]:t.rows[1]]
    return d


def _check_quantization(path: str, names: set[str]) -> None:
    mx = sorted(n for n in names if n.endswith("_blocks") or n.endswith("_scales"))
    if mx:
        raise WeightLoadError(f"{path} holds MXFP4-quantised tensors (e.g. {mx[0]!r}); loraplex loads only "
                              "unquantised checkpoints: use a bf16 checkpoint (e.g. a '-BF16' variant)")


def _load_safetensors(model: CausalLM, cfg: ModelConfig, path: str, progress: bool) -> None:
    files = checkpoint_files(path)
    _check_quantization(path, set(files))
    targets = checkpoint_targets(cfg, set(files))
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(targets) - set(files))
    if missing:
        raise WeightLoadError(f"checkpoint {path} is missing {len(missing)} tensor(s) the {cfg.family} config "
                              f"needs, e.g. {missing[:3]}")
    unexpected = sorted(n for n in set(files) - set(targets) - optional if not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise WeightLoadError(f"checkpoint {path} has {len(unexpected)} unexpected tensor(s) for the "
                              f"{cfg.family} config, e.g. {unexpected[:3]} (in {files[unexpected[0]]})")
    params = dict(model.named_parameters(remove_duplicate=False))
    by_file: dict[str, list[str]] = {}
    for name in targets:
        by_file.setdefault(files[name], []).append(name)
    # progress=False: never a bar; True: loraplex's rule (a terminal on stderr, or LORAPLEX_PROGRESS=1)
    with progress_bar(total=len(targets), desc="Loading weights", unit="tensor",
                      enabled=None if progress else False) as bar:
        _copy_tensors(params, targets, by_file, cfg, bar)


def _copy_tensors(params: dict, targets: dict, by_file: dict[str, list[str]], cfg: ModelConfig, bar) -> None:
    for fname, names in sorted(by_file.items()):
        f = _open(fname)
        for name in names:
            t = targets[name]
            try:
                src = f.get_tensor(name)
            except Exception as e:
                raise WeightLoadError(f"cannot read tensor {name!r} from {fname} (truncated or corrupt?): {e}") \
                    from None
            if t.transform is not None:
                try:
                    src = t.transform(src)
                except (IndexError, RuntimeError) as e:
                    raise WeightLoadError(f"tensor {name!r} in {fname} has shape {tuple(src.shape)}, which does "
                                          f"not fit the {cfg.family} layout of {t.param}: {e}") from None
            dest = _dest(params, t)
            if tuple(src.shape) != tuple(dest.shape):
                raise WeightLoadError(f"tensor {name!r} in {fname} has shape {tuple(src.shape)} (after layout "
                                      f"conversion), expected {tuple(dest.shape)} for {t.param}")
            dest.copy_(src)
            bar.update(1)


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
    config.json and fills deterministic random weights. Raises ConfigError (bad/unknown config) or
    WeightLoadError (missing/corrupt file, missing/unexpected tensor, shape mismatch, MXFP4 checkpoint).
    Returns (model in eval mode on ``device`` with ``dtype`` parameters, its ModelConfig).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    path = os.fspath(path)
    cfg = ModelConfig.from_pretrained(path)
    _check_config_quantization(path)
    model = _build_meta(cfg)
    _materialize(model, device, dtype)
    with torch.no_grad():
        if load_format == "dummy":
            _init_dummy(model)
        else:
            _load_safetensors(model, cfg, path, progress)
    return model.eval(), cfg


def _check_config_quantization(path: str) -> None:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config")
    if qc:
        method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else qc
        raise ConfigError(f"{path}/config.json declares quantization {method!r}; loraplex loads only unquantised "
                          "checkpoints: use a bf16 checkpoint")


__all__ = ["WeightLoadError", "Target", "checkpoint_targets", "checkpoint_files", "load_model", "LOAD_FORMATS"]
