"""Per-adapter draft LoRAs and the EAGLE-style head on the device's kernels (float32, tiny checkpoints): what the CPU
tests check with the torch references, here with the LoRA kernels and CUDA graphs of a GPU.

    PYTHONPATH=$PWD python3 benchmarks/engine/check_spec_drafts_gpu.py [--device cuda] [--out DIR]

Cases, per family (llama; qwen3_moe: expert LoRA on target and draft):
  proposals   a DraftRunner with draft LoRAs and captured decode graphs: one propose step mixing two draft LoRAs, a
              bare row and an adapter without one proposes what transformers + PEFT propose (greedy), before and
              after accepted tokens
  lossless    greedy tokens with per-adapter drafts (verify steps eager, then through graphs), with a random EAGLE
              head and with a random EAGLE-3 draft in the published layout (steps eager, then on the verify graphs
              captured with the target's aux hidden states) equal the non-speculative tokens; base and two adapters
              mixed; every KV block free at the end
PASS / FAIL per case; ``--out``: check_spec_drafts_gpu.json there.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

K = 3


def _peft(base: str, out: str, r: int, seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    moe = model.config.model_type in ("gpt_oss", "qwen3_moe", "mixtral")
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
                     + ([] if moe else ["gate_proj", "up_proj", "down_proj"]),
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else None)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


def _perturbed(base: str, out: str, scale: float = 0.1) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    model.save_pretrained(out)
    for f in os.listdir(base):
        if f.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(base, f), os.path.join(out, f))
    return out


def _hf_greedy(model, prompts, k, device):
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(k):
                ids.append(int(model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].argmax()))
            outs.append(ids[len(p):])
    return outs


def check_proposals(draft: str, loras: dict, device: str) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraplex.engine.lora.ref import AdapterRef
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.sequence import Sequence
    from loraplex.engine.spec_decode.draft_model import DraftModelProposer, DraftRunner
    from loraplex.engine.spec_decode.proposer import SpecSequence

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (7, 5, 9, 6, 8)]
    adapters = [AdapterRef("t/a/1", "file:///a"), None, AdapterRef("t/b/1", "file:///b"),
                AdapterRef("t/c/1", "file:///c"), AdapterRef("t/a/1", "file:///a")]
    folder_of = {"t/a/1": loras["a"], "t/b/1": loras["b"]}
    runner = DraftRunner(draft, device=torch.device(device), dtype=torch.float32, block_size=16, max_model_len=128,
                         max_num_seqs=8, graphs=True, lora_max_rank=8)
    for adapter_id, folder in folder_of.items():
        runner.adapters.register(adapter_id, folder)
    prop = DraftModelProposer(runner, k=K, vocab_size=320, max_batched_tokens=256)
    seqs = [Sequence(i, f"r{i}", p) for i, p in enumerate(prompts)]
    batch = [SpecSequence(s, s.request_id, a, SamplingParams(temperature=0.0), None, K) for s, a in zip(seqs, adapters)]

    def oracle(tokens):
        want = [None] * len(tokens)
        for folder in (None, loras["a"], loras["b"]):
            model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).to(device).eval()
            if folder is not None:
                model = PeftModel.from_pretrained(model, folder).to(device).eval()
            rows = [i for i, a in enumerate(adapters) if folder_of.get(getattr(a, "adapter_id", None)) == folder]
            for i, d in zip(rows, _hf_greedy(model, [tokens[i] for i in rows], K, device)):
                want[i] = d
        return want

    first = [p.token_ids for p in prop.propose(batch)]
    ok1 = first == oracle(prompts)
    for s, d in zip(seqs, first):
        s.append_token(d[0])
        s.append_token(300)
    second = [p.token_ids for p in prop.propose(batch)]
    ok2 = second == oracle([s.token_ids_slice(0, s.num_tokens) for s in seqs])
    graphs = runner.graphs is not None and runner.graphs.num_graphs
    for s in seqs:
        prop.release(s.seq_id)
    free = runner.kv.num_free_blocks == runner.kv.num_blocks
    return dict(case="proposals", ok=bool(ok1 and ok2 and free), first=ok1, second=ok2, kv_free=free,
                draft_graphs=int(graphs or 0))


def check_lossless(target: str, target_loras: dict, spec: dict | None, label: str, device: str, work: str) -> dict:
    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.lora.ref import AdapterRef

    refs = {n: AdapterRef(f"t/{n}/1", f"file://{f}") for n, f in target_loras.items()}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (6, 9, 4, 11, 7, 5)]
    names = [None, "a", "b", "a", None, "b"]

    def run(spec):
        engine = LLMEngine.from_pretrained(target, device=device, dtype="float32", max_num_seqs=8, progress=False,
                                           enable_lora=True, max_loras=2, max_lora_rank=8, speculative=spec,
                                           adapter_cache_dir=tempfile.mkdtemp(dir=work),
                                           eager_warmup_budget_s=0.0)  # a check, not timed
        for ref in refs.values():
            assert engine.load_adapter(ref, wait=True) == "ready"
        for i, (p, n) in enumerate(zip(prompts, names)):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                               refs[n] if n else None)
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = list(o.output_token_ids)
        snap = engine.spec.snapshot() if engine.spec is not None else {}
        kv = engine.kv_cache
        free = kv.num_free_blocks == kv.num_blocks
        runner = getattr(getattr(engine.spec, "proposer", None), "runner", None)
        if runner is not None:
            free = free and runner.kv.num_free_blocks == runner.kv.num_blocks
        engine.close()
        return outs, snap, free

    want, _, _ = run(None)
    got, snap, free = run(spec)
    return dict(case=f"lossless {label}", ok=bool(got == want and free and snap.get("proposed", 0) > 0),
                identical=got == want, kv_free=free, proposed=snap.get("proposed"), accepted=snap.get("accepted"),
                graph_steps=snap.get("graph_steps"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--families", default="llama,qwen3_moe")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="spec-drafts-")
    try:
        results = _run_families(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if args.device == "cuda" else args.device)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "check_spec_drafts_gpu.json"), "w", encoding="utf-8") as f:
            json.dump(dict(env=env, results=results), f, indent=1)
    return 0 if all(c["ok"] for c in results) else 1


def _run_families(args, work: str) -> list[dict]:
    """Every case of every family in ``args.families``, its checkpoints and adapters written under ``work``."""
    from loraplex.engine.spec_decode.eagle_head import EagleHead, EagleHeadConfig, save_eagle_head
    from loraplex.engine.testing.eagle3 import write_random_eagle3
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    results = []
    for family in args.families.split(","):
        target = make_tiny_checkpoint(family, os.path.join(work, f"{family}-target"))
        draft = _perturbed(target, os.path.join(work, f"{family}-draft"))
        target_loras = {n: _peft(target, os.path.join(work, f"{family}-t{n}"), r, s)
                        for n, r, s in (("a", 4, 1), ("b", 8, 2))}
        draft_loras = {n: _peft(draft, os.path.join(work, f"{family}-d{n}"), r, s)
                       for n, r, s in (("a", 4, 5), ("b", 8, 6))}
        torch.manual_seed(0)
        head = save_eagle_head(EagleHead(EagleHeadConfig(72, 64)), os.path.join(work, f"{family}-head"))
        cases = [check_proposals(draft, draft_loras, args.device)]
        per_adapter = dict(method="draft", draft_model=draft, num_speculative_tokens=K, draft_max_lora_rank=8,
                           draft_adapters={"t/a/1": draft_loras["a"]})
        cases.append(check_lossless(target, target_loras, per_adapter, "per-adapter drafts, eager verify",
                                    args.device, work))
        cases.append(check_lossless(target, target_loras, dict(per_adapter, verify_cuda_graphs=True),
                                    "per-adapter drafts, verify graphs", args.device, work))
        cases.append(check_lossless(target, target_loras, dict(method="eagle", draft_head=head,
                                                               num_speculative_tokens=K),
                                    "EAGLE head", args.device, work))
        eagle3 = dict(method="eagle3", num_speculative_tokens=K,
                      draft_head=write_random_eagle3(os.path.join(work, f"{family}-eagle3"), [0, 1, 2]))
        cases.append(check_lossless(target, target_loras, eagle3, "EAGLE-3 draft, eager", args.device, work))
        cases.append(check_lossless(target, target_loras, dict(eagle3, verify_cuda_graphs=True),
                                    "EAGLE-3 draft, verify graphs", args.device, work))
        for c in cases:
            c["family"] = family
            print(f"{'PASS' if c['ok'] else 'FAIL'} {family:10s} {c['case']:40s} "
                  f"{ {k: v for k, v in c.items() if k not in ('ok', 'case', 'family')} }", flush=True)
        results += cases
    return results


if __name__ == "__main__":
    sys.exit(main())
