"""The upload-time numerical check (platform/uploads/numerical_check.py): the engine's conversion of an adapter,
applied by the engine's LoRA ops, must compute PEFT's delta for every module.

- its PEFT reference (peft_reference.py) equals ``peft``'s own layers (lora.Linear, ParamWrapper) on every family;
- every adapter shape the adapter tests use passes (all families, rsLoRA, rank/alpha patterns, dtypes, PEFT's
  converted MoE targets, the engine's tiny checkpoints);
- conversions broken on purpose (expert deltas dropped, experts un-flattened in the wrong order, GPT-OSS gate/up
  left interleaved, experts shifted by one, alpha_pattern or rsLoRA ignored, a target left out) are refused with
  422 ``conversion_mismatch`` naming the module; through the API nothing is stored."""
from __future__ import annotations

import asyncio
import json
import os
import re
import threading

import pytest
import torch

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora import format as lora_format
from loraplex.engine.lora import weights as lora_weights
from loraplex.engine.lora.format import read_safetensors_header
from loraplex.platform.uploads import validate as validate_module
from loraplex.platform.uploads.errors import UploadError
from loraplex.platform.uploads.peft_reference import peft_delta, peft_modules
from loraplex.platform.uploads.validate import validate_adapter
from tests.platform.conftest import MAX_RANK, make_settings, read_files
from tests.utils.adapters import make_peft_adapter
from tests.utils.tiny_models import FAMILIES, make_tiny_base, tiny_model

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    cache: dict = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = make_tiny_base(family, str(tmp_path_factory.mktemp(f"base-{family}")))
        return cache[family]
    return get


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    cache: dict = {}

    def get(family: str, **kw) -> str:
        key = (family, repr(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_peft_adapter(family, str(tmp_path_factory.mktemp(f"lora-{family}")), **kw)
        return cache[key]
    return get


def check(folder: str, base: str):
    """validate_adapter on a folder, as the upload route runs it."""
    settings = make_settings(base_model_path=base)
    return validate_adapter(os.path.join(folder, CONFIG), os.path.join(folder, WEIGHTS), settings=settings,
                            model=ModelConfig.from_pretrained(base))


def refused(folder: str, base: str) -> UploadError:
    with pytest.raises(UploadError) as e:
        check(folder, base)
    assert e.value.status == 422 and e.value.code == "conversion_mismatch", e.value.message
    return e.value


# ------------------------------------------------------------------------------ the reference is PEFT's math


def _peft_layer_deltas(family: str, folder: str, inputs: dict) -> dict:
    """{key: {expert or None: delta}} from peft's own layers: lora.Linear as layer(x) - base_layer(x); a
    ParamWrapper through its get_delta_weight ([E, in, out] or [E, out, in], PEFT's own orientation flag)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    model = PeftModel.from_pretrained(tiny_model(family), folder).eval()
    out: dict = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, LoraLayer) or "default" not in mod.lora_A:
                continue
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if type(mod).__name__ == "ParamWrapper":
                key = f"{key}.{mod.parameter_name}"
                w = mod.get_delta_weight("default").double()
                swapped = mod._did_swap_in_out_features            # True: stored (E, out, in)
                out[key] = {e: inputs[key, e] @ (w[e].T if swapped else w[e]) for e in range(w.shape[0])}
            else:
                x = inputs[key, None].float()
                out[key] = {None: (mod(x) - mod.base_layer(x)).double()}
    return out


@pytest.mark.parametrize("family,kw", [
    ("gpt_oss", dict(r=3, alpha=5, use_rslora=True)),
    ("qwen3_moe", dict(r=2, alpha=4, rank_pattern={"gate_up_proj": 3, "layers.0.self_attn.k_proj": 5},
                       alpha_pattern={"down_proj": 9})),
    ("mixtral", dict(r=4, alpha=8)),
    ("llama", dict(r=4, alpha=3, rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 7})),
    ("qwen3", dict(r=2, alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])),
])
def test_reference_equals_peft_layers(family, kw, bases, adapters):
    folder = adapters(family, **kw)
    model = ModelConfig.from_pretrained(bases(family))
    config = json.load(open(os.path.join(folder, CONFIG)))
    header = read_safetensors_header(os.path.join(folder, WEIGHTS))
    modules = peft_modules(config, {n: t.shape for n, t in header.tensors.items()}, model)
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, WEIGHTS))
    gen = torch.Generator().manual_seed(1)
    inputs = {}
    for m in modules:
        for e in range(m.num_experts) if m.num_experts else (None,):
            inputs[m.key, e] = torch.randn(3, tensors[m.lora_a].shape[-1], generator=gen, dtype=torch.float64)
    expected = _peft_layer_deltas(family, folder, inputs)
    assert set(expected) == {m.key for m in modules if m.applied}
    assert all(m.applied for m in modules)
    for m in modules:
        if m.num_experts:
            x = torch.stack([inputs[m.key, e] for e in range(m.num_experts)])
            got = dict(enumerate(peft_delta(m, tensors[m.lora_a], tensors[m.lora_b], x)))
        else:
            got = {None: peft_delta(m, tensors[m.lora_a], tensors[m.lora_b], inputs[m.key, None])}
        for e, want in expected[m.key].items():
            torch.testing.assert_close(got[e], want, rtol=1e-4, atol=1e-6, msg=f"{m.key} expert {e}")
            assert want.abs().max() > 0


def test_reference_gives_no_delta_where_peft_loads_none(bases, adapters, tmp_path):
    """A pair whose module target_modules / layers_to_transform leave out is one PEFT does not apply."""
    folder = adapters("llama", r=2, alpha=4)
    config = json.load(open(os.path.join(folder, CONFIG)))
    config.update(target_modules=["q_proj", "k_proj"], layers_to_transform=[1])
    header = read_safetensors_header(os.path.join(folder, WEIGHTS))
    modules = peft_modules(config, {n: t.shape for n, t in header.tensors.items()},
                           ModelConfig.from_pretrained(bases("llama")))
    applied = {m.key for m in modules if m.applied}
    assert applied == {"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"}
    v0 = next(m for m in modules if m.key == "model.layers.0.self_attn.v_proj")
    assert "target_modules" in v0.why
    assert peft_delta(v0, torch.ones(2, 40), torch.ones(12, 2), torch.ones(1, 40)).abs().max() == 0


# --------------------------------------------------------------------------- accepted: the tests' adapters


ACCEPTED = [(f, {}) for f in FAMILIES] + [
    ("gpt_oss", dict(r=3, alpha=5, use_rslora=True)),
    ("gpt_oss", dict(r=2, alpha=4, rank_pattern={"down_proj": 5}, dtype="bfloat16")),
    ("qwen3_moe", dict(r=2, alpha=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                       target_parameters=[])),
    ("qwen3_moe", dict(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                       target_parameters=[])),
    ("mixtral", dict(r=4, alpha=8, dtype="float16")),
    ("llama", dict(r=4, alpha=3, rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 7})),
    ("llama", dict(r=4, alpha=8, use_rslora=True)),
    ("qwen3", dict(r=3, alpha=6, dtype="bfloat16")),
]


@pytest.mark.parametrize("family,kw", ACCEPTED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(ACCEPTED)])
def test_adapters_of_the_adapter_tests_pass(family, kw, bases, adapters, caplog):
    validated = check(adapters(family, **kw), bases(family))
    assert validated.spec.modules


def test_adapter_without_lora_alpha_passes_at_peft_default(bases, tmp_path):
    """Without lora_alpha both the engine's conversion and the PEFT reference scale by 8 / r (PEFT's default)."""
    folder = make_peft_adapter("llama", str(tmp_path), r=4, alpha=16)
    path = os.path.join(folder, CONFIG)
    config = json.load(open(path))
    del config["lora_alpha"]
    json.dump(config, open(path, "w"))
    validated = check(folder, bases("llama"))
    assert validated.spec.alpha == 8 and validated.spec.scaling == pytest.approx(2.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_tiny_checkpoint_adapters_pass(family, tiny_checkpoint, tmp_path):
    """The adapters of tests/engine/lora (PEFT on the engine's tiny checkpoints: other sizes, attention bias, tied
    embeddings, YaRN GPT-OSS), made the way its ``peft_adapter`` fixture makes them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(family)
    moe = family in ("gpt_oss", "qwen3_moe", "mixtral")
    torch.manual_seed(3)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
                     + ([] if moe else ["gate_proj", "up_proj", "down_proj"]),
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else None,
                     init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), cfg).save_pretrained(tmp_path)
    settings = make_settings(base_model_path=path, base_model_name=None)
    validated = validate_adapter(str(tmp_path / CONFIG), str(tmp_path / WEIGHTS), settings=settings,
                                 model=ModelConfig.from_pretrained(path))
    assert {m.target for m in validated.spec.modules} >= {"self_attn.q_proj", "self_attn.o_proj"}


