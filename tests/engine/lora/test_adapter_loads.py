"""Adapter copies to the GPU off the critical path, through the whole engine with the copy's completion under the
test's control (on CUDA it is a side-stream event; on CPU the copy itself is synchronous): while a cold adapter's
copy is in flight its request waits and keeps its place, requests for resident adapters behind it are admitted
(admission skips, it does not block), running requests keep decoding, and the cold request starts in the step
after its copy completes, with the running ones still running. Tokens are PEFT's. Tiny llama, float32."""
from __future__ import annotations

import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.lora.fetch import file_uri
from loraplex.engine.lora.ref import AdapterRef
from tests.engine.lora.fakes import ManualCopier


def test_a_cold_copy_holds_back_only_its_own_request(tiny_checkpoint, peft_adapter, peft_logits, tmp_path):
    path = tiny_checkpoint("llama")
    folders = {n: peft_adapter(path, r=r, alpha=8, seed=400 + i) for i, (n, r) in enumerate((("a", 8), ("b", 4)))}
    ref = {n: AdapterRef(f"tenant/{n}/1", file_uri(f)) for n, f in folders.items()}
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8,
                                       block_size=4, max_num_seqs=8, max_num_batched_tokens=64, progress=False,
                                       adapter_cache_dir=str(tmp_path / "adapters"))
    copier = engine.runner.lora.copier = ManualCopier()
    for r in ref.values():
        assert engine.load_adapter(r, wait=True, timeout=60) == "ready"  # on CPU: only the GPU copy is left
    gen = torch.Generator().manual_seed(4)
    prompts = {rid: torch.randint(1, 300, (7,), generator=gen).tolist() for rid in ("ra", "rb", "ra2", "base")}
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens: dict[str, int] = {}
    final = {}

    def step():
        for o in engine.step():
            tokens[o.request_id] = len(o.output_token_ids)
            if o.finished:
                final[o.request_id] = o

    def running():
        return {s.request_id for s in engine.scheduler.running}

    engine.add_request("ra", prompts["ra"], long, adapter=ref["a"])
    step()
    assert running() == set() and engine.adapters.pool.copying() == [ref["a"]]  # a's copy started, ra waits
    copier.finish_all()
    step()
    assert running() == {"ra"} and tokens["ra"] == 1
    engine.add_request("rb", prompts["rb"], short, adapter=ref["b"])   # cold: its copy starts now
    engine.add_request("ra2", prompts["ra2"], short, adapter=ref["a"])  # behind it, resident
    engine.add_request("base", prompts["base"], short)
    step()
    assert running() == {"ra", "ra2", "base"} and [s.request_id for s in engine.scheduler.waiting] == ["rb"]
    assert engine.adapters.pool.copying() == [ref["b"]]
    before = tokens["ra"]
    for _ in range(3):
        step()
    assert tokens["ra"] == before + 3 and "rb" not in running()  # decoding went on while b's copy was in flight
    copier.finish_all()
    step()
    assert "rb" in running() and "ra" in running() and "ra" not in final  # no drain needed
    while engine.has_unfinished_requests():
        step()
    for rid, name in (("ra", "a"), ("rb", "b"), ("ra2", "a"), ("base", None)):
        out = final[rid].output_token_ids
        want = peft_logits(path, folders[name] if name else None, prompts[rid], out)
        assert want.argmax(-1).tolist() == out, rid
    c = engine.list_adapters()["counters"]
    # ra2 found a resident: the one slot hit (the requests a copy was made for, and polls during it, are none)
    assert c["activations"] == 2 and c["slot_hits"] == 1 and c["evictions"] == 0
    assert engine.list_adapters()["gpu_copying"] == []
    assert len(engine.list_adapters()["load_seconds"]["gpu"]) == 2
    engine.close()
