"""benchmarks/engine/check_mxfp4_checkpoint.py's transformers reference and diagnose_mxfp4_gpu.py's bisection, on the
CPU. transformers 5.17 (the GPU image's) dequantises MXFP4 experts to bfloat16 whatever ``dtype`` asks, and its
grouped_mm experts then run in bf16; ``bf16_dequantisation`` makes the installed transformers do the same, so the
reference's upcast and the diagnosis are tested against the behaviour they exist for."""
from __future__ import annotations

import os

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.quantization.mxfp4_checkpoint import merge_blocks
from loraplex.engine.testing.tiny import make_tiny_mxfp4_checkpoint
from loraplex.kernels.mxfp4 import dequantize_mxfp4
from tests.utils.scripts import load_script


def _script(name: str):
    return load_script("engine", name)


@pytest.fixture
def bf16_dequantisation(monkeypatch):
    """transformers' MXFP4 dequantisation as in 5.17: bfloat16, whatever dtype the parameter has."""
    from transformers.integrations import mxfp4

    def to_bf16(blocks, scales, dtype=None):
        return torch.nn.Parameter(mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))

    monkeypatch.setattr(mxfp4, "dequantize_convertops", to_bf16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4"))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_reference_is_the_float32_model_when_transformers_dequantises_to_bf16(checkpoint, bf16_dequantisation):
    check = _script("check_mxfp4_checkpoint")
    assert "bfloat16" in check.hf_expert_dtypes(checkpoint)  # the stand-in for transformers 5.17 is in force
    model = check.hf_model(checkpoint, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    for i, layer in enumerate(model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            p = f"model.layers.{i}.mlp.experts.{proj}"
            want = dequantize_mxfp4(merge_blocks(tensors[f"{p}_blocks"]), tensors[f"{p}_scales"]).transpose(1, 2)
            assert torch.equal(getattr(layer.mlp.experts, proj).detach(), want), p
    # the engine's greedy tokens and logits are the reference's; transformers as loaded (bf16 experts) is not
    engine = LLMEngine.from_pretrained(checkpoint, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                                       progress=False)
    rows = []
    engine.runner.logits_hook = lambda seqs, lg: rows.append(lg[0].clone())
    prompt = [17, 203, 54, 88, 129, 5, 260]
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() if out.finished for t in out.output_token_ids]
    from transformers import AutoModelForCausalLM, Mxfp4Config

    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager",
                                                  quantization_config=Mxfp4Config(dequantize=True))
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0, len(prompt) - 1:]
        as_loaded = loaded(input_ids=ids).logits[0, len(prompt) - 1:]
    assert ref.argmax(-1).tolist() == tokens
    assert _rel(torch.stack(rows), ref) <= 1e-4
    assert _rel(torch.stack(rows), as_loaded) > 1e-3


def test_diagnosis_finds_the_bf16_reference_on_the_cpu(tmp_path, bf16_dequantisation):
    """The CPU cells of the matrix: the engine agrees with the float32 reference and not with transformers as
    loaded; the layer probe then shows the first difference in layer 0's MoE output (attention and router equal)."""
    diag = _script("diagnose_mxfp4_gpu")
    args = type("Args", (), dict(device="cpu", engine_variants="cpu", new_tokens=4, tol=1e-4, probe=None))()
    res = diag.run_case("single", args, str(tmp_path), deadline=float("inf"))
    assert res["hf_facts"]["expert_param_dtypes"]["gate_up_proj"] == "torch.bfloat16"
    assert res["hf_facts"]["expert_weights_vs_codes_max_abs"] == 0.0
    cells = res["engines"]["cpu"]["vs_hf"]
    assert all(r["agree"] and r["worst_rel_err"] <= 1e-4 for r in cells["cpu-fp32"])
    assert max(r["worst_rel_err"] for r in cells["cpu"]) > 1e-3
    lines = diag.verdict(res, 1e-4)
    assert "engine cpu vs transformers cpu-fp32: agrees" in lines
    assert "engine cpu vs transformers cpu: DIFFERS" in lines
    probe = res["probe"]
    assert probe["engine_variant"] == "cpu"
    as_loaded, fp32 = probe["layers"]["engine-cpu vs hf-cpu"], probe["layers"]["engine-cpu vs hf-cpu-fp32"]
    assert as_loaded[0]["attn"] <= 1e-5 and as_loaded[0]["router"] <= 1e-5 and as_loaded[0]["moe"] > 1e-3
    assert all(row.get("out", row.get("logits")) <= 1e-4 for row in fp32)