def _orthogonal_inputs(shape, lora_a, gen):
    """Normal draws with the direction of each rank-1 A row projected out (in float64, then rounded to float32):
    the exact delta is ~0 and what either side computes is rounding."""
    x = torch.randn(*shape, lora_a.shape[-1], generator=gen, dtype=torch.float64)
    a = lora_a.double()
    unit = (a / a.norm(dim=-1, keepdim=True))[..., 0, :]  # [K] or [E, K]
    if unit.dim() == 2:
        unit = unit[:, None, :]  # experts: x [E, T, K]
    return (x - (x * unit).sum(-1, keepdim=True) * unit).float()


@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
def test_rank_one_delta_of_pure_rounding_passes(monkeypatch, bases, adapters, family):
    """A rank-1 adapter probed with inputs orthogonal to its A (what a random input nearly is, by chance, for some
    of the thousands of experts a real MoE adapter has): the delta is rounding on both sides, and the check allows
    float32's rounding of the products summed, not only a share of the (tiny) delta."""
    from loraplex.platform.uploads import numerical_check

    folder = adapters(family, r=1, alpha=2)
    monkeypatch.setattr(numerical_check, "probe_inputs", _orthogonal_inputs)
    assert check(folder, bases(family)).spec.modules
    # the case is real: with a tolerance on the delta alone the same adapter is refused
    monkeypatch.setattr(numerical_check, "ROUNDING", 0.0)
    refused(folder, bases(family))


