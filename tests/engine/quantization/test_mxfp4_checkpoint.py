"""GPT-OSS checkpoints as published (MXFP4 expert codes + scales, bf16 everything else, ``quantization_config``
``{"quant_method": "mxfp4"}``): the layout is transformers' own; the engine loads the codes straight into
``Mxfp4FusedExperts`` (no float expert tensor at any point) and gives transformers' greedy tokens (transformers
dequantises the same file on CPU), with mixed adapters too (transformers + PEFT); the quantization choices on such
a checkpoint; malformed tensors are refused with messages naming them."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.distributed.parallel_state import TensorParallel
from loraplex.engine.distributed.tensor_parallel import apply_tp
from loraplex.engine.loader import WeightLoadError, load_model
from loraplex.engine.lora.layers import LoRAFusedExperts
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.models.layers.moe import FusedExperts
from loraplex.engine.quantization import Int8FusedExperts, Mxfp4FusedExperts, apply_quantization
from loraplex.engine.quantization.quantized_experts import QuantizedFusedExperts
from loraplex.engine.testing.tiny import make_tiny_mxfp4_checkpoint, pack_gpt_oss_experts
from loraplex.kernels.mxfp4 import dequantize_mxfp4
from loraplex.kernels.reference_lora import quantize_int8_per_channel

ENGINE_KW = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=64,
                 max_num_seqs=16, progress=False)
EX = "model.layers.{}.mlp.experts"
NEW_TOKENS = 12
REL_TOL = 1e-4
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SHAPES = {  # name: (make_tiny_mxfp4_checkpoint overrides, max_shard_size)
    "E6-H64-I32": (dict(), None),
    "E4-H96-I64-sharded": (dict(num_local_experts=4, hidden_size=96, intermediate_size=64), "40KB"),
    "E8-H32-I96-sharded": (dict(num_local_experts=8, num_experts_per_tok=3, hidden_size=32, intermediate_size=96),
                           "24KB"),
}


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """``mxfp4_checkpoint(name) -> path`` of the SHAPES entry ``name``, built once per module."""
    cache: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in cache:
            overrides, shard = SHAPES[name]
            cache[name] = make_tiny_mxfp4_checkpoint(tmp_path_factory.mktemp(name), max_shard_size=shard,
                                                     **overrides)
        return cache[name]

    return make


def _hf(path: str, adapter: str | None = None):
    """transformers (dequantising the MXFP4 experts on load, float32, eager attention), + PEFT ``adapter``. Upcast:
    transformers 5.17 dequantises to bf16 whatever ``dtype`` says (check_mxfp4_checkpoint.py's ``hf_model``)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                 quantization_config=Mxfp4Config(dequantize=True)).float()
    model.generation_config.eos_token_id = None
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def _hf_logits(model, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """Teacher-forced: the logits transformers predicts at each generated position [len(outputs), V]; its greedy
    tokens are ``outputs`` iff their argmax is ``outputs`` (induction over the steps)."""
    ids = torch.tensor([prompt + outputs[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return logits[len(prompt) - 1:]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], AdapterRef | None]]):
    """Greedy tokens and every step's logits per request id, all requests submitted together."""
    logits: dict[str, list[torch.Tensor]] = {}
    engine.runner.logits_hook = lambda seqs, lg: [logits.setdefault(s.request_id, []).append(lg[j].clone())
                                                  for j, s in enumerate(seqs)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for rid, prompt, adapter in requests:
        engine.add_request(rid, prompt, params, adapter=adapter)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.output_token_ids)
    return tokens, {k: torch.stack(v) for k, v in logits.items()}


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(5, 16, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _experts(model) -> list:
    return [m.mlp.experts for m in model.model.layers]


# ---------------------------------------------------------------------------------------------- the layout


def test_checkpoint_layout_is_transformers_own():
    """Random bytes and scales in the published layout decode, by transformers' own converter, to the weights
    ``kernels/mxfp4.py`` decodes from the same bytes with the last two dims merged (low nibble = even k, E8M0
    bias 127, 32 per block); ``pack_gpt_oss_experts`` is the inverse on MXFP4-representable weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    E, N, K = 3, 40, 96
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (E, N, K // 32), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N], transformers' layout
    got = dequantize_mxfp4(blocks.flatten(-2), scales).transpose(1, 2)
    assert want.shape == (E, K, N) and torch.equal(got, want)
    # one weight by hand: k = 2 of row 5 of expert 1 is the low nibble of byte 1 of block 0
    code = int(blocks[1, 5, 0, 1]) & 0xF
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    value = (-1) ** (code >> 3) * e2m1[code & 7] * 2.0 ** (int(scales[1, 5, 0]) - 127)
    assert want[1, 2, 5].item() == value
    b, s = pack_gpt_oss_experts(want)
    assert torch.equal(convert_moe_packed_tensors(b, s, dtype=torch.float32), want)


def test_requantising_dequantised_mxfp4_gives_back_its_values():
    """A bf16 copy made by dequantising an MXFP4 checkpoint, quantised again at load (``quantization="mxfp4"``),
    has the published values: the OCP rule reproduces any MXFP4 block (bf16 holds every MXFP4 value)."""
    from loraplex.kernels.mxfp4 import quantize_mxfp4

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (4, 64, 48), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (4, 64, 3), dtype=torch.uint8, generator=g)
    for k, mask in enumerate((0x11, 0x33, 0x99, 0xBB, 0x00)):  # blocks whose largest code is 0.5, 1.5, 0, ...
        blocks[k % 4, 8 * k:8 * k + 8] &= mask
    w = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w)), w.float())


# ---------------------------------------------------------------------------------------------- vs transformers


@pytest.mark.parametrize("shape", list(SHAPES))
def test_engine_gives_transformers_greedy_tokens(shape, mxfp4_checkpoint, tmp_path):
    path = mxfp4_checkpoint(shape)
    sharded = SHAPES[shape][1] is not None
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json")) == sharded
    engine = LLMEngine.from_pretrained(path, **ENGINE_KW)
    experts = _experts(engine.runner.model)
    assert all(type(m) is Mxfp4FusedExperts for m in experts)
    cfg = engine.model_config
    e0 = experts[0]
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert e0.w13_blocks.shape == (E, 2 * I, H // 2) and e0.w2_scales.shape == (E, H, I // 32)
    assert e0.b13.dtype == torch.float32 and e0.b13.shape == (E, 2 * I)
    prompts = _prompts(cfg.vocab_size, 3, seed=len(shape))
    tokens, logits = _run(engine, [(f"r{i}", p, None) for i, p in enumerate(prompts)])
    hf = _hf(path)
    for i, p in enumerate(prompts):
        ref = _hf_logits(hf, p, tokens[f"r{i}"])
        assert ref.argmax(-1).tolist() == tokens[f"r{i}"], f"{shape} r{i}: not transformers' greedy tokens"
        assert _rel_err(logits[f"r{i}"], ref) <= REL_TOL


def test_mixed_adapters_on_attention_and_experts_match_peft(mxfp4_checkpoint, tmp_path):
    """PEFT adapters made on transformers' (dequantised) model of the MXFP4 checkpoint: attention + experts
    (``target_parameters``), experts only, attention only; one engine batch mixes them with base requests."""
    from peft import LoraConfig, get_peft_model

    path = mxfp4_checkpoint("E4-H96-I64-sharded")
    specs = {"attn+experts-r4": (4, 8, ATTN, EXPERTS), "experts-r8": (8, 16, [], EXPERTS),
             "attn-r6": (6, 12, ATTN, None)}
    folders = {}
    for seed, (name, (r, alpha, modules, params)) in enumerate(specs.items()):
        torch.manual_seed(seed)
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, target_parameters=params,
                         init_lora_weights=False)
        folders[name] = str(tmp_path / name)
        get_peft_model(_hf(path), cfg).save_pretrained(folders[name])
    engine = LLMEngine.from_pretrained(path, enable_lora=True, max_loras=3, max_lora_rank=8,
                                       adapter_cache_dir=str(tmp_path / "cache"), **ENGINE_KW)
    assert all(type(w.base) is Mxfp4FusedExperts for w in engine.runner.model.modules()
               if isinstance(w, LoRAFusedExperts))
    refs = {name: AdapterRef(f"t/{name}/1", f"file://{folder}") for name, folder in folders.items()}
    names = [*specs, None, *specs, None]
    prompts = _prompts(engine.model_config.vocab_size, len(names), seed=7)
    requests = [(f"r{i}", p, refs[n] if n else None) for i, (n, p) in enumerate(zip(names, prompts))]
    tokens, logits = _run(engine, requests)
    base_hf = _hf(path)
    for (rid, prompt, _), name in zip(requests, names):
        ref = _hf_logits(_hf(path, folders[name]) if name else base_hf, prompt, tokens[rid])
        assert ref.argmax(-1).tolist() == tokens[rid], f"{rid} adapter={name}: not PEFT's greedy tokens"
        assert _rel_err(logits[rid], ref) <= REL_TOL, f"{rid} adapter={name}"
        if name is not None:  # the adapter matters
            assert _rel_err(_hf_logits(base_hf, prompt, tokens[rid][:1])[0], ref[0]) > 1e-2, name


# ---------------------------------------------------------------------------------------------- memory


class _FloatTensorWatch:
    """Records the shape of every floating-point tensor an aten op produces off the meta device."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.shapes = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta:
                        seen.append(tuple(t.shape))
                return out

        self.mode = Mode()


def test_no_float_expert_tensor_is_ever_materialised(tmp_path, monkeypatch):
    """Load under a dispatch mode that sees every tensor the load creates, with every dequantising function
    replaced by one that fails: no float tensor of an expert weight's shape (nor one as large as a layer's
    experts) exists at any point, and the experts are uint8 codes / scales with float biases."""
    import loraplex.engine.quantization.mxfp4_experts as mx_module
    import loraplex.kernels.mxfp4 as mxfp4

    E, H, I = 8, 64, 96
    path = make_tiny_mxfp4_checkpoint(tmp_path / "ck", num_local_experts=E, hidden_size=H, intermediate_size=I,
                                      max_shard_size="30KB")

    def refuse(*args, **kwargs):
        raise AssertionError("the MXFP4 checkpoint path must not dequantise")

    for target in (mxfp4, mx_module):
        monkeypatch.setattr(target, "dequantize_mxfp4", refuse)
    monkeypatch.setattr(QuantizedFusedExperts, "to_float", refuse)
    monkeypatch.setattr(QuantizedFusedExperts, "_dequant", refuse)
    watch = _FloatTensorWatch()
    with watch.mode:
        model, cfg = load_model(path, progress=False)
    monkeypatch.undo()
    expert_shapes = {(2 * I, H), (H, 2 * I), (H, I), (I, H)}
    assert len(watch.shapes) > 20  # the watch saw the load (embeddings, attention, biases, ...)
    bad = [s for s in watch.shapes if s[-2:] in expert_shapes or torch.Size(s).numel() >= E * 2 * I * H // 2]
    assert not bad, f"float tensors of expert size were created: {bad[:5]}"
    for m in _experts(model):
        assert type(m) is Mxfp4FusedExperts and m.dtype == torch.float32
        params = dict(m.named_parameters())
        assert set(params) == {"b13", "b2"} and all(p.dtype == torch.float32 for p in params.values())
        buffers = dict(m.named_buffers())
        assert set(buffers) == {"w13_blocks", "w13_scales", "w2_blocks", "w2_scales"}
        assert all(b.dtype == torch.uint8 for b in buffers.values())
    raw = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            raw.update(load_file(os.path.join(path, f)))
    blocks = raw[f"{EX.format(1)}.gate_up_proj_blocks"]  # [E, 2I, H/32, 16], rows gate/up interleaved
    e1 = model.model.layers[1].mlp.experts
    assert torch.equal(e1.w13_blocks[:, :I], blocks[:, 0::2].flatten(-2))  # gate rows, codes untouched
    assert torch.equal(e1.w13_blocks[:, I:], blocks[:, 1::2].flatten(-2))  # up rows
    assert torch.equal(e1.w2_scales, raw[f"{EX.format(1)}.down_proj_scales"])


# ---------------------------------------------------------------------------------------------- quantization choices


def test_quantization_choices_on_an_mxfp4_checkpoint(mxfp4_checkpoint, tmp_path):
    """auto / "mxfp4": the codes as published; None: dequantised at load (float experts, the same weights, the
    same tokens); "int8": dequantised then quantised per channel (INT8 of the MXFP4 values)."""
    path = mxfp4_checkpoint("E6-H64-I32")
    engines = {q: LLMEngine.from_pretrained(path, quantization=q, **ENGINE_KW)
               for q in ("auto", "mxfp4", None, "int8")}
    kinds = {q: {type(m) for m in _experts(e.runner.model)} for q, e in engines.items()}
    assert kinds == {"auto": {Mxfp4FusedExperts}, "mxfp4": {Mxfp4FusedExperts}, None: {FusedExperts},
                     "int8": {Int8FusedExperts}}
    mx, fl, i8 = (_experts(engines[q].runner.model) for q in ("auto", None, "int8"))
    for a, b, c, d in zip(mx, _experts(engines["mxfp4"].runner.model), fl, i8):
        assert torch.equal(a.w13_blocks, b.w13_blocks) and torch.equal(a.w2_scales, b.w2_scales)
        assert c.w13.dtype == torch.float32 and torch.equal(c.w13, a.w13) and torch.equal(c.w2, a.w2)
        assert torch.equal(c.b13, a.b13)
        q, s = quantize_int8_per_channel(a.w2[2])
        assert torch.equal(d.w2_q[2], q) and torch.equal(d.w2_scale[2], s)
    mx_bytes, fl_bytes = engines["auto"].runner.weights_bytes, engines[None].runner.weights_bytes
    assert mx_bytes < fl_bytes
    prompts = _prompts(engines["auto"].model_config.vocab_size, 2, seed=3)
    requests = [(f"r{i}", p, None) for i, p in enumerate(prompts)]
    (t_mx, l_mx), (t_fl, l_fl) = _run(engines["auto"], requests), _run(engines[None], requests)
    assert t_mx == t_fl
    for k in l_mx:
        torch.testing.assert_close(l_mx[k], l_fl[k], rtol=1e-4, atol=1e-4)


def test_tensor_parallel_splits_the_codes_like_the_float_weights(mxfp4_checkpoint):
    """apply_tp on MXFP4 experts of a checkpoint keeps, per rank, the codes of the float split's weights."""
    path = mxfp4_checkpoint("E4-H96-I64-sharded")  # I = 64: 32 per rank
    for rank in (0, 1):
        tp = TensorParallel(rank=rank, world_size=2)
        mx, cfg = load_model(path, progress=False)
        fl, _ = load_model(path, progress=False)
        apply_quantization(fl, None)
        apply_tp(mx, cfg, tp)
        apply_tp(fl, cfg, tp)
        for a, b in zip(_experts(mx), _experts(fl)):
            assert type(a) is Mxfp4FusedExperts and a.intermediate_size == 32
            assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
            assert torch.equal(a.b13, b.b13) and torch.equal(a.b2, b.b2)
    mx, cfg = load_model(mxfp4_checkpoint("E6-H64-I32"), progress=False)
    with pytest.raises(ValueError, match="whole 32-element blocks per rank: 32 / ranks = 16"):
        apply_tp(mx, cfg, TensorParallel(rank=0, world_size=2))


def test_dummy_weights_of_an_mxfp4_config_are_mxfp4(mxfp4_checkpoint, tmp_path):
    only_cfg = tmp_path / "cfg"
    only_cfg.mkdir()
    shutil.copy(os.path.join(mxfp4_checkpoint("E6-H64-I32"), "config.json"), only_cfg / "config.json")
    model, _ = load_model(only_cfg, load_format="dummy", progress=False)
    assert all(type(m) is Mxfp4FusedExperts for m in _experts(model))


# ---------------------------------------------------------------------------------------------- malformed


def _edited(src: str, dst, edit) -> str:
    """A copy of the single-file checkpoint ``src`` with its tensors edited by ``edit(state_dict)``."""
    path = shutil.copytree(src, dst)
    sd = load_file(os.path.join(path, "model.safetensors"))
    edit(sd)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def _set(name: str, fn):
    def edit(sd):
        sd[name] = fn(sd[name])
    return edit


GU_BLOCKS, GU_SCALES = f"{EX.format(2)}.gate_up_proj_blocks", f"{EX.format(2)}.gate_up_proj_scales"
DOWN_BLOCKS, DOWN_SCALES = f"{EX.format(0)}.down_proj_blocks", f"{EX.format(0)}.down_proj_scales"
MALFORMED = {  # E6-H64-I32: gate_up_proj_blocks (6, 64, 2, 16), down_proj_blocks (6, 64, 1, 16)
    "blocks-shape": (_set(GU_BLOCKS, lambda t: t[..., :8].contiguous()),
                     r"gate_up_proj_blocks.*shape \(6, 64, 2, 8\), expected \(6, 64, 2, 16\) \(\[E, 2I, H/32, 16\]"),
    "blocks-unmerged": (_set(DOWN_BLOCKS, lambda t: t.flatten(-2).contiguous()),
                        r"down_proj_blocks.*shape \(6, 64, 16\), expected \(6, 64, 1, 16\)"),
    "scales-shape": (_set(GU_SCALES, lambda t: t[:, :32].contiguous()),
                     r"gate_up_proj_scales.*shape \(6, 32, 2\), expected \(6, 64, 2\) \(\[E, 2I, H/32\] uint8"),
    "blocks-dtype": (_set(DOWN_BLOCKS, lambda t: t.to(torch.int8)),
                     r"down_proj_blocks.*dtype torch.int8, expected \[E, H, I/32, 16\] uint8 MXFP4 codes"),
    "scales-dtype": (_set(DOWN_SCALES, lambda t: t.to(torch.bfloat16)),
                     r"down_proj_scales.*dtype torch.bfloat16, expected \[E, H, I/32\] uint8 E8M0 scales"),
    "bias-dtype": (_set(f"{EX.format(1)}.down_proj_bias", lambda t: t.to(torch.uint8)),
                   r"down_proj_bias.*dtype torch.uint8, expected a floating-point tensor"),
    "missing-scales": (lambda sd: sd.pop(DOWN_SCALES), r"missing 1 tensor.*layers\.0\.mlp\.experts\.down_proj_scales"),
    "float-and-codes": (lambda sd: sd.update({f"{EX.format(1)}.down_proj": torch.zeros(6, 32, 64)}),
                        r"unexpected tensor.*layers\.1\.mlp\.experts\.down_proj'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_mxfp4_tensors_are_refused_by_name(case, mxfp4_checkpoint, tmp_path):
    edit, message = MALFORMED[case]
    path = _edited(mxfp4_checkpoint("E6-H64-I32"), tmp_path / case, edit)
    with pytest.raises(WeightLoadError, match=message):
        load_model(path, progress=False)


def test_truncated_mxfp4_shard_is_named(mxfp4_checkpoint, tmp_path):
    path = shutil.copytree(mxfp4_checkpoint("E4-H96-I64-sharded"), tmp_path / "ck")
    import json

    weight_map = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    shard = weight_map[f"{EX.format(1)}.gate_up_proj_blocks"]
    target = os.path.join(path, shard)
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) - 100)
    with pytest.raises(WeightLoadError, match=f"{shard}.*truncated or corrupt"):
        load_model(path, progress=False)
