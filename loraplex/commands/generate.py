"""``loraplex generate``: run prompts through the engine and print the completions."""
from __future__ import annotations

import argparse
import os
import time


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate completions for prompts with the engine")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="folder with config.json, safetensors and tokenizer")
    src.add_argument("--tiny", metavar="FAMILY", help="build (once) and use a tiny random checkpoint of FAMILY "
                     "(gpt_oss, qwen3_moe, mixtral, llama, qwen3)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three demo prompts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--work-dir", default=os.environ.get("LORAPLEX_HOME", "var"),
                   help="where --tiny checkpoints are kept (default: ./var)")
    p.set_defaults(func=run)


def tiny_model_path(family: str, work_dir: str) -> str:
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    path = os.path.join(work_dir, "models", f"tiny-{family}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny_checkpoint(family, path)
    return path


def run(args: argparse.Namespace) -> int:
    from loraplex.engine import LLMEngine, SamplingParams

    model = args.model or tiny_model_path(args.tiny, args.work_dir)
    engine = LLMEngine.from_pretrained(model, device=args.device, dtype=args.dtype, load_format=args.load_format)
    prompts = args.prompt or ["The quick brown fox", "Once upon a time", "In a shared GPU, many adapters"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_tokens = sum(len(o.output_token_ids) for o in outputs)
    for prompt, out in zip(prompts, outputs):
        print(f"--- {prompt!r} ({len(out.output_token_ids)} tokens, {out.finish_reason})")
        print(out.text if engine.tokenizer is not None else out.output_token_ids)
    print(f"{len(prompts)} requests, {n_tokens} tokens in {elapsed:.2f} s on {engine.runner.device}")
    return 0
