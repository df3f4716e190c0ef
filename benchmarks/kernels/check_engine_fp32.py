"""The engine in float32 with the Triton kernels against transformers, for tiny checkpoints of all five families.

Per family: several prompts run concurrently (chunked prefill mixed with decodes), 32 greedy tokens with
ignore_eos; transformers generates the same prompts one by one in float32 with eager attention. Prints per
family: token agreement, the worst step's relative logits error (max |got - ref| / max |ref|) and PASS/FAIL.

    python3 benchmarks/kernels/check_engine_fp32.py                       # GPU, Triton kernels (dispatch auto)
    python3 benchmarks/kernels/check_engine_fp32.py --kernels reference   # GPU, torch references
    TRITON_INTERPRET=1 python3 benchmarks/kernels/check_engine_fp32.py --device cpu --force-triton \\
        --families mixtral --prompts 3 --new-tokens 8                     # CPU, Triton interpreter
    ... --tf32-interpret                                                  # interpreter rounding fp32 dots to tf32

Exit status 1 if any family's tokens differ or its logits error exceeds --tol.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3")
PROMPT_LENS = (3, 9, 14, 21, 30, 37)


def force_triton_everywhere() -> None:
    """Make dispatch pick the Triton launcher for CPU tensors too (only meaningful with TRITON_INTERPRET=1)."""
    from loraplex.kernels import dispatch, reference

    def resolve(name, tensor):
        return dispatch._load_launcher(name) or getattr(reference, name)

    dispatch.resolve = resolve


def emulate_tf32_in_interpreter() -> None:
    """Round float32 dot operands to tf32 (10 explicit mantissa bits) in the interpreter unless the dot asks for
    IEEE: reproduces on the CPU what a float32 ``tl.dot`` without ``input_precision="ieee"`` does on the GPU."""
    import numpy as np
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    original = builder_cls.create_dot

    def to_tf32(a):
        bits = a.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x1000) & 0xFFFFE000  # round half up on the 13 dropped bits
        return bits.astype(np.uint32).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        ieee = "IEEE" in str(input_precision).upper()
        if not ieee and a.data.dtype == np.float32 and b.data.dtype == np.float32:
            a = interpreter.TensorHandle(to_tf32(a.data), a.dtype)
            b = interpreter.TensorHandle(to_tf32(b.data), b.dtype)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot


def random_prompts(vocab: int, lens, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def run_engine(path: str, prompts, new_tokens: int, device: str):
    from loraplex.engine import LLMEngine, SamplingParams

    # small blocks and a 24-token budget: prompts are chunked and prefill chunks mix with decodes in one step
    engine = LLMEngine.from_pretrained(path, device=device, dtype="float32", block_size=4, num_kv_blocks=512,
                                       max_num_batched_tokens=24, max_num_seqs=8, progress=False)
    logits = defaultdict(list)
    engine.runner.logits_hook = lambda seqs, lg: [logits[s.request_id].append(lg[i].float().cpu())
                                                  for i, s in enumerate(seqs)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    tokens = [final[f"r{i}"].output_token_ids for i in range(len(prompts))]
    engine.close()
    return tokens, [logits[f"r{i}"] for i in range(len(prompts))]


def run_transformers(path: str, prompts, new_tokens: int, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None
    tokens, logits = [], []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens.append(out.sequences[0, len(p):].tolist())
        logits.append([step[0].float().cpu() for step in out.logits])
    return tokens, logits


def compare(got_tokens, got_logits, ref_tokens, ref_logits) -> tuple[int, int, float, int]:
    """(matching tokens, total tokens, worst relative logits error over steps before the first divergence
    (later steps see different inputs), prompts whose tokens all match)."""
    same = total = identical = 0
    worst = 0.0
    for gt, gl, rt, rl in zip(got_tokens, got_logits, ref_tokens, ref_logits):
        diverged = False
        identical += int(gt == rt)
        for step, (a, b) in enumerate(zip(gt, rt)):
            total += 1
            same += int(a == b)
            if not diverged:
                err = (gl[step] - rl[step]).abs().max().item() / rl[step].abs().max().item()
                worst = max(worst, err)
            diverged = diverged or a != b
    return same, total, worst, identical


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--kernels", default="auto", choices=("auto", "reference"),
                    help="LORAPLEX_KERNELS for the engine (auto: Triton on CUDA)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--prompts", type=int, default=len(PROMPT_LENS), help="concurrent prompts (<= 6)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative logits error")
    ap.add_argument("--force-triton", action="store_true", help="Triton launchers for CPU tensors (interpreter)")
    ap.add_argument("--tf32-interpret", action="store_true", help="interpreter rounds non-IEEE fp32 dots to tf32")
    args = ap.parse_args()
    os.environ["LORAPLEX_KERNELS"] = args.kernels

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # transformers' and the engine's torch matmuls: plain fp32
    torch.backends.cudnn.allow_tf32 = False
    if args.force_triton:
        force_triton_everywhere()
    if args.tf32_interpret:
        emulate_tf32_in_interpreter()
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            t0 = time.time()
            path = make_tiny_checkpoint(family, os.path.join(tmp, family))
            with open(os.path.join(path, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            prompts = random_prompts(vocab, PROMPT_LENS[:args.prompts], seed=FAMILIES.index(family))
            got_t, got_l = run_engine(path, prompts, args.new_tokens, args.device)
            ref_t, ref_l = run_transformers(path, prompts, args.new_tokens, args.device)
            same, total, worst, identical = compare(got_t, got_l, ref_t, ref_l)
            passed = same == total and worst <= args.tol  # tokens first: a flipped token fails at any error
            ok &= passed
            rows.append((family, same, total, identical, len(prompts), worst, passed, time.time() - t0))
            print(f"{family}: tokens {same}/{total}, identical prompts {identical}/{len(prompts)}, "
                  f"max rel logits err {worst:.2e} ({time.time() - t0:.1f}s)", flush=True)
    mode = f"{args.device}, kernels={args.kernels}" + (", forced Triton (interpreter)" if args.force_triton else "") \
        + (", tf32-emulated dots" if args.tf32_interpret else "")
    print(f"\nengine float32 vs transformers float32 eager ({mode}; {args.new_tokens} greedy tokens, "
          f"{args.prompts} concurrent prompts, tol {args.tol:g})")
    print("| family | tokens equal | prompts identical | max rel logits err | result |")
    print("|---|---:|---:|---:|---|")
    for family, same, total, identical, n, worst, passed, _ in rows:
        print(f"| {family} | {same}/{total} | {identical}/{n} | {worst:.2e} | {'PASS' if passed else 'FAIL'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
