"""Bad adapters in a running engine: each is refused with a message that says what is wrong, its request finishes
with finish_reason "error" (AsyncEngine consumers get AdapterLoadError), nothing of it is left in any tier (disk
cache, CPU, GPU slot), and the good requests of the same batch give the tokens they give alone."""
from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.lora.fetch import file_uri
from loraplex.engine.lora.manager import AdapterLoadError, AdapterManager, sha256_file
from loraplex.engine.lora.ref import AdapterRef
from tests.utils.adapters import make_peft_adapter

MAX_RANK = 8
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
WEIGHTS = "adapter_model.safetensors"
# kind: the words the error must contain
EXPECTED = {
    "rank_over_limit": "rank 16 exceeds this deployment's limit of 8",
    "shapes_do_not_fit": "do not fit the base model",
    "unknown_target": "unsupported target 'lm_head'",
    "dora": "DoRA adapters are not supported",
    "nan_weights": "holds NaN or Inf values",
    "inf_weights": "holds NaN or Inf values",
    "truncated_file": "is truncated",
    "sha256_mismatch": "sha256 mismatch for adapter 'tenant/sha256_mismatch/1'",
}


def _ref(kind: str, folder: str, sha256: str | None = None) -> AdapterRef:
    sha = sha256 or sha256_file(os.path.join(folder, WEIGHTS))
    return AdapterRef(f"tenant/{kind}/1", file_uri(folder), sha)


def _copy(folder: str, dest) -> str:
    shutil.copytree(folder, dest)
    return str(dest)


def _poison(folder: str, value: float) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, WEIGHTS)
    tensors = load_file(path)
    name = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[name][0, 0] = value
    save_file(tensors, path)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, peft_adapter, tmp_path_factory):
    base = tiny_checkpoint("llama")
    tmp = tmp_path_factory.mktemp("bad-adapters")
    good = peft_adapter(base, r=4, alpha=8, seed=400)
    bad: dict[str, AdapterRef] = {}
    bad["rank_over_limit"] = _ref("rank_over_limit", peft_adapter(base, r=16, alpha=8, attention_only=True, seed=401))
    # a real PEFT adapter of another tiny llama (hidden 40, not 72; its layers 0-1 only, which our base has)
    bad["shapes_do_not_fit"] = _ref("shapes_do_not_fit", make_peft_adapter("llama", str(tmp / "other-base"), r=4,
                                                                           layers_to_transform=[0, 1],
                                                                           target_modules=["q_proj", "v_proj"]))
    bad["unknown_target"] = _ref("unknown_target", peft_adapter(base, r=4, alpha=8, targets=["q_proj", "lm_head"]))
    bad["dora"] = _ref("dora", make_peft_adapter("llama", str(tmp / "dora"), r=4, use_dora=True))
    for kind, value in (("nan_weights", float("nan")), ("inf_weights", float("inf"))):
        folder = _copy(good, tmp / kind)
        _poison(folder, value)
        bad[kind] = _ref(kind, folder)
    folder = _copy(good, tmp / "truncated")
    path = os.path.join(folder, WEIGHTS)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) * 2 // 3)
    bad["truncated_file"] = _ref("truncated_file", folder)  # its sha256 is the truncated file's: format catches it
    bad["sha256_mismatch"] = _ref("sha256_mismatch", good, sha256="ab" * 32)
    assert set(bad) == set(EXPECTED)
    return base, _ref("good", good), bad


def make_engine(base, cache_dir) -> LLMEngine:
    return LLMEngine.from_pretrained(base, device="cpu", dtype="float32", enable_lora=True, max_loras=2,
                                     max_lora_rank=MAX_RANK, max_num_seqs=32, block_size=4, progress=False,
                                     adapter_cache_dir=str(cache_dir))


GOOD_PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def alone(setup, tmp_path_factory):
    """Tokens of the good requests (adapter, base), each run alone."""
    base, good, _ = setup
    engine = make_engine(base, tmp_path_factory.mktemp("alone-cache"))
    out = {"good": engine.generate([GOOD_PROMPTS[0]], PARAMS, adapters=[good])[0].output_token_ids,
           "base": engine.generate([GOOD_PROMPTS[1]], PARAMS)[0].output_token_ids}
    engine.close()
    return out


