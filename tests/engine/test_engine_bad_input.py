"""Bad input raises an error that names the problem, and requests already running are unaffected."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.config import ConfigError


def make_engine(path: str, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, progress=False, **kw)


def ids(engine, n, seed=0):
    return torch.randint(0, engine.model_config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_bad_requests_fail_alone_and_running_requests_finish_unchanged(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    clean = make_engine(path, max_model_len=64)
    prompts = [ids(clean, 7, 1), ids(clean, 12, 2)]
    expected = clean.generate(prompts, params)

    engine = make_engine(path, max_model_len=64)
    engine.add_request("a", prompts[0], params)
    engine.add_request("b", prompts[1], params)
    finals = {}
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})

    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.add_request("too-long", ids(engine, 64), params)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, "):
        engine.add_request("bad-ids", [1, 2, engine.model_config.vocab_size + 5], params)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", [], params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", prompts[0], params)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("bad-stop", prompts[0], SamplingParams(max_tokens=4, stop_token_ids=[10**9]))

    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(finals) == {"a", "b"}
    assert finals["a"].output_token_ids == expected[0].output_token_ids
    assert finals["b"].output_token_ids == expected[1].output_token_ids
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks


@pytest.mark.parametrize("field,value,needle", [
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", -3, "max_tokens"),
    ("temperature", -0.5, "temperature"),
    ("top_p", 0.0, "top_p"),
])
def test_sampling_params_reject_out_of_range(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**{field: value})


def test_unknown_stop_criterion_is_named():
    with pytest.raises(ValueError, match="stop_regex"):
        SamplingParams.from_dict({"max_tokens": 4, "stop_regex": "foo"})


def test_unknown_family_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 8, "num_attention_heads": 2,
                                                      "num_hidden_layers": 1, "vocab_size": 10}))
    with pytest.raises(ConfigError, match="'gpt2' is not supported"):
        make_engine(str(tmp_path))


@pytest.fixture
def sharded_copy(tiny_checkpoint, tmp_path):
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", str(tmp_path / "sharded"), max_shard_size="40KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2, "the checkpoint should be sharded for these tests"
    return path, shards


def test_missing_shard_is_named(sharded_copy):
    path, shards = sharded_copy
    os.remove(os.path.join(path, shards[-1]))
    with pytest.raises(Exception, match=shards[-1]):
        make_engine(path)


def test_truncated_shard_is_named(sharded_copy):
    path, shards = sharded_copy
    target = os.path.join(path, shards[0])
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) // 2)
    with pytest.raises(Exception, match=shards[0]):
        make_engine(path)


def test_shape_mismatch_is_named(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("llama")
    dst = tmp_path / "bad-shape"
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    name = next(k for k in weights if k.endswith("layers.0.self_attn.k_proj.weight"))
    weights[name] = torch.randn(weights[name].shape[0] + 1, weights[name].shape[1])
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match="k_proj"):
        make_engine(str(dst))
