"""Acceptance: an engine with tensor_parallel_size=2 on CPU (gloo, rank 0 here + one spawned worker) gives the
same greedy tokens as tensor_parallel_size=1, and logits within 1e-4 relative, with adapters mixed in every
batch, for a dense and a MoE family. Chunked prefill, prefix caching and a copy-on-write fork (n=2) make the
workers replay block copies and adapter loads as well as forwards."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.distributed.sharding import TensorParallelError
from loraplex.engine.lora.ref import AdapterRef

NEW_TOKENS = 6
PROMPTS = {"shared": [5, 77, 13, 250, 9, 31, 140, 2, 66, 18, 7], "other": [301, 4, 4, 92, 150, 11, 60]}
REQUESTS = [  # (request id, prompt, adapter name | None): one prompt under A, the base model and B
    ("a-shared", "shared", "A"), ("base-shared", "shared", None), ("b-shared", "shared", "B"),
    ("a-other", "other", "A"), ("base-other", "other", None),
]


def _run(path: str, folders: dict[str, str], tp: int, tmp_path) -> tuple[dict, dict, list, set]:
    engine = LLMEngine.from_pretrained(
        path, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
        enable_lora=True, max_loras=2, max_lora_rank=8, adapter_cache_dir=str(tmp_path / f"cache-tp{tp}"),
        progress=False, tensor_parallel_size=tp)
    shipped: set[str] = set()  # kinds of entries rank 0 sent to the workers
    if tp > 1:
        broadcast = engine.runner.tp.broadcast_object
        engine.runner.tp.broadcast_object = lambda obj=None: (shipped.update(e[0] for e in obj), broadcast(obj))[1]
    try:
        refs = {name: AdapterRef(f"tenant/{name}/1", f"file://{folder}") for name, folder in folders.items()}
        for ref in refs.values():  # resident before the first step: both engines schedule the same batches
            assert engine.load_adapter(ref, wait=True, timeout=60) == "ready"
        logits = defaultdict(list)
        engine.runner.logits_hook = lambda seqs, lg: [logits[s.request_id].append(lg[j].clone())
                                                      for j, s in enumerate(seqs)]
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        for rid, prompt, name in REQUESTS:
            engine.add_request(rid, PROMPTS[prompt], greedy, adapter=refs[name] if name else None)
        # a fork: two sequences share the prompt's blocks and copy the partial last one on write
        engine.add_request("b-fork", PROMPTS["other"], SamplingParams(max_tokens=NEW_TOKENS, n=2, temperature=0.8,
                                                                      seed=7, ignore_eos=True), adapter=refs["B"])
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        tokens = {rid: [list(c.output_token_ids) for c in out.outputs] for rid, out in final.items()}
        return tokens, dict(logits), [o.error for o in final.values()], shipped
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_tp2_matches_tp1_with_mixed_adapters(family, tiny_checkpoint, tp_adapter, tmp_path):
    path = tiny_checkpoint(family)
    folders = {"A": tp_adapter(path, seed=1), "B": tp_adapter(path, seed=2)}
    ref_tokens, ref_logits, errors, _ = _run(path, folders, 1, tmp_path)
    assert errors == [None] * (len(REQUESTS) + 1)
    # the adapters matter: one prompt, three different continuations
    assert len({tuple(ref_tokens[r][0]) for r in ("a-shared", "base-shared", "b-shared")}) == 3

    tokens, logits, errors, shipped = _run(path, folders, 2, tmp_path)
    assert errors == [None] * (len(REQUESTS) + 1)
    assert shipped == {"load", "tokens", "blocks", "forward", "stop"}
    assert tokens == ref_tokens
    for rid, _, _ in REQUESTS:
        assert len(logits[rid]) == len(ref_logits[rid]) == NEW_TOKENS
        for got, want in zip(logits[rid], ref_logits[rid]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(tiny_checkpoint):
    with pytest.raises(TensorParallelError, match=r"num_attention_heads \(6\) is not divisible by "
                                                  r"tensor_parallel_size=4"):
        LLMEngine.from_pretrained(tiny_checkpoint("llama"), device="cpu", progress=False, tensor_parallel_size=4)
    import torch.distributed as dist

    assert not dist.is_initialized()


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_tensor_parallel_size_is_validated(bad):
    with pytest.raises(ValueError, match=f"tensor_parallel_size must be an integer >= 1, got {bad!r}"):
        EngineConfig(model="/nonexistent", tensor_parallel_size=bad)


def test_worker_cli_refuses_rank_zero(tmp_path, capsys):
    from loraplex.engine.distributed.worker import main

    config = tmp_path / "engine.json"
    config.write_text('{"model": "/nonexistent"}')
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(config), "--rank", "0", "--world-size", "2", "--master-port", "1",
              "--max-model-len", "8"])
    assert exc.value.code == 2
    assert "--rank must be in [1, 2) (rank 0 is the engine)" in capsys.readouterr().err
