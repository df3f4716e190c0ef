"""Multi-LoRA on the GPU against PEFT: the CPU test (tests/engine/lora/test_peft_equivalence.py) on CUDA.

Per family: tiny random checkpoint, four PEFT adapters (ranks 4, 8 rsLoRA, 16, attention-only 8), one engine
(``enable_lora=True``, float32, chunked prefill, block_size 4) mixing them with base requests; PEFT (float32,
eager, on the same device) scores each request's tokens by one teacher-forced forward. Prints per family the
share of requests whose tokens are PEFT's greedy tokens and the worst step's relative logits error.

    python3 benchmarks/engine/check_lora_gpu.py                    # Triton kernels (fp32 dots may use tf32)
    LORAPLEX_KERNELS=reference python3 benchmarks/engine/check_lora_gpu.py
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3")
ADAPTERS = {"r4": (4, 8, False, False), "r8-rslora": (8, 12, True, False), "r16": (16, 8, False, False),
            "attn-r8": (8, 16, False, True)}


def make_adapter(base: str, out: str, r: int, alpha: float, rslora: bool, attn_only: bool, seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    moe = model.config.model_type in ("gpt_oss", "qwen3_moe", "mixtral")
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    params = None
    if not attn_only:
        if moe:
            params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        else:
            modules += ["gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=modules, target_parameters=params,
                     init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


def check_family(family: str, tmp: str, args) -> tuple[int, int, float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.lora.ref import AdapterRef
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    base = make_tiny_checkpoint(family, os.path.join(tmp, family))
    folders = {n: make_adapter(base, os.path.join(tmp, f"{family}-{n}"), *spec, seed=i)
               for i, (n, spec) in enumerate(ADAPTERS.items())}
    engine = LLMEngine.from_pretrained(base, device=args.device, dtype="float32", block_size=4,
                                       max_num_batched_tokens=32, max_num_seqs=32, num_kv_blocks=1024, progress=False,
                                       enable_lora=True, max_loras=4, max_lora_rank=16,
                                       adapter_cache_dir=os.path.join(tmp, f"{family}-cache"))
    logits = defaultdict(list)
    engine.runner.logits_hook = lambda seqs, lg: [logits[s.request_id].append(lg[j].float().cpu())
                                                  for j, s in enumerate(seqs)]
    gen = torch.Generator().manual_seed(0)
    requests = []
    for i, name in enumerate([n for n in ADAPTERS for _ in range(args.prompts)] + [None] * args.prompts):
        prompt = torch.randint(0, engine.model_config.vocab_size, (int(torch.randint(6, 40, (1,), generator=gen)),),
                               generator=gen).tolist()
        requests.append((f"r{i}", name, prompt))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for rid, name, prompt in requests:
        engine.add_request(rid, prompt, params,
                           adapter=AdapterRef(f"t/{name}/1", f"file://{folders[name]}") if name else None)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    models = {}
    agree, worst = 0, 0.0
    for rid, name, prompt in requests:
        if name not in models:
            m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
            models[name] = (PeftModel.from_pretrained(m, folders[name]) if name else m).to(args.device).eval()
        tokens = final[rid].output_token_ids
        ids = torch.tensor([prompt + tokens[:-1]], device=args.device)
        with torch.no_grad():
            ref = models[name](input_ids=ids).logits[0, len(prompt) - 1:].float().cpu()
        agree += ref.argmax(-1).tolist() == tokens
        got = torch.stack(logits[rid])
        worst = max(worst, ((got - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item())
    return agree, len(requests), worst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--prompts", type=int, default=3, help="prompts per adapter (and for the base)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    failed = False
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"kernels={os.environ.get('LORAPLEX_KERNELS', 'auto')} device={name}")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            t0 = time.perf_counter()
            agree, total, worst = check_family(family, tmp, args)
            ok = agree == total and worst <= args.tol
            failed |= not ok
            print(f"{family:<10} tokens {agree}/{total} requests are PEFT's greedy  worst rel logits err "
                  f"{worst:.2e}  {'PASS' if ok else 'FAIL'}  ({time.perf_counter() - t0:.1f}s)", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
