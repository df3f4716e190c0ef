"""Acceptance length of speculative decoding for an adapter's requests with the shared draft vs a per-adapter draft
LoRA, on tiny models trained here on the CPU (the synthetic Markov chains of ``train_tiny.py``).

    target        tiny llama (2 layers, hidden 72) trained on chain 0 (the base data)
    target LoRA   r8 on chain 1 (the shifted data): the tenant's adapter, "t/shift/1"
    draft         a smaller llama (1 layer, hidden 48, same tokenizer) trained on chain 0
    draft LoRA    r8 of the draft on chain 1: the adapter's draft LoRA
    EAGLE head    a draft head (engine/spec_decode/eagle_head.py) on the target's hidden states of chain 0
    adapter head  one on the target's hidden states under its LoRA, of chain 1: the adapter's own head

Then one engine run per (temperature, k, draft) with the adapter's requests (prompts from chain 1) and base
requests (prompts from chain 0) in the same steps: mean acceptance length per adapter from the engine's spec
counters (``(accepted + verified) / verified``), (a) with the shared draft for everyone, (b) with the draft LoRA
registered for the adapter; (c) with the EAGLE head for everyone (method "eagle"); (d) with the adapter's own head
for its requests (``draft_heads``). Greedy (temperature 0): every speculative run's tokens are checked against a
non-speculative run (lossless). Temperature 1: seeded requests, rejection sampling (drafts drawn from the draft's
distribution; acceptance then measures how far the two distributions overlap, not only their argmax).

    OMP_NUM_THREADS=1 python3 benchmarks/engine/spec_acceptance.py --out /tmp/spec-acc \\
        --json benchmarks/results/spec-acceptance-llama-tiny-fp32-DATE.json        # about 2 min on one CPU thread
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)
_spec = importlib.util.spec_from_file_location("train_tiny", os.path.join(ROOT, "benchmarks", "engine",
                                                                          "train_tiny.py"))
train_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_tiny)

ADAPTER_ID = "t/shift/1"
RANK = 8
DRAFT_CONFIG = dict(num_hidden_layers=1, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                    intermediate_size=32)


def train_models(out: str, *, steps: int, batch: int, seq_len: int, head_steps: int) -> dict:
    """Target, target LoRA, draft, draft LoRA under ``out`` (module docstring); returns paths, chains, stats."""
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    target = make_tiny_checkpoint("llama", os.path.join(out, "target"))
    draft = make_tiny_checkpoint("llama", os.path.join(out, "draft"), seed=1, **DRAFT_CONFIG)
    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    base_chain, shifted = train_tiny.make_chain(vocab, 0), train_tiny.make_chain(vocab, 1)
    kw = dict(steps=steps, batch=batch, seq_len=seq_len, device="cpu", log_every=max(1, steps // 4))
    paths = dict(target=target, draft=draft, target_lora=os.path.join(out, "target-lora"),
                 draft_lora=os.path.join(out, "draft-lora"))
    stats = {"target": train_tiny.train_base(target, base_chain, **kw),
             "draft": train_tiny.train_base(draft, base_chain, seed=1, **kw)}
    stats["target_lora"] = train_tiny.train_adapter(target, paths["target_lora"], shifted, RANK, seed=2, **kw)
    stats["draft_lora"] = train_tiny.train_adapter(draft, paths["draft_lora"], shifted, RANK, seed=3, **kw)
    if head_steps:
        from loraplex.engine.spec_decode.eagle_head import save_eagle_head

        head, stats["eagle_head"] = train_eagle_head(target, lambda n, length, g: base_chain.sample(n, length, g),
                                                     steps=head_steps, batch=batch, seq_len=seq_len, seed=4,
                                                     log_every=kw["log_every"])
        paths["eagle_head"] = save_eagle_head(head, os.path.join(out, "eagle-head"))
        head, stats["eagle_head_adapter"] = train_eagle_head(target, lambda n, length, g: shifted.sample(n, length, g),
                                                             steps=head_steps, batch=batch, seq_len=seq_len, seed=5,
                                                             log_every=kw["log_every"], adapter=paths["target_lora"])
        paths["eagle_head_adapter"] = save_eagle_head(head, os.path.join(out, "eagle-head-adapter"))
    return dict(paths=paths, chains=(base_chain, shifted), stats=stats)


def train_eagle_head(target: str, sample, *, steps: int, batch: int, seq_len: int, intermediate_size: int = 128,
                     lr: float = 3e-3, seed: int = 0, log_every: int = 0, adapter: str | None = None):
    """An ``EagleHead`` for the checkpoint at ``target`` (engine/spec_decode/eagle_head.py): one-step training on the
    target's own final hidden states of ``sample(batch, seq_len, generator)`` token batches: from f_t and the token
    at t + 1 predict f_{t+1} (smooth L1) and the target's next-token distribution there (KL to the target's).
    ``adapter``: a PEFT folder; the hidden states are then the target's under that LoRA (a per-adapter head)."""
    from transformers import AutoModelForCausalLM

    from loraplex.engine.spec_decode.eagle_head import EagleHead, EagleHeadConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager").eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval().base_model.model  # LoRA layers in place
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = model.config
    head = EagleHead(EagleHeadConfig(cfg.hidden_size, intermediate_size, cfg.rms_norm_eps))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.1, 1 - s / steps))
    gen = torch.Generator().manual_seed(seed)
    loss = torch.tensor(0.0)
    t0 = time.perf_counter()
    for step in range(steps):
        ids = sample(batch, seq_len, gen)
        with torch.no_grad():
            feats = model.model(input_ids=ids).last_hidden_state          # [B, L, H], post-norm
            emb = model.model.embed_tokens(ids)
            want = model.lm_head(feats[:, 1:-1]).log_softmax(-1)
        pred = head(feats[:, :-2], emb[:, 1:-1])                          # f'_{t+1}, t = 0 .. L-3
        got = model.lm_head(pred).log_softmax(-1)
        loss = (torch.nn.functional.smooth_l1_loss(pred, feats[:, 1:-1])
                + torch.nn.functional.kl_div(got, want, log_target=True, reduction="batchmean") / (seq_len - 2))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  [eagle head] step {step:4d} loss {loss.item():.3f}", flush=True)
    return head.eval(), dict(steps=steps, loss_after=round(float(loss.detach()), 4),
                             train_s=round(time.perf_counter() - t0, 1))