# ----------------------------------------------------------------------- refused: conversions broken on purpose


def _patch_convert(monkeypatch, change):
    """Wraps the engine's per-module conversion (weights._convert) with ``change(mod, tensors) -> tensors``."""
    original = lora_weights._convert

    def broken(mod, a, b, cfg, dtype):
        return change(mod, original(mod, a, b, cfg, dtype))
    monkeypatch.setattr(lora_weights, "_convert", broken)


def test_dropped_expert_deltas_are_refused(monkeypatch, bases, adapters):
    def drop(mod, t):
        return lora_weights.LoraTensors(t.lora_a, torch.zeros_like(t.lora_b)) if mod.num_experts else t
    _patch_convert(monkeypatch, drop)
    e = refused(adapters("qwen3_moe"), bases("qwen3_moe"))
    assert re.search(r"mlp\.experts\.(gate_up|down)_proj of layer 0 \(expert 0\)", e.message), e.message
    assert "the engine's 0" in e.message


def test_experts_unflattened_rank_major_are_refused(monkeypatch, bases, adapters):
    """lora_A rows read as rank-major (row j*E + e) instead of PEFT's expert-major order, on down_proj only."""
    def transpose(mod, t):
        if mod.target != "mlp.experts.down_proj":
            return t
        e, r, k = t.lora_a.shape
        flat = t.lora_a.reshape(e * r, k)
        return lora_weights.LoraTensors(flat.reshape(r, e, k).transpose(0, 1).contiguous(), t.lora_b)
    _patch_convert(monkeypatch, transpose)
    e = refused(adapters("mixtral"), bases("mixtral"))
    assert "mlp.experts.down_proj of layer 0" in e.message


