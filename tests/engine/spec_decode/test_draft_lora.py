"""Per-adapter draft LoRAs: the draft model applies each sequence's draft LoRA to its own rows (mixed adapters, rows
without one, in one propose step), checked against transformers + PEFT; greedy output with per-adapter drafts is the
non-speculative output token for token, with aborts, and nothing leaks; settings, engine API and command line."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from loraplex.engine import SamplingParams
from loraplex.engine.lora.format import AdapterFormatError
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec_decode import SpeculativeConfig
from loraplex.engine.spec_decode.draft_lora import resolve_draft_folder
from loraplex.engine.spec_decode.proposer import SpecSequence
from tests.engine.spec_decode.conftest import adapter_refs, assert_all_free, drive, make_engine, prompt_list

K = 3


def _greedy(model, prompt: list[int], k: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _hf_drafts(draft: str, folder: str | None, prompts: list[list[int]], k: int) -> list[list[int]]:
    """What a greedy draft proposes, by transformers (+ PEFT when ``folder``): the k next argmax tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32, attn_implementation="eager").eval()
    if folder is not None:
        model = PeftModel.from_pretrained(model, folder).eval()
    return [_greedy(model, p, k) for p in prompts]


@pytest.mark.parametrize("family,graphs", [("llama", False), ("qwen3_moe", True)])
def test_draft_lora_rows_follow_peft(family, graphs, tiny_checkpoint, peft_folders):
    """One propose step mixes rows of two draft LoRAs, a bare row and a row whose adapter has no draft LoRA: each row
    proposes what transformers + PEFT (or the bare draft) proposes, also after the target accepted some tokens (the
    draft's K/V kept); rows with a draft LoRA propose other tokens than the bare draft (the LoRA is applied), and an
    unregistered draft LoRA falls back to the bare draft."""
    from loraplex.engine.spec_decode.draft_model import DraftModelProposer, DraftRunner

    draft = tiny_checkpoint(family)
    loras = peft_folders(draft)  # LoRAs of the draft model itself
    prompts = prompt_list((7, 5, 9, 6, 8), seed=11)
    adapters = [AdapterRef("t/a/1", "file:///a"), None, AdapterRef("t/b/1", "file:///b"),
                AdapterRef("t/c/1", "file:///c"), AdapterRef("t/a/1", "file:///a")]
    runner = DraftRunner(draft, device=torch.device("cpu"), dtype=torch.float32, block_size=4, max_model_len=64,
                         max_num_seqs=8, graphs=graphs, lora_max_rank=8)
    runner.adapters.register("t/a/1", loras["a"])
    runner.adapters.register("t/b/1", loras["b"])
    prop = DraftModelProposer(runner, k=K, vocab_size=320, max_batched_tokens=128)
    seqs = [Sequence(i, f"r{i}", p) for i, p in enumerate(prompts)]
    batch = [SpecSequence(s, s.request_id, a, SamplingParams(temperature=0.0), None, K) for s, a in zip(seqs, adapters)]
    folder_of = {"t/a/1": loras["a"], "t/b/1": loras["b"]}

    def oracle(tokens: list[list[int]]) -> list[list[int]]:
        want = [None] * len(tokens)
        for folder in (None, loras["a"], loras["b"]):
            rows = [i for i, a in enumerate(adapters) if folder_of.get(getattr(a, "adapter_id", None)) == folder]
            for i, d in zip(rows, _hf_drafts(draft, folder, [tokens[i] for i in rows], K)):
                want[i] = d
        return want

    first = [p.token_ids for p in prop.propose(batch)]
    assert first == oracle(prompts)
    bare = _hf_drafts(draft, None, prompts, K)
    assert first[0] != bare[0] and first[2] != bare[2] and first[4] != bare[4], "the draft LoRA was not applied"
    assert first[1] == bare[1] and first[3] == bare[3]
    for s, d in zip(seqs, first):  # the target accepts the first draft and adds a token of its own
        s.append_token(d[0])
        s.append_token(300)
    second = [p.token_ids for p in prop.propose(batch)]
    assert second == oracle([s.token_ids_slice(0, s.num_tokens) for s in seqs])
    assert prop.stats()["draft_adapters"] == 2
    assert runner.adapters.unregister("t/a/1") and not runner.adapters.unregister("t/a/1")
    for s in seqs:
        prop.release(s.seq_id)
    third = [p.token_ids for p in prop.propose(batch)]
    assert third[0] == _hf_drafts(draft, None, [seqs[0].token_ids_slice(0, seqs[0].num_tokens)], K)[0]
    for s in seqs:
        prop.release(s.seq_id)
    runner.kv.check_invariants()
    assert runner.kv.num_free_blocks == runner.kv.num_blocks


