"""Briefly train a tiny checkpoint and two LoRA adapters on synthetic Markov chains, so that bf16 checks compare
peaked distributions instead of a random model's near-ties.

The language: an order-2 Markov chain over an alphabet of ``ALPHABET`` vocabulary ids. In context (a, b) the next
token is, with probability ``P_TOP``, ``perm[group(a)][b]`` (the successor of b under one of ``GROUPS`` fixed
permutations, picked by the token two back), else one of three fixed alternatives. Predicting it well needs both
previous tokens (attention to the one two back, then a lookup), and the best achievable loss is the chain's
entropy (about 0.57 nats), so a trained model is confident (top-1 near ``P_TOP``) without the task being trivial.
The base model learns chain 0; the adapters (ranks 4 and 8, the targets ``check_cuda_graphs.make_adapter`` uses)
learn chains 1 and 2 over the same alphabet, so each adapter changes the greedy output.

    python3 benchmarks/engine/train_tiny.py --family gpt_oss --out /tmp/tiny-gpt_oss --device cuda   # seconds
    OMP_NUM_THREADS=1 python3 benchmarks/engine/train_tiny.py --family llama --out /tmp/tiny-llama --device cpu \
        --steps 100 --batch 32 --seq-len 64                                # about 1-2 min per family on CPU

The checkpoint keeps the exact ``make_tiny_checkpoint`` config and tokenizer (only model.safetensors changes), so
the engine loads it as before. HF's router auxiliary loss is not added: transformers computes it only with
``output_router_logits=True``, which these configs leave at its default (False). ``router_margins`` reports how
decisive the routers are before and after training (the share of close calls between the k-th and (k+1)-th expert).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)

FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3")
MOE_FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral")
ALPHABET = 32
GROUPS = 2
P_TOP = 0.85
ALT_PROBS = (0.08, 0.05, 0.02)
ADAPTERS = {"a4": (4, 1), "a8": (8, 2)}   # name: (rank, chain seed); the base model learns chain 0
CLOSE_CALL = 0.01                          # router top-k gap under 1% of the row's max |logit|: bf16 can flip it


@dataclass(frozen=True)
class MarkovChain:
    """An order-2 chain: ``probs[a, b]`` is the next-token distribution after alphabet indices (a, b).

    tokens: (n,) vocabulary ids of the alphabet; probs: (n, n, n), rows sum to 1.
    """

    tokens: torch.Tensor
    probs: torch.Tensor

    @property
    def entropy(self) -> float:
        """Mean conditional entropy in nats over uniformly drawn contexts: about the best achievable loss."""
        p = self.probs
        return float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean())

    def sample(self, num: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """(num, length) vocabulary ids; the first two tokens are uniform over the alphabet."""
        n = self.tokens.numel()
        idx = torch.empty(num, length, dtype=torch.long)
        idx[:, :2] = torch.randint(0, n, (num, min(2, length)), generator=generator)
        for t in range(2, length):
            idx[:, t] = torch.multinomial(self.probs[idx[:, t - 2], idx[:, t - 1]], 1, generator=generator)[:, 0]
        return self.tokens[idx]


def make_chain(vocab_size: int, seed: int, *, alphabet_seed: int = 0) -> MarkovChain:
    """Chain ``seed`` over the alphabet drawn by ``alphabet_seed`` from ids [3, vocab_size) (0-2 are special)."""
    g = torch.Generator().manual_seed(alphabet_seed)
    tokens = torch.randperm(vocab_size - 3, generator=g)[:ALPHABET] + 3
    g = torch.Generator().manual_seed(1000 + seed)
    group = torch.randint(0, GROUPS, (ALPHABET,), generator=g)
    perms = torch.stack([torch.randperm(ALPHABET, generator=g) for _ in range(GROUPS)])
    probs = torch.zeros(ALPHABET, ALPHABET, ALPHABET)
    for a in range(ALPHABET):
        for b in range(ALPHABET):
            top = int(perms[group[a], b])
            rest = torch.randperm(ALPHABET - 1, generator=g)[:len(ALT_PROBS)]
            rest = rest + (rest >= top).long()   # alternatives other than the top successor
            probs[a, b, rest] = torch.tensor(ALT_PROBS)
            probs[a, b, top] = P_TOP
    return MarkovChain(tokens, probs)


def adapter_targets(model_type: str) -> tuple[list[str], list[str] | None]:
    """(target_modules, target_parameters) as ``check_cuda_graphs.make_adapter`` uses them."""
    moe = model_type in MOE_FAMILIES
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else ["gate_proj", "up_proj", "down_proj"])
    return modules, (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else None)


def router_margins(model, ids: torch.Tensor) -> dict | None:
    """The gap between the k-th and (k+1)-th router logit per token, over every MoE layer, on ``ids``:
    mean gap, mean gap relative to the row's max |logit|, and the share of close calls (< ``CLOSE_CALL``)."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        return None
    rows = []
    hooks = [r.register_forward_hook(lambda mod, args, out: rows.append((out[0].detach().float(), mod.top_k)))
             for r in routers]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    gaps, rel = [], []
    for logits, k in rows:
        top = logits.topk(k + 1, dim=-1).values
        gap = top[:, k - 1] - top[:, k]
        gaps.append(gap)
        rel.append(gap / logits.abs().amax(-1).clamp_min(1e-12))
    gap, rel_gap = torch.cat(gaps), torch.cat(rel)
    return dict(mean_gap=round(float(gap.mean()), 4), mean_rel_gap=round(float(rel_gap.mean()), 4),
                close_calls=round(float((rel_gap < CLOSE_CALL).float().mean()), 4))


