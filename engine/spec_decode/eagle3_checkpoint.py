"""Read a published EAGLE-3 draft folder (as SpecForge, the EAGLE authors and NVIDIA's Model Optimizer save them)
for one target, with errors that name what is wrong.

    config.json   architectures ["LlamaForCausalLMEagle3"] (or "Eagle3LlamaForCausalLM"), hidden_size,
                  num_attention_heads, num_key_value_heads, head_dim?, intermediate_size, rms_norm_eps,
                  rope_theta / rope_scaling, vocab_size (the target's), draft_vocab_size, target_hidden_size?,
                  eagle_aux_hidden_state_layer_ids?, norm_before_residual?, norm_before_fc?, fc_norm?, norm_output?
                  (each at the top level or in eagle_config)
    weights       model.safetensors (or sharded with model.safetensors.index.json) or pytorch_model.bin:
        fc.weight                                     [H, 3 * H_t]
        midlayer.hidden_norm / input_layernorm / post_attention_layernorm .weight   [H]
        midlayer.self_attn.{q,k,v}_proj.weight        [heads * D, 2H]   (+ .bias with attention_bias)
        midlayer.self_attn.o_proj.weight              [H, Q * D]
        midlayer.mlp.{gate,up}_proj.weight [I, H], down_proj.weight [H, I]
        norm.weight [H], lm_head.weight [V_d, H]
        input_norm.weight [3 * H_t] (norm_before_fc), fc_norm.{0,1,2}.weight [H_t] (fc_norm)
        d2t [V_d] int64 (target id = draft id + d2t[draft id]; absent: V_d == V, identity), t2d [V] bool (checked,
        not needed), embed_tokens.weight [V, H] (absent: the target's embedding)
    names may carry a ``model.`` prefix, and ``layers.0.`` for ``midlayer.``

The speculators library's layout (architecture Eagle3Speculator, ``speculators_model_type`` "eagle3") is read too:
the layer's fields from ``transformer_layer_config``, the EAGLE-3 fields from the top level, ``layers.0.`` names,
``norm_before_residual`` true when absent (``eagle3_draft.from_speculators``).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from loraplex.engine.config import ConfigError, ModelConfig, read_config_json
from loraplex.engine.spec_decode.eagle3_draft import Eagle3Config, Eagle3Draft, default_aux_layer_ids

BIN_FILE = "pytorch_model.bin"


def read_eagle3_config(folder: str) -> Eagle3Config:
    try:
        raw = read_config_json(folder)
    except ConfigError as e:
        raise ValueError(f"EAGLE-3 draft folder: {e}") from None
    path = os.path.join(folder, "config.json")
    return Eagle3Config.from_dict(raw, path)


def resolve_aux_layer_ids(config: Eagle3Config, target: ModelConfig, where: str) -> tuple[int, ...]:
    """The target layers (sorted, distinct, in [0, L]; L: the last layer's output before the final norm) whose input
    the draft reads: the config's, else (2, L // 2, L - 3). Named ids are boundary indices (id i: the input of layer
    i), as vLLM reads them; SGLang reads them as layer outputs (docs/engine.md, "EAGLE-3 drafts")."""
    L = target.num_layers
    ids = config.aux_layer_ids if config.aux_layer_ids is not None else default_aux_layer_ids(L)
    named = "eagle_aux_hidden_state_layer_ids" if config.aux_layer_ids is not None else \
        f"the default aux layers (2, L // 2, L - 3) for the target's {L} layers"
    if len(set(ids)) != len(ids) or not all(0 <= i <= L for i in ids):
        raise ValueError(f"EAGLE-3 draft {where!r}: {named} = {list(ids)} must be distinct layer indices in "
                         f"[0, {L}]; name them in config.json (eagle_aux_hidden_state_layer_ids)")
    return tuple(sorted(ids))


def _read_tensors(folder: str) -> dict[str, torch.Tensor]:
    from loraplex.engine.loader import INDEX_FILE, SINGLE_FILE, _open, checkpoint_files

    if os.path.isfile(os.path.join(folder, SINGLE_FILE)) or os.path.isfile(os.path.join(folder, INDEX_FILE)):
        files = checkpoint_files(folder)
        out = {}
        for fname in sorted(set(files.values())):
            f = _open(fname)
            out.update({name: f.get_tensor(name) for name in f.keys()})
        return out
    path = os.path.join(folder, BIN_FILE)
    if os.path.isfile(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{path}: expected a state dict")
        return dict(state)
    raise ValueError(f"EAGLE-3 draft folder {folder!r} has no {SINGLE_FILE}, {INDEX_FILE} or {BIN_FILE}")


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def _expected(cfg: Eagle3Config, num_aux: int) -> dict[str, tuple[int, ...]]:
    H, D, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    shapes = {
        "fc.weight": (H, num_aux * cfg.target_hidden_size),
        "midlayer.hidden_norm.weight": (H,), "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H), "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H), "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.mlp.gate_proj.weight": (inter, H), "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H),
    }
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (num_aux * cfg.target_hidden_size,)
    if cfg.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (cfg.target_hidden_size,) for i in range(num_aux)})
    if cfg.attention_bias:
        shapes.update({"midlayer.self_attn.q_proj.bias": (q,), "midlayer.self_attn.k_proj.bias": (kv,),
                       "midlayer.self_attn.v_proj.bias": (kv,), "midlayer.self_attn.o_proj.bias": (H,)})
    return shapes


def load_eagle3_draft(folder: str, *, target: ModelConfig, max_model_len: int, device: torch.device,
                      dtype: torch.dtype) -> tuple[Eagle3Draft, tuple[int, ...]]:
    """The draft of ``folder`` for ``target`` on ``device`` and the target layers it reads (resolve_aux_layer_ids);
    ValueError naming the missing, unexpected or misshapen tensor, or the dimension that does not match."""
    folder = os.fspath(folder)
    try:
        cfg = read_eagle3_config(folder)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"EAGLE-3 draft {folder!r} was trained for a vocabulary of {cfg.vocab_size} tokens, the "
                         f"target has {target.vocab_size}: a draft serves the target it was trained on")
    if cfg.target_hidden_size != target.hidden_size:
        raise ValueError(f"EAGLE-3 draft {folder!r} reads target hidden states of size {cfg.target_hidden_size} "
                         f"(target_hidden_size, else hidden_size), the target's hidden size is {target.hidden_size}")
    aux = resolve_aux_layer_ids(cfg, target, folder)
    state = {}
    for name, t in _read_tensors(folder).items():
        key = _canonical(name)
        if key in state:
            raise ValueError(f"EAGLE-3 draft {folder!r}: tensor {key!r} appears twice (as {name!r})")
        state[key] = t
    expected = _expected(cfg, len(aux))
    optional = {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
                "embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"EAGLE-3 draft {folder!r} is missing tensor(s) {', '.join(missing)}")
    unexpected = sorted(set(state) - set(expected) - set(optional))
    if unexpected:
        raise ValueError(f"EAGLE-3 draft {folder!r} has unexpected tensor(s) {', '.join(unexpected)} (a one-layer "
                         "EAGLE-3 draft holds fc, midlayer.*, norm, lm_head, d2t, t2d, optionally embed_tokens, and "
                         "input_norm or fc_norm.* when its config.json sets norm_before_fc or fc_norm)")
    for name, shape in {**expected, **optional}.items():
        if name in state and tuple(state[name].shape) != shape:
            raise ValueError(f"EAGLE-3 draft {folder!r}: tensor {name} has shape {list(state[name].shape)}, "
                             f"expected {list(shape)} from config.json and {len(aux)} aux layers of the target")
    own_embedding = "embed_tokens.weight" in state
    if not own_embedding and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"EAGLE-3 draft {folder!r} has hidden_size {cfg.hidden_size} and no embed_tokens.weight: "
                         f"it would read the target's embeddings, of size {target.hidden_size}")
    draft_to_target = _draft_to_target(state, cfg, folder)
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"EAGLE-3 draft {folder!r}: non-finite values in {', '.join(sorted(bad))}")

    max_positions = max(cfg.max_position_embeddings, max_model_len)
    with torch.device("meta"):
        model = Eagle3Draft(cfg, num_aux_layers=len(aux), max_positions=max_positions, own_embedding=own_embedding)
    fused = {"midlayer.self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "midlayer.mlp.gate_up_proj":
             ("gate_proj", "up_proj")}
    for pname, p in list(model.named_parameters()):
        owner, _, leaf = pname.rpartition(".")
        if owner in fused:
            base = owner.rpartition(".")[0]
            src = torch.cat([state[f"{base}.{part}.{leaf}"] for part in fused[owner]])
        else:
            src = state[pname]
        mod = model.get_submodule(owner)
        setattr(mod, leaf, nn.Parameter(src.to(device=device, dtype=dtype), requires_grad=False))
    model.draft_to_target = draft_to_target.to(device)
    model.rotary.materialize(device)
    return model.eval(), aux


def _draft_to_target(state: dict[str, torch.Tensor], cfg: Eagle3Config, folder: str) -> torch.Tensor:
    """Target ids [V_d] of the draft vocabulary: draft id + d2t, checked distinct, in range and against t2d."""
    base = torch.arange(cfg.draft_vocab_size, dtype=torch.int64)
    if "d2t" not in state:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"EAGLE-3 draft {folder!r} has draft_vocab_size {cfg.draft_vocab_size} < vocab_size "
                             f"{cfg.vocab_size} but no d2t tensor mapping draft ids to target ids")
        return base
    d2t = state["d2t"]
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"EAGLE-3 draft {folder!r}: tensor d2t has dtype {d2t.dtype}, expected an integer type")
    ids = base + d2t.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"EAGLE-3 draft {folder!r}: tensor d2t maps draft ids to target ids outside [0, "
                         f"{cfg.vocab_size}) or to the same id twice")
    t2d = state.get("t2d")
    if t2d is not None and (int(t2d.bool().sum()) != cfg.draft_vocab_size or not bool(t2d.bool()[ids].all())):
        raise ValueError(f"EAGLE-3 draft {folder!r}: tensors d2t and t2d disagree (t2d must mark exactly the "
                         "target ids d2t maps to)")
    return ids