def _workload(refs: dict) -> list[tuple]:
    prompts = prompt_list((6, 9, 4, 11, 7, 5, 8), seed=5)
    adapters = [None, "a", "b", "a", None, "b", "a"]
    lengths = [18, 15, 17, 9, 12, 16, 14]
    return [(f"r{i}", prompts[i], SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True),
             refs[adapters[i]] if adapters[i] else None) for i in range(len(prompts))]


def _run(path: str, refs: dict, spec: dict | None, cache: str, setup=None, before_step=None) -> tuple[dict, object]:
    engine = make_engine(path, spec, adapter_cache_dir=cache, enable_lora=True, max_loras=2, max_lora_rank=8)
    for ref in refs.values():
        assert engine.load_adapter(ref, wait=True) == "ready"
    if setup is not None:
        setup(engine)
    finals = drive(engine, _workload(refs), arrivals={0: [0, 1, 2, 3], 2: [4, 5], 4: [6]}, before_step=before_step)
    assert_all_free(engine)
    return {rid: o.output_token_ids for rid, o in finals.items()}, engine


def test_lossless_greedy_with_per_adapter_drafts(tiny_checkpoint, peft_folders, perturbed_checkpoint, tmp_path):
    """Base requests, adapter a (a draft LoRA), adapter b (none: the bare draft) in every step: the tokens are those
    of non-speculative greedy decoding; the draft LoRA registered from the settings, or through the engine API from
    an adapter folder holding it in ``draft/``; a request aborted mid-run leaves no block (target or draft) behind."""
    path = tiny_checkpoint("llama")
    refs = adapter_refs(peft_folders(path))
    draft = perturbed_checkpoint(path, 0.1)
    draft_lora = peft_folders(draft)["a"]
    want, _ = _run(path, refs, None, str(tmp_path / "ref"))
    spec = dict(method="draft", draft_model=draft, num_speculative_tokens=K, draft_adapters={"t/a/1": draft_lora},
                draft_max_lora_rank=8)
    got, engine = _run(path, refs, spec, str(tmp_path / "cfg"))
    assert got == want
    stats = engine.spec.snapshot()
    assert stats["proposer"]["draft_adapters"] == 1
    by_adapter = {r["adapter"]: r for r in stats["adapters"]}
    assert {None, "t/a/1", "t/b/1"} <= set(by_adapter) and stats["accepted"] < stats["proposed"], stats
    engine.close()

    upload = tmp_path / "upload-a"       # the tenant's adapter folder with its draft LoRA beside it
    shutil.copytree(peft_folders(path)["a"], upload)
    shutil.copytree(draft_lora, upload / "draft")
    assert resolve_draft_folder(upload) == os.path.join(upload, "draft")

    def abort_r3(k, engine):
        if k == 6:
            engine.abort("r3")

    got, engine = _run(path, refs, {**spec, "draft_adapters": {}}, str(tmp_path / "api"),
                       setup=lambda e: e.register_draft_adapter("t/a/1", str(upload)), before_step=abort_r3)
    assert "r3" not in got and got == {rid: t for rid, t in want.items() if rid != "r3"}
    assert engine.spec.draft_adapters().folders() == {"t/a/1": os.path.join(upload, "draft")}
    assert engine.unregister_draft_adapter("t/a/1") and not engine.unregister_draft_adapter("t/a/1")
    engine.close()


def test_draft_lora_discovered_beside_the_adapter(tiny_checkpoint, peft_folders, perturbed_checkpoint, tmp_path):
    """``discover_draft_adapters``: an adapter whose file:// folder holds ``draft/`` drafts with it once read (off the
    step thread); one whose ``draft/`` is a LoRA of another model keeps the bare draft (the reason kept, the engine
    unharmed); output stays the non-speculative output throughout."""
    path = tiny_checkpoint("llama")
    targets = peft_folders(path)
    draft = perturbed_checkpoint(path, 0.1)
    uploads = {}
    for name, draft_lora in (("a", peft_folders(draft)["a"]), ("b", peft_folders(tiny_checkpoint("qwen3"))["a"])):
        uploads[name] = tmp_path / f"upload-{name}"
        shutil.copytree(targets[name], uploads[name])
        shutil.copytree(draft_lora, uploads[name] / "draft")
    refs = adapter_refs({n: str(f) for n, f in uploads.items()})
    want, _ = _run(path, refs, None, str(tmp_path / "ref"))
    spec = dict(method="draft", draft_model=draft, num_speculative_tokens=K, discover_draft_adapters=True,
                draft_max_lora_rank=8)
    got, engine = _run(path, refs, spec, str(tmp_path / "found"))
    assert got == want
    adapters = engine.spec.draft_adapters()
    adapters.wait()
    adapters.poll()
    assert adapters.folders() == {"t/a/1": os.path.join(uploads["a"], "draft")}
    assert "t/b/1" in adapters.errors and adapters.slot_of(refs["b"]) == -1
    got, _ = _run_more(engine, refs)
    assert got == _run_more(make_engine(path, None, adapter_cache_dir=str(tmp_path / "ref2"), enable_lora=True,
                                        max_loras=2, max_lora_rank=8), refs)[0]
    engine.close()