def _train(model, params: list, chain: MarkovChain, *, steps: int, batch: int, seq_len: int, lr: float, seed: int,
           device: str, label: str, log_every: int) -> dict:
    """AdamW on chain samples (warm-up 20 steps, linear decay to 10%); loss on a fixed held-out batch before/after."""
    gen = torch.Generator().manual_seed(seed)
    data = chain.sample(steps * batch, seq_len, gen).view(steps, batch, seq_len)
    held_out = chain.sample(64, seq_len, gen).to(device)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=device.startswith("cuda") or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = model(input_ids=held_out, labels=held_out).loss
        model.train()
        return round(float(loss), 4)

    before = eval_loss()
    t0 = time.perf_counter()
    for step in range(steps):
        ids = data[step].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  [{label}] step {step:4d} loss {loss.item():.3f}", flush=True)
    model.eval()
    with torch.no_grad():
        top1 = model(input_ids=held_out).logits[:, 1:].float().softmax(-1).amax(-1).mean()
    return dict(loss_before=before, loss_after=eval_loss(), entropy=round(chain.entropy, 4), steps=steps,
                mean_top1_prob=round(float(top1), 4), train_s=round(time.perf_counter() - t0, 1))


def train_base(path: str, chain: MarkovChain, *, steps: int, batch: int, seq_len: int, device: str,
               lr: float = 3e-3, seed: int = 0, log_every: int = 50) -> dict:
    """Train the checkpoint at ``path`` on ``chain`` and overwrite its weights (config and tokenizer untouched)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(device)
    probe = chain.sample(64, seq_len, torch.Generator().manual_seed(seed + 7)).to(device)
    margins_before = router_margins(model.eval(), probe)
    stats = _train(model.train(), list(model.parameters()), chain, steps=steps, batch=batch, seq_len=seq_len,
                   lr=lr, seed=seed, device=device, label="base", log_every=log_every)
    stats.update(router_before=margins_before, router_after=router_margins(model, probe))
    with open(os.path.join(path, "config.json"), "rb") as f:
        config_bytes = f.read()
    model.cpu().save_pretrained(path)
    with open(os.path.join(path, "config.json"), "wb") as f:   # byte-identical: the engine loads it as before
        f.write(config_bytes)
    return stats


def train_adapter(base: str, out: str, chain: MarkovChain, rank: int, *, steps: int, batch: int, seq_len: int,
                  device: str, lr: float = 1e-2, seed: int = 0, log_every: int = 50) -> dict:
    """Train a PEFT LoRA (rank ``rank``, alpha 2·rank) of the base at ``base`` on ``chain``; save it to ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    modules, params = adapter_targets(model.config.model_type)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                             target_parameters=params)).to(device)
    stats = _train(model.train(), [p for p in model.parameters() if p.requires_grad], chain, steps=steps,
                   batch=batch, seq_len=seq_len, lr=lr, seed=seed, device=device, label=f"lora r{rank}",
                   log_every=log_every)
    model.cpu().save_pretrained(out)
    return stats


def train_tiny(family: str, out_dir: str, *, steps: int = 200, adapter_steps: int | None = None, batch: int = 64,
               seq_len: int = 128, device: str = "cpu", log_every: int = 50) -> dict:
    """A trained tiny ``family`` checkpoint in ``out_dir/<family>`` and adapters in ``out_dir/<a4|a8>``.

    Returns dict(base=path, adapters={name: path}, chains={None | name: MarkovChain}, stats={...}).
    """
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    adapter_steps = steps if adapter_steps is None else adapter_steps
    base = make_tiny_checkpoint(family, os.path.join(out_dir, family))
    with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    chains = {None: make_chain(vocab, 0), **{name: make_chain(vocab, s) for name, (_, s) in ADAPTERS.items()}}
    kw = dict(batch=batch, seq_len=seq_len, device=device, log_every=log_every)
    stats = {"base": train_base(base, chains[None], steps=steps, **kw)}
    adapters = {}
    for name, (rank, seed) in ADAPTERS.items():
        adapters[name] = os.path.join(out_dir, name)
        stats[name] = train_adapter(base, adapters[name], chains[name], rank, steps=adapter_steps, seed=seed, **kw)
    return dict(base=base, adapters=adapters, chains=chains, stats=stats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--out", required=True, help="folder for <family>/, a4/ and a8/")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--adapter-steps", type=int, default=None, help="default: --steps")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    res = train_tiny(args.family, args.out, steps=args.steps, adapter_steps=args.adapter_steps, batch=args.batch,
                     seq_len=args.seq_len, device=args.device)
    print(json.dumps(dict(base=res["base"], adapters=res["adapters"], stats=res["stats"]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
