"""Weight loading: sharded checkpoints, checkpoint variants, dummy weights, dtype, and named errors."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.config import ConfigError
from loraplex.engine.loader import WeightLoadError, load_model
from loraplex.engine.testing.tiny import make_tiny_checkpoint

from .conftest import alloc_kv_caches, rel_err


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_weights(a, b) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@torch.inference_mode()
def _logits(model, cfg, ids: list[int]) -> torch.Tensor:
    from loraplex.engine.attention_metadata import AttentionMetadata

    attn = AttentionMetadata.contiguous([len(ids)], [len(ids)], 4)
    caches = alloc_kv_caches(cfg, AttentionMetadata.blocks_needed([len(ids)], 4))
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn, caches))


@pytest.fixture
def llama_sharded(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "sharded", max_shard_size="40KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    return path, shards


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


# ---------------------------------------------------------------------------------------------- success


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_sharded_checkpoint_loads_identically(family, tiny_checkpoints, tmp_path):
    sharded = make_tiny_checkpoint(family, tmp_path / "sharded", max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert not os.path.exists(os.path.join(sharded, "model.safetensors"))
    a, _ = load_model(tiny_checkpoints[family], progress=False)
    b, _ = load_model(sharded, progress=False)
    _assert_same_weights(a, b)


def test_gpt_oss_experts_are_transposed_and_deinterleaved(tiny_checkpoints):
    path = tiny_checkpoints["gpt_oss"]
    model, cfg = load_model(path, progress=False)
    raw = load_file(os.path.join(path, "model.safetensors"))
    gate_up = raw["model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I], gate/up interleaved
    bias = raw["model.layers.1.mlp.experts.gate_up_proj_bias"]
    experts = model.model.layers[1].mlp.experts
    I = cfg.moe_intermediate_size
    assert torch.equal(experts.w13[2, :I], gate_up[2, :, 0::2].T)  # gate rows
    assert torch.equal(experts.w13[2, I:], gate_up[2, :, 1::2].T)  # up rows
    assert torch.equal(experts.b13[2, I:], bias[2, 1::2])
    assert torch.equal(experts.w2[2], raw["model.layers.1.mlp.experts.down_proj"][2].T)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_expert_names_load_like_per_expert_names(family, tiny_checkpoints, tmp_path):
    """transformers-5 in-memory names (mlp.experts.gate_up_proj [E,2I,H], down_proj [E,H,I], mlp.gate)."""
    src = tiny_checkpoints[family]
    dst = _copy(src, tmp_path / "fused")
    sd = load_file(os.path.join(dst, "model.safetensors"))
    model, cfg = load_model(src, progress=False)
    old = "block_sparse_moe" if family == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for layer in cfg.moe_layers:
        p = f"model.layers.{layer}"
        experts = [[sd.pop(f"{p}.{old}.experts.{e}.{n}.weight") for n in names] for e in range(cfg.num_experts)]
        sd[f"{p}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        sd[f"{p}.mlp.experts.down_proj"] = torch.stack([d for _, _, d in experts])
        sd[f"{p}.mlp.gate.weight"] = sd.pop(f"{p}.{old}.gate.weight")
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    fused, _ = load_model(dst, progress=False)
    _assert_same_weights(model, fused)


def test_bf16_load_and_tied_embeddings(tiny_checkpoints):
    model, cfg = load_model(tiny_checkpoints["qwen3"], dtype=torch.bfloat16, progress=False)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ref, _ = load_model(tiny_checkpoints["qwen3"], progress=False)
    ids = [5, 9, 33, 100, 7, 250]
    assert rel_err(_logits(model, cfg, ids), _logits(ref, cfg, ids)) < 5e-2


def test_dummy_load_needs_only_config(tiny_checkpoints, tmp_path):
    for family in ("gpt_oss", "llama"):
        only_cfg = tmp_path / family
        only_cfg.mkdir()
        shutil.copy(os.path.join(tiny_checkpoints[family], "config.json"), only_cfg / "config.json")
        a, cfg = load_model(only_cfg, load_format="dummy", progress=False)
        b, _ = load_model(only_cfg, load_format="dummy", progress=False)
        _assert_same_weights(a, b)  # deterministic
        assert not any(p.is_meta for p in a.parameters())
        logits = _logits(a, cfg, list(range(3, 40)))
        assert torch.isfinite(logits).all()
        assert 0.1 < logits.std().item() < 100  # sane scale
        assert logits.argmax(-1).unique().numel() > 1
        with pytest.raises(WeightLoadError, match="no model.safetensors"):
            load_model(only_cfg, progress=False)


# ---------------------------------------------------------------------------------------------- errors


def test_missing_shard_is_named(llama_sharded):
    path, shards = llama_sharded
    os.remove(os.path.join(path, shards[-1]))
    with pytest.raises(WeightLoadError, match=f"shard file .*{shards[-1]}.* is missing"):
        load_model(path, progress=False)


def test_truncated_shard_is_named(llama_sharded):
    path, shards = llama_sharded
    target = os.path.join(path, shards[0])
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) // 2)
    with pytest.raises(WeightLoadError, match=f"{shards[0]}.*truncated or corrupt"):
        load_model(path, progress=False)


def _edit_single(src: str, dst, edit) -> str:
    path = _copy(src, dst)
    sd = load_file(os.path.join(path, "model.safetensors"))
    edit(sd)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def test_shape_mismatch_names_tensor_and_shapes(tiny_checkpoints, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(sd):
        sd[name] = torch.randn(sd[name].shape[0] + 1, sd[name].shape[1])

    path = _edit_single(tiny_checkpoints["llama"], tmp_path / "bad", edit)
    with pytest.raises(WeightLoadError, match=r"k_proj\.weight.*\(25, 72\).*expected \(24, 72\)"):
        load_model(path, progress=False)


def test_gpt_oss_expert_shape_mismatch(tiny_checkpoints, tmp_path):
    name = "model.layers.0.mlp.experts.down_proj"

    def edit(sd):
        sd[name] = sd[name][:, :-1].contiguous()

    path = _edit_single(tiny_checkpoints["gpt_oss"], tmp_path / "bad", edit)
    with pytest.raises(WeightLoadError, match=r"experts\.down_proj.*expected \(6, 72, 40\)"):
        load_model(path, progress=False)


def test_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    path = _edit_single(tiny_checkpoints["qwen3_moe"], tmp_path / "bad", lambda sd: sd.pop(name))
    with pytest.raises(WeightLoadError, match=r"missing 1 tensor.*experts\.3\.up_proj"):
        load_model(path, progress=False)


def test_unexpected_tensor_is_named(tiny_checkpoints, tmp_path):
    def edit(sd):
        sd["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)

    path = _edit_single(tiny_checkpoints["mixtral"], tmp_path / "bad", edit)
    with pytest.raises(WeightLoadError, match=r"unexpected tensor.*extra_proj"):
        load_model(path, progress=False)


def test_unknown_model_type(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints["llama"], tmp_path / "gpt2")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["model_type"] = "gpt2"
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ConfigError, match="'gpt2' is not supported"):
        load_model(path, progress=False)


def _set_quantization_config(path: str, qc) -> None:
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"] = qc
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))


def test_quantised_checkpoints_that_do_not_load_are_named(tiny_checkpoints, tmp_path):
    """MXFP4 codes without config.json's quantization_config; quantization methods other than MXFP4; MXFP4 on
    a family other than GPT-OSS or with K not a multiple of 32 (MXFP4 checkpoints: test_mxfp4_checkpoint.py)."""
    def edit(sd):
        sd["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(6, 80, 2, 16, dtype=torch.uint8)
        sd["model.layers.0.mlp.experts.gate_up_proj_scales"] = torch.zeros(6, 80, 2, dtype=torch.uint8)

    path = _edit_single(tiny_checkpoints["gpt_oss"], tmp_path / "mx", edit)
    with pytest.raises(WeightLoadError, match="MXFP4.*gate_up_proj_blocks.*no quantization_config"):
        load_model(path, progress=False)
    _set_quantization_config(path, {"quant_method": "mxfp4"})
    with pytest.raises(ConfigError, match="MXFP4 checkpoint needs hidden_size to be a multiple of 32.*got 72"):
        load_model(path, progress=False)
    _set_quantization_config(path, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match="quantization 'fp8'.*bf16"):
        load_model(path, progress=False)
    mixtral = _copy(tiny_checkpoints["mixtral"], tmp_path / "mixtral")
    _set_quantization_config(mixtral, {"quant_method": "mxfp4"})
    with pytest.raises(ConfigError, match="MXFP4 quantization for a mixtral model.*gpt_oss only"):
        load_model(mixtral, progress=False)


def test_bad_load_format():
    with pytest.raises(ValueError, match="load_format 'pt'"):
        load_model("/nonexistent", load_format="pt")


def test_gpt_oss_expert_with_wrong_rank_is_named(tiny_checkpoints, tmp_path):
    name = "model.layers.2.mlp.experts.gate_up_proj"

    def edit(sd):
        sd[name] = sd[name][0].contiguous()  # [H, 2I]: one expert's matrix, the expert dim lost

    path = _edit_single(tiny_checkpoints["gpt_oss"], tmp_path / "bad", edit)
    with pytest.raises(WeightLoadError, match=r"layers\.2\.mlp\.experts\.gate_up_proj.*\(72, 80\)"):
        load_model(path, progress=False)