def workload(chains, *, num_adapter: int, num_base: int, prompt_len: int, max_tokens: int, seed: int = 0) -> list:
    """(request id, prompt, adapter?) with prompts drawn from the adapter's chain / the base chain."""
    base_chain, shifted = chains
    g = torch.Generator().manual_seed(seed)
    reqs = [(f"a{i}", p.tolist(), True) for i, p in enumerate(shifted.sample(num_adapter, prompt_len, g))]
    reqs += [(f"b{i}", p.tolist(), False) for i, p in enumerate(base_chain.sample(num_base, prompt_len, g))]
    return reqs


def run_engine(paths: dict, reqs: list, *, max_tokens: int, spec: dict | None, cache_dir: str,
               temperature: float = 0.0) -> tuple[dict, dict]:
    """Greedy outputs {request id: tokens} and the engine's spec snapshot (None without speculation)."""
    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.lora.ref import AdapterRef

    engine = LLMEngine.from_pretrained(paths["target"], device="cpu", dtype="float32", block_size=16, max_num_seqs=16,
                                       max_num_batched_tokens=512, enable_lora=True, max_loras=2,
                                       max_lora_rank=RANK, adapter_cache_dir=cache_dir, progress=False,
                                       speculative=spec)
    ref = AdapterRef(ADAPTER_ID, f"file://{paths['target_lora']}")
    assert engine.load_adapter(ref, wait=True) == "ready"
    for i, (rid, prompt, adapted) in enumerate(reqs):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                seed=i if temperature > 0 else None)
        engine.add_request(rid, prompt, params, ref if adapted else None)
    outs: dict = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.output_token_ids)
    wall = time.perf_counter() - t0
    snap = engine.spec.snapshot() if engine.spec is not None else None
    if snap is not None:
        snap["wall_s"] = wall
    engine.close()
    return outs, snap