def test_gpt_oss_gate_up_left_interleaved_is_refused(monkeypatch, bases, adapters):
    def interleave(mod, t):
        if mod.target != "mlp.experts.gate_up_proj":
            return t
        e, n, r = t.lora_b.shape
        b = torch.stack((t.lora_b[:, : n // 2], t.lora_b[:, n // 2:]), dim=2).reshape(e, n, r)
        return lora_weights.LoraTensors(t.lora_a, b)
    _patch_convert(monkeypatch, interleave)
    e = refused(adapters("gpt_oss"), bases("gpt_oss"))
    assert "mlp.experts.gate_up_proj of layer 0 (expert 0)" in e.message


def test_experts_shifted_by_one_are_refused(monkeypatch, bases, adapters):
    def shift(mod, t):
        if not mod.num_experts:
            return t
        return lora_weights.LoraTensors(t.lora_a.roll(1, 0), t.lora_b.roll(1, 0))
    _patch_convert(monkeypatch, shift)
    e = refused(adapters("gpt_oss"), bases("gpt_oss"))
    assert re.search(r"mlp\.experts\.(gate_up|down)_proj of layer 0 \(expert 0\)", e.message), e.message


def test_ignored_alpha_pattern_is_refused(monkeypatch, bases, adapters):
    monkeypatch.setattr(lora_format.LoraConfig, "alpha_for", lambda self, key: self.alpha)
    folder = adapters("llama", r=4, alpha=3, rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 7})
    e = refused(folder, bases("llama"))
    assert "mlp.down_proj of layer 0" in e.message


def test_ignored_rslora_is_refused(monkeypatch, bases, adapters):
    monkeypatch.setattr(lora_format, "lora_scaling", lambda alpha, rank, use_rslora: alpha / rank)
    e = refused(adapters("qwen3", r=4, alpha=8, use_rslora=True), bases("qwen3"))
    assert re.search(r"(self_attn|mlp)\.[a-z]+_proj of layer 0: the engine's delta differs", e.message), e.message


def test_a_target_left_out_is_refused(monkeypatch, bases, adapters):
    """The one-sided target bug: the engine's module list loses every k_proj; PEFT still applies them."""
    original = validate_module.check_adapter

    def without_k(*args, **kwargs):
        spec = original(*args, **kwargs)
        return type(spec)(**{**spec.__dict__,
                             "modules": tuple(m for m in spec.modules if m.target != "self_attn.k_proj")})
    monkeypatch.setattr(validate_module, "check_adapter", without_k)
    e = refused(adapters("llama"), bases("llama"))
    assert "self_attn.k_proj of layer 0" in e.message and "the engine's 0" in e.message


def test_a_delta_peft_does_not_apply_is_refused(bases, adapters, tmp_path):
    """layers_to_transform leaves layer 0 out, so PEFT loads none of its tensors; the engine would serve them."""
    folder = adapters("llama", r=2, alpha=4)
    for name in (CONFIG, WEIGHTS):
        (tmp_path / name).write_bytes(read_files(folder)[name])
    config = json.loads((tmp_path / CONFIG).read_text())
    (tmp_path / CONFIG).write_text(json.dumps({**config, "layers_to_transform": [1, 2]}))
    e = refused(str(tmp_path), bases("llama"))
    assert "of layer 0" in e.message and "layers_to_transform" in e.message


# --------------------------------------------------------------------------------------- through the upload API


def test_upload_with_a_broken_conversion_is_refused_and_nothing_stored(platform, adapter_dir, monkeypatch):
    threads = []
    from loraplex.platform.uploads import numerical_check

    original = numerical_check.check_conversion

    def recording(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            threads.append("event loop")
        except RuntimeError:
            threads.append(threading.current_thread().name)
        return original(*args, **kwargs)
    monkeypatch.setattr(validate_module, "check_conversion", recording)

    def drop(mod, t):
        return lora_weights.LoraTensors(t.lora_a, torch.zeros_like(t.lora_b)) if mod.num_experts else t
    _patch_convert(monkeypatch, drop)
    _, headers = platform.new_tenant()
    r = platform.upload(headers, "broken", read_files(adapter_dir(r=4)))
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "conversion_mismatch", err
    assert re.search(r"mlp\.experts\.(gate_up|down)_proj of layer 0 \(expert 0\)", err["message"]), err
    platform.assert_nothing_stored()
    assert threads and "event loop" not in threads      # ran in the validation worker thread
    monkeypatch.undo()
    r = platform.upload(headers, "fine", read_files(adapter_dir(r=4)))
    assert r.status_code == 201, r.text
    assert MAX_RANK >= 4
