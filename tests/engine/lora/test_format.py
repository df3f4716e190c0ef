"""Adapter-format checks against real PEFT output on tiny models of every family, and against hand-made files."""
from __future__ import annotations

import json
import math
import os
import struct

import pytest

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.format import (AdapterFormatError, check_adapter, check_base_model, parse_adapter_config,
                                         read_safetensors_header)
from tests.utils.adapters import lora_tensors, make_peft_adapter, write_safetensors
from tests.utils.tiny_models import FAMILIES, make_tiny_base


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            path = make_tiny_base(family, str(tmp_path_factory.mktemp(f"base-{family}")))
            cache[family] = ModelConfig.from_pretrained(path)
        return cache[family]
    return get


def load(folder, model, max_rank=64, base="tiny-base"):
    with open(os.path.join(folder, "adapter_config.json"), "rb") as f:
        cfg = parse_adapter_config(f.read(), max_rank=max_rank)
    header = read_safetensors_header(os.path.join(folder, "adapter_model.safetensors"))
    return check_adapter(cfg, header, model, max_rank=max_rank, base_model_name=base)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapter_of_every_family_matches_the_base_model(family, bases, tmp_path):
    from safetensors import safe_open

    model = bases(family)
    folder = make_peft_adapter(family, str(tmp_path), r=3, alpha=6)
    spec = load(folder, model)
    assert spec.rank == 3 and spec.dtype == "F32" and spec.scaling == pytest.approx(2.0)
    with safe_open(os.path.join(folder, "adapter_model.safetensors"), "np") as f:
        real = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    header = read_safetensors_header(os.path.join(folder, "adapter_model.safetensors"))
    assert {k: t.shape for k, t in header.tensors.items()} == real
    assert spec.num_parameters == sum(math.prod(s) for s in real.values())
    # every tensor PEFT wrote is accounted for by exactly one module
    assert sorted(n for m in spec.modules for n in (m.lora_a, m.lora_b)) == sorted(real)
    attn = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    assert attn <= set(spec.targets)
    for m in spec.modules:
        if m.num_experts:
            assert real[m.lora_a] == (3 * model.num_experts, m.in_features)
            assert real[m.lora_b] == (m.out_features, 3 * model.num_experts)
        else:
            assert real[m.lora_a] == (3, m.in_features) and real[m.lora_b] == (m.out_features, 3)
    if family in ("llama", "qwen3"):
        assert {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"} <= set(spec.targets)
        assert len(spec.modules) == 7 * model.num_layers
    else:
        experts = [m for m in spec.modules if m.num_experts]
        assert {m.target for m in experts} == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
        assert {m.layer for m in experts} == set(model.moe_layers)
        for m in experts:
            # PEFT nests the two parameter wrappers: gate_up_proj (wrapped first) is the inner base_layer.
            inner = ".experts.base_layer.lora_A" in m.lora_a
            assert inner == (m.target == "mlp.experts.gate_up_proj")
            assert (m.in_features, m.out_features) == (
                (model.hidden_size, 2 * model.moe_intermediate_size) if inner
                else (model.moe_intermediate_size, model.hidden_size))


def test_expert_shapes_follow_the_real_parameters(bases, tmp_path):
    """lora_B of an expert target has the base parameter's output width, lora_A its input width (both layouts:
    gpt_oss stores experts as (E, in, out), mixtral as (E, out, in))."""
    from tests.utils.tiny_models import tiny_model

    for family in ("gpt_oss", "mixtral"):
        spec = load(make_peft_adapter(family, str(tmp_path / family), r=2), bases(family))
        experts = tiny_model(family).model.layers[0].mlp.experts
        widths = {"mlp.experts.gate_up_proj": experts.gate_up_proj.shape, "mlp.experts.down_proj": experts.down_proj.shape}
        for m in spec.modules:
            if m.num_experts and m.layer == 0:
                shape = widths[m.target]
                assert {m.in_features, m.out_features} == {shape[1], shape[2]}
                assert shape[0] == m.num_experts


def test_qwen3_moe_converted_targets_and_rank_pattern(bases, tmp_path):
    """PEFT rewrites gate_proj/up_proj/down_proj on qwen3_moe to fused expert parameters with a doubled rank for
    gate_up_proj (rank_pattern/alpha_pattern); the spec carries per-module ranks."""
    folder = make_peft_adapter("qwen3_moe", str(tmp_path), r=2, alpha=4,
                               target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"], target_parameters=[])
    cfg = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert cfg["rank_pattern"]
    spec = load(folder, bases("qwen3_moe"))
    ranks = {m.target: m.rank for m in spec.modules}
    assert ranks["mlp.experts.gate_up_proj"] == 4 and ranks["mlp.experts.down_proj"] == 2
    assert spec.rank == 4
    for m in spec.modules:
        assert m.scaling == pytest.approx(2.0)


def test_rslora_scaling(bases, tmp_path):
    spec = load(make_peft_adapter("llama", str(tmp_path), r=4, alpha=8, use_rslora=True), bases("llama"))
    assert spec.use_rslora and spec.scaling == pytest.approx(8 / 2)
    assert all(m.scaling == pytest.approx(4.0) for m in spec.modules)


def test_bf16_adapter_is_accepted(bases, tmp_path):
    spec = load(make_peft_adapter("qwen3", str(tmp_path), dtype="bfloat16"), bases("qwen3"))
    assert spec.dtype == "BF16"


def test_real_dora_adapter_is_refused(tmp_path):
    folder = make_peft_adapter("llama", str(tmp_path), use_dora=True)
    with pytest.raises(AdapterFormatError, match="use_dora=False") as e:
        parse_adapter_config(open(os.path.join(folder, "adapter_config.json"), "rb").read())
    assert e.value.code == "dora"


BASE_CFG = dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj"], bias="none")


@pytest.mark.parametrize("changes,message", [
    (dict(use_dora=True), "retrain with use_dora=False"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save=None"),
    (dict(bias="all"), 'bias="none"'),
    (dict(lora_bias=True), "lora_bias=False"),
    (dict(target_modules=["lm_head"]), "unsupported target 'lm_head'"),
    (dict(target_parameters=["mlp.router.weight"]), "unsupported target 'mlp.router.weight'"),
    (dict(r=128), "retrain with r <= 64"),
    (dict(rank_pattern={"q_proj": 65}), "rank 65 exceeds"),
    (dict(peft_type="IA3"), "only LoRA adapters"),
    (dict(r=0), "r must be a positive integer"),
    (dict(target_modules=[]), "no target_modules"),
])
def test_config_refusals(changes, message):
    with pytest.raises(AdapterFormatError, match=message):
        parse_adapter_config({**BASE_CFG, **changes}, max_rank=64)


def test_config_not_json():
    with pytest.raises(AdapterFormatError, match="not valid JSON"):
        parse_adapter_config(b"{nope")


def test_base_model_rule():
    check_base_model("Qwen/Qwen3-8B", "qwen/qwen3-8b")
    check_base_model("/data/models/Qwen3-8B/", "Qwen/Qwen3-8B")
    check_base_model(None, "Qwen/Qwen3-8B")
    check_base_model("my-alias", "Qwen/Qwen3-8B", ("my-alias",))
    with pytest.raises(AdapterFormatError, match="retrain on 'Qwen/Qwen3-8B'"):
        check_base_model("meta-llama/Llama-3-8B", "Qwen/Qwen3-8B")


# ---- hand-made files -------------------------------------------------------------------------------------------
def llama_dims(m):
    return {"self_attn.q_proj": (m.hidden_size, m.q_size), "self_attn.v_proj": (m.hidden_size, m.kv_size)}


def header_of(tmp_path, tensors, **kw):
    path = str(tmp_path / "a.safetensors")
    write_safetensors(path, tensors, **kw)
    return read_safetensors_header(path)


def check(tmp_path, model, tensors, targets=("q_proj", "v_proj"), max_rank=64, **cfg):
    config = parse_adapter_config({**BASE_CFG, "target_modules": list(targets), **cfg})
    return check_adapter(config, header_of(tmp_path, tensors), model, max_rank=max_rank)


def test_hand_made_adapter_passes(bases, tmp_path):
    m = bases("llama")
    spec = check(tmp_path, m, lora_tensors(m.num_layers, llama_dims(m), 4))
    assert spec.targets == ("self_attn.q_proj", "self_attn.v_proj") and spec.layers == (0, 1, 2)


def test_shape_that_does_not_fit(bases, tmp_path):
    m = bases("llama")
    bad = lora_tensors(1, {"self_attn.q_proj": (m.hidden_size + 1, m.q_size)}, 4)
    with pytest.raises(AdapterFormatError, match=r"expected lora_A \[4, 40\] and lora_B \[48, 4\]"):
        check(tmp_path, m, bad)


def test_rank_in_tensors_above_limit(bases, tmp_path):
    m = bases("llama")
    with pytest.raises(AdapterFormatError, match="retrain with r <= 4"):
        check(tmp_path, m, lora_tensors(1, llama_dims(m), 8), max_rank=4, r=8)


def test_layer_beyond_the_model(bases, tmp_path):
    m = bases("llama")
    with pytest.raises(AdapterFormatError, match="base model has 3 layers"):
        check(tmp_path, m, lora_tensors(4, llama_dims(m), 4))


@pytest.mark.parametrize("dtype,message", [("I64", "dtype I64 is not supported"), ("F64", "dtype F64")])
def test_bad_dtype(bases, tmp_path, dtype, message):
    m = bases("llama")
    with pytest.raises(AdapterFormatError, match=message):
        check(tmp_path, m, lora_tensors(1, llama_dims(m), 4, dtype=dtype))


def test_mixed_dtypes(bases, tmp_path):
    m = bases("llama")
    t = lora_tensors(1, llama_dims(m), 4)
    t.update(lora_tensors(1, {"self_attn.k_proj": (m.hidden_size, m.kv_size)}, 4, dtype="F16"))
    with pytest.raises(AdapterFormatError, match="mix dtypes F16, F32"):
        check(tmp_path, m, t, targets=("q_proj", "v_proj", "k_proj"))


@pytest.mark.parametrize("name,message", [
    ("base_model.model.lm_head.lora_A.weight", "not a LoRA weight of a supported target"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA is not supported"),
    ("base_model.model.model.layers.0.mlp.gate.lora_A.weight", "does not serve"),
])
def test_unsupported_tensors(bases, tmp_path, name, message):
    m = bases("qwen3_moe")
    t = lora_tensors(1, llama_dims(m), 4)
    t[name] = ("F32", (4, m.hidden_size))
    with pytest.raises(AdapterFormatError, match=message):
        check(tmp_path, m, t)


def test_dense_target_on_moe_layer(bases, tmp_path):
    m = bases("mixtral")
    t = lora_tensors(1, {"mlp.gate_proj": (m.hidden_size, 28)}, 4)
    with pytest.raises(AdapterFormatError, match="has no mlp.gate_proj"):
        check(tmp_path, m, t, targets=("gate_proj",))


def test_expert_shape_mismatch(bases, tmp_path):
    m = bases("mixtral")
    e = m.num_experts
    t = {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": ("F32", (4 * e, m.hidden_size)),
         "base_model.model.model.layers.0.mlp.experts.lora_B.weight": ("F32", (2 * m.moe_intermediate_size + 2, 4 * e))}
    with pytest.raises(AdapterFormatError, match="fit neither gate_up_proj"):
        check(tmp_path, m, t, targets=(), target_parameters=["mlp.experts.gate_up_proj"])
    t["base_model.model.model.layers.0.mlp.experts.lora_B.weight"] = ("F32", (2 * m.moe_intermediate_size, 4 * e))
    t["base_model.model.model.layers.0.mlp.experts.lora_A.weight"] = ("F32", (4 * e, m.hidden_size))
    with pytest.raises(AdapterFormatError, match="target_parameters"):
        check(tmp_path, m, t, targets=(), target_parameters=["mlp.experts.down_proj"])


def test_experts_on_a_dense_model(bases, tmp_path):
    m = bases("llama")
    with pytest.raises(AdapterFormatError, match="base model \\(llama\\) is dense"):
        check(tmp_path, m, lora_tensors(1, llama_dims(m), 4), target_parameters=["mlp.experts.gate_up_proj"])


def test_missing_pair(bases, tmp_path):
    m = bases("llama")
    t = lora_tensors(1, llama_dims(m), 4)
    del t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    with pytest.raises(AdapterFormatError, match="no matching lora_B"):
        check(tmp_path, m, t)


# ---- safetensors header ----------------------------------------------------------------------------------------
def test_truncated_file(bases, tmp_path):
    m = bases("llama")
    path = tmp_path / "a.safetensors"
    size = write_safetensors(str(path), lora_tensors(1, llama_dims(m), 4))
    with open(path, "r+b") as f:
        f.truncate(size - 3)
    with pytest.raises(AdapterFormatError, match="truncated") as e:
        read_safetensors_header(str(path))
    assert e.value.code == "truncated"


@pytest.mark.parametrize("metadata", [True, 3, "text", ["a"]])
def test_metadata_that_is_not_an_object_is_refused(tmp_path, metadata):
    """__metadata__ must be a JSON object (found by the fuzzer: `true` crashed with AttributeError, a 500)."""
    path = tmp_path / "a.safetensors"
    header = json.dumps({"__metadata__": metadata}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(AdapterFormatError, match="__metadata__ must be a JSON object") as e:
        read_safetensors_header(str(path))
    assert e.value.code == "not_safetensors"


def test_header_length_bomb(tmp_path):
    path = tmp_path / "a.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(AdapterFormatError, match="over the 16777216-byte limit"):
        read_safetensors_header(str(path))
    path.write_bytes(struct.pack("<Q", 200) + b"{" + b" " * 199)
    with pytest.raises(AdapterFormatError, match="over the 100-byte limit"):
        read_safetensors_header(str(path), max_header_bytes=100)


@pytest.mark.parametrize("content,message", [
    (b"PK\x03\x04" + b"\0" * 60, "pickle checkpoint"),
    (b"\x80\x04\x95" + b"\0" * 60, "pickle checkpoint"),
    (b"hello", "too short"),
    (struct.pack("<Q", 4) + b"nope", "does not start with a safetensors JSON header"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
])
def test_not_safetensors(tmp_path, content, message):
    path = tmp_path / "a.safetensors"
    path.write_bytes(content)
    with pytest.raises(AdapterFormatError, match=message):
        read_safetensors_header(str(path))


def test_overlapping_or_trailing_data(tmp_path):
    def raw(header, data_len):
        h = json.dumps(header).encode()
        return struct.pack("<Q", len(h)) + h + b"\0" * data_len
    p = tmp_path / "a.safetensors"
    p.write_bytes(raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12))
    with pytest.raises(AdapterFormatError, match="overlapping or gapped"):
        read_safetensors_header(str(p))
    p.write_bytes(raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 12))
    with pytest.raises(AdapterFormatError, match="4 bytes after the last tensor"):
        read_safetensors_header(str(p))
    p.write_bytes(raw({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8))
    with pytest.raises(AdapterFormatError, match="8 bytes for shape"):
        read_safetensors_header(str(p))


@pytest.mark.parametrize("family,kw", [
    ("qwen3_moe", dict(r=2, alpha=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                       target_parameters=[])),
    ("gpt_oss", dict(r=3, alpha=5, use_rslora=True)),
    ("llama", dict(r=4, alpha=3, rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 7})),
])
def test_scaling_matches_peft_modules(family, kw, bases, tmp_path):
    """Per-module rank and scaling in the spec equal what PEFT itself computes when it loads the adapter."""
    import re

    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from tests.utils.tiny_models import tiny_model

    folder = make_peft_adapter(family, str(tmp_path), **kw)
    spec = load(folder, bases(family))
    peft = {}
    for name, mod in PeftModel.from_pretrained(tiny_model(family), folder).named_modules():
        if isinstance(mod, LoraLayer):
            m = re.search(r"layers\.(\d+)\.(.+)$", name)
            target = m[2].replace(".base_layer", "")
            if getattr(mod, "parameter_name", None):
                target = f"{target}.{mod.parameter_name}"
            peft[(int(m[1]), target)] = (mod.r["default"], mod.scaling["default"])
    ours = {(m.layer, m.target): (m.rank, m.scaling) for m in spec.modules}
    assert ours.keys() == peft.keys()
    for k, (r, s) in peft.items():
        assert ours[k][0] == r and ours[k][1] == pytest.approx(s), k


@pytest.mark.parametrize("family,kw", [
    ("llama", dict(r=4, alpha=16)),
    ("gpt_oss", dict(r=2, alpha=4, use_rslora=True)),
])
def test_missing_lora_alpha_takes_peft_default(family, kw, bases, tmp_path):
    """A config without lora_alpha scales as PEFT's LoraConfig default (lora_alpha=8), never alpha = r."""
    import re

    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from tests.utils.tiny_models import tiny_model

    folder = make_peft_adapter(family, str(tmp_path), **kw)
    path = os.path.join(folder, "adapter_config.json")
    d = json.load(open(path))
    del d["lora_alpha"]
    json.dump(d, open(path, "w"))
    spec = load(folder, bases(family))
    assert spec.alpha == PeftLoraConfig().lora_alpha == 8
    peft = {}
    for name, mod in PeftModel.from_pretrained(tiny_model(family), folder).named_modules():
        if isinstance(mod, LoraLayer):
            m = re.search(r"layers\.(\d+)\.(.+)$", name)
            target = m[2].replace(".base_layer", "")
            if getattr(mod, "parameter_name", None):
                target = f"{target}.{mod.parameter_name}"
            peft[(int(m[1]), target)] = mod.scaling["default"]
    ours = {(m.layer, m.target): m.scaling for m in spec.modules}
    assert ours.keys() == peft.keys()
    expected = 8 / math.sqrt(kw["r"]) if kw.get("use_rslora") else 8 / kw["r"]
    for k, s in peft.items():
        assert s == pytest.approx(expected) and ours[k] == pytest.approx(s), k


def test_missing_r_takes_peft_default():
    cfg = parse_adapter_config({k: v for k, v in BASE_CFG.items() if k not in ("r", "lora_alpha")})
    assert (cfg.r, cfg.alpha) == (8, 8.0)


def test_header_length_with_low_byte_0x80_is_not_mistaken_for_pickle(tmp_path):
    """0x80 is a legal low byte of the 8-byte header length; only a file that fails to parse is called a pickle."""
    import json as _json
    import struct

    from loraplex.engine.lora.format import read_safetensors_header

    for pad in range(0, 400):
        header = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {"p": "x" * pad}}
        raw = _json.dumps(header).encode()
        if len(raw) & 0xFF == 0x80:
            break
    else:  # pragma: no cover - the loop always finds one
        raise AssertionError("no padding gave a 0x80 low byte")
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0\0\0\0")
    assert path.read_bytes()[0] == 0x80
    assert set(read_safetensors_header(str(path)).tensors) == {"w"}