def _row(snap: dict, adapter: str | None) -> dict:
    r = next((r for r in snap["adapters"] if r["adapter"] == adapter), None)
    if r is None:
        return {}
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "adapter"}


def measure(paths: dict, chains, *, ks: list[int], temperatures: list[float], num_adapter: int, num_base: int,
            prompt_len: int, max_tokens: int, cache_dir: str) -> dict:
    reqs = workload(chains, num_adapter=num_adapter, num_base=num_base, prompt_len=prompt_len, max_tokens=max_tokens)
    want, _ = run_engine(paths, reqs, max_tokens=max_tokens, spec=None, cache_dir=cache_dir)
    rows = []
    variants = [("shared draft", dict(method="draft", draft_model=paths["draft"])),
                ("per-adapter draft LoRA", dict(method="draft", draft_model=paths["draft"],
                                                draft_adapters={ADAPTER_ID: paths["draft_lora"]},
                                                draft_max_lora_rank=RANK))]
    if "eagle_head" in paths:
        variants.append(("EAGLE head", dict(method="eagle", draft_head=paths["eagle_head"])))
        variants.append(("per-adapter EAGLE head", dict(method="eagle", draft_head=paths["eagle_head"],
                                                         draft_heads={ADAPTER_ID: paths["eagle_head_adapter"]})))
    for temperature in temperatures:
        for k in ks:
            for label, variant in variants:
                spec = dict(variant, num_speculative_tokens=k)
                got, snap = run_engine(paths, reqs, max_tokens=max_tokens, spec=spec, cache_dir=cache_dir,
                                       temperature=temperature)
                greedy = temperature == 0
                if greedy and got != want:
                    raise AssertionError(f"k={k} {label}: speculative output differs from non-speculative greedy")
                row = dict(temperature=temperature, k=k, draft=label, adapter=_row(snap, ADAPTER_ID),
                           base=_row(snap, None), lossless_checked=greedy, wall_s=round(snap["wall_s"], 2))
                rows.append(row)
                print(f"T={temperature:g} k={k} {label:26s} adapter acceptance length "
                      f"{row['adapter']['acceptance_length']:.2f}  base {row['base']['acceptance_length']:.2f}",
                      flush=True)
    return dict(requests=dict(adapter=num_adapter, base=num_base, prompt_len=prompt_len, max_tokens=max_tokens),
                rows=rows)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the trained models")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--steps", type=int, default=300, help="training steps of each of the four models")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--head-steps", type=int, default=300, help="EAGLE head training steps (0: no EAGLE rows)")
    p.add_argument("--k", default="3,4", help="draft tokens per step, comma-separated")
    p.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy (checked lossless)")
    p.add_argument("--adapter-requests", type=int, default=8)
    p.add_argument("--base-requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    trained = train_models(args.out, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                           head_steps=args.head_steps)
    train_s = time.perf_counter() - t0
    res = measure(trained["paths"], trained["chains"], ks=[int(k) for k in args.k.split(",")],
                  temperatures=[float(t) for t in args.temperatures.split(",")],
                  num_adapter=args.adapter_requests, num_base=args.base_requests, prompt_len=args.prompt_len,
                  max_tokens=args.max_tokens, cache_dir=os.path.join(args.out, "adapter-cache"))
    result = dict(benchmark="spec_acceptance", command=" ".join(["python3", *sys.argv]), commit=_commit(), cpu=_cpu(),
                  threads=args.threads,
                  date=datetime.date.today().isoformat(), torch=torch.__version__,
                  models=dict(target="tiny llama, 2 layers, hidden 72, trained on chain 0",
                              target_lora=f"r{RANK} on chain 1", draft=f"tiny llama {DRAFT_CONFIG}, trained on chain 0",
                              draft_lora=f"r{RANK} of the draft on chain 1",
                              eagle_head="EagleHead (intermediate 128) on the target's hidden states of chain 0",
                              eagle_head_adapter="EagleHead (intermediate 128) on the target+LoRA's hidden states of "
                                                 "chain 1"),
                  training=dict(steps=args.steps, batch=args.batch, seq_len=args.seq_len, seconds=round(train_s, 1),
                                stats=trained["stats"]),
                  total_s=round(time.perf_counter() - t0, 1), **res)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