@pytest.fixture(scope="module")
def mixed_run(setup, tmp_path_factory):
    """One engine, one batch: every bad adapter's request beside a good-adapter and a base request."""
    base, good, bad = setup
    cache = tmp_path_factory.mktemp("mixed-cache")
    engine = make_engine(base, cache)
    engine.add_request("good", GOOD_PROMPTS[0], PARAMS, good)
    engine.add_request("base", GOOD_PROMPTS[1], PARAMS)
    for kind, ref in bad.items():
        engine.add_request(kind, [3, 4, 5], PARAMS, ref)
    final = {}
    for _ in range(2000):
        final.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    residency = engine.list_adapters()
    engine.close()
    return final, residency, cache, good


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_bad_adapter_is_refused_with_a_clear_message(kind, mixed_run, setup):
    final, residency, cache, _ = mixed_run
    out = final[kind]
    assert out.finished and out.finish_reason == "error" and out.output_token_ids == []
    assert out.error.startswith(f"adapter 'tenant/{kind}/1' could not be loaded: ")
    assert EXPECTED[kind] in out.error, out.error
    assert residency["failed"][f"tenant/{kind}/1"] in out.error


def test_nothing_of_a_bad_adapter_is_left_in_any_tier(mixed_run, setup):
    final, residency, cache, good = mixed_run
    bad_ids = {f"tenant/{kind}/1" for kind in EXPECTED}
    assert set(residency["gpu"].values()) == {good.adapter_id} and residency["cpu"] == [good.adapter_id]
    assert set(residency["failed"]) == bad_ids and residency["loading"] == []
    # the disk cache holds the good adapter's entry and nothing else: no bad entry, no partial fetch
    assert os.listdir(cache) == [AdapterManager.cache_key(good)]
    assert residency["counters"]["failures"] == len(EXPECTED) and residency["counters"]["loads"] == 1


def test_good_requests_beside_bad_adapters_give_their_tokens_alone(mixed_run, alone):
    final = mixed_run[0]
    assert final["good"].finish_reason == final["base"].finish_reason == "length"
    assert final["good"].output_token_ids == alone["good"] and final["base"].output_token_ids == alone["base"]
    assert alone["good"] != alone["base"]


def test_async_consumer_gets_the_adapter_error_raised(setup, alone, tmp_path):
    base, good, bad = setup
    engine = AsyncEngine(make_engine(base, tmp_path / "cache"))

    async def collect(rid, prompt, adapter):
        last = None
        async for out in engine.generate(rid, prompt, PARAMS, adapter):
            last = out
        return last

    async def main():
        return await asyncio.gather(collect("bad", [3, 4, 5], bad["sha256_mismatch"]),
                                    collect("good", GOOD_PROMPTS[0], good), return_exceptions=True)

    try:
        err, ok = asyncio.run(main())
    finally:
        engine.shutdown()
    assert isinstance(err, AdapterLoadError) and EXPECTED["sha256_mismatch"] in str(err)
    assert "expected abababab" in str(err)
    assert ok.output_token_ids == alone["good"]


def test_engine_without_lora_refuses_adapters(setup):
    base, good, _ = setup
    engine = LLMEngine.from_pretrained(base, device="cpu", dtype="float32", progress=False)
    with pytest.raises(ValueError, match="start it with enable_lora=True"):
        engine.add_request("x", [1, 2, 3], PARAMS, good)
    with pytest.raises(ValueError, match="LoRA is disabled"):
        engine.list_adapters()
    assert not engine.has_unfinished_requests()


def test_add_request_rejects_a_non_ref_adapter(setup, tmp_path):
    base, _, _ = setup
    engine = make_engine(base, tmp_path / "cache")
    with pytest.raises(TypeError, match="adapter must be an AdapterRef, got str"):
        engine.add_request("x", [1, 2, 3], PARAMS, "tenant/a/1")
    assert not engine.has_unfinished_requests()
    engine.close()