def _run_more(engine, refs):
    for ref in refs.values():
        assert engine.load_adapter(ref, wait=True) == "ready"
    finals = drive(engine, _workload(refs)[:4])
    assert_all_free(engine)
    return {rid: o.output_token_ids for rid, o in finals.items()}, engine


def test_draft_adapter_errors(tiny_checkpoint, peft_folders, tmp_path):
    """Settings that cannot work fail on construction with what to fix; a folder that is not a LoRA of the draft
    model is refused at registration and changes nothing."""
    with pytest.raises(ValueError, match="method='draft'"):
        SpeculativeConfig(method="ngram", draft_adapters={"t/a/1": "/x"})
    with pytest.raises(ValueError, match="adapter ids to draft LoRA folders"):
        SpeculativeConfig(method="draft", draft_model="/d", draft_adapters={"t/a/1": ""})
    with pytest.raises(ValueError, match="method='draft'"):
        SpeculativeConfig(method="ngram", discover_draft_adapters=True)
    with pytest.raises(ValueError, match="draft_max_lora_rank"):
        SpeculativeConfig(method="draft", draft_model="/d", draft_adapters={}, draft_max_lora_rank=0)
    path = tiny_checkpoint("llama")
    engine = make_engine(path, dict(method="draft", draft_model=path, draft_adapters={}, draft_max_lora_rank=4))
    with pytest.raises(AdapterFormatError, match="has no adapter_config.json"):
        engine.register_draft_adapter("t/a/1", str(tmp_path))
    with pytest.raises(AdapterFormatError, match="rank"):  # r=8 over the draft's max rank 4
        engine.register_draft_adapter("t/b/1", peft_folders(path)["b"])
    other = tiny_checkpoint("qwen3")                         # a LoRA of another model
    with pytest.raises(AdapterFormatError):
        engine.register_draft_adapter("t/a/1", peft_folders(other)["a"])
    assert len(engine.spec.draft_adapters()) == 0
    engine.close()
    engine = make_engine(path, dict(method="draft", draft_model=path))
    with pytest.raises(ValueError, match="draft_adapters set"):
        engine.register_draft_adapter("t/a/1", peft_folders(path)["a"])
    engine.close()


def test_serve_flags_register_draft_adapters(serve_speculative):
    run = serve_speculative
    draft = ("--speculative-method", "draft", "--speculative-draft-model", "/d")
    cfg = run(*draft, "--speculative-draft-adapter", "t/a/1=/up/a", "--speculative-draft-adapter", "t/b/1=/up/b=2",
              "--speculative-draft-max-lora-rank", "32")
    assert cfg.draft_adapters == {"t/a/1": "/up/a", "t/b/1": "/up/b=2"} and cfg.draft_max_lora_rank == 32
    assert not cfg.discover_draft_adapters
    cfg = run(*draft, "--speculative-discover-draft-adapters")
    assert cfg.discover_draft_adapters and cfg.draft_adapters == {}
    for bad in (["--speculative-draft-adapter", "no-folder"],
                ["--speculative-draft-adapter", "t/a/1=/x", "--speculative-draft-adapter", "t/a/1=/y"]):
        assert run(*draft, *bad) is None and run.exit_codes[-1] == 2
    assert run("--speculative-draft-adapter", "t/a/1=/x") is None and run.exit_codes[-1] == 2
    cfg = run("--speculative-method", "eagle", "--speculative-draft-head", "/h", "--speculative-adapter-draft-head",
              "t/a/1=/ha")
    assert cfg.method == "eagle" and cfg.draft_head == "/h" and cfg.draft_heads == {"t/a/1": "/ha"}
    assert run("--speculative-draft-head", "/h") is None and run.exit_codes[-1] == 2
