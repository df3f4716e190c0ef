"""Step time on CPU of a small model: base-only batches vs batches mixing 8 LoRA adapters.

    python3 benchmarks/engine/bench_lora_cpu.py                       # qwen3_moe, 16 requests, 8 adapters
    python3 benchmarks/engine/bench_lora_cpu.py --family llama --batch 8 --prompt-len 32

Builds a small random checkpoint (transformers) and real PEFT adapters (attention + experts, or attention +
gate/up/down on dense families; ranks alternate 8 and 16), then times ``ModelRunner.execute`` per step through
the engine in three setups:

    base, LoRA off      enable_lora=False
    base, LoRA on       enable_lora=True, every request without adapter (the step skips all LoRA work)
    8 adapters          enable_lora=True, request i uses adapter i % 8 (all resident before timing)

Prints one table: median prefill-step and decode-step time (ms; best of --repeats runs) and decode tokens/s.
GPU numbers belong to the performance benchmarks; the CPU path runs the torch reference kernels.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

SMALL = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
             intermediate_size=512, vocab_size=1024, max_position_embeddings=1024)
SMALL_MOE = dict(moe_intermediate_size=128, num_experts=8, num_local_experts=8, num_experts_per_tok=2)
MOE = ("gpt_oss", "qwen3_moe", "mixtral")


def small_overrides(family: str) -> dict:
    kw = dict(SMALL)
    if family in MOE:
        kw.update(SMALL_MOE)
        kw.pop("num_experts" if family != "qwen3_moe" else "num_local_experts")
        if family != "qwen3_moe":
            kw.pop("moe_intermediate_size")
            kw["intermediate_size"] = 128
        else:
            kw["mlp_only_layers"] = []
        if family == "gpt_oss":
            kw["layer_types"] = ["sliding_attention", "full_attention"] * (kw["num_hidden_layers"] // 2)
            del kw["vocab_size"]  # the harmony tokenizer has exactly the tiny corpus's ids: the tiny default
    return kw


def make_adapters(base: str, family: str, out_dir: str, n: int) -> list[str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    folders = []
    for i in range(n):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        torch.manual_seed(i)
        moe = family in MOE
        cfg = LoraConfig(r=8 if i % 2 == 0 else 16, lora_alpha=16,
                         target_modules=attn + ([] if moe else ["gate_proj", "up_proj", "down_proj"]),
                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else None,
                         init_lora_weights=False)
        folder = os.path.join(out_dir, f"adapter{i}")
        get_peft_model(model, cfg).save_pretrained(folder)
        folders.append(folder)
    return folders


def run(base: str, folders: list[str] | None, lora_on: bool, args) -> dict[str, float]:
    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.lora.ref import AdapterRef

    kw = dict(device="cpu", dtype="float32", block_size=16, max_num_seqs=args.batch,
              max_num_batched_tokens=args.max_batched_tokens, progress=False, enable_prefix_caching=False)
    if lora_on:
        kw.update(enable_lora=True, max_loras=8, max_lora_rank=16, max_cpu_loras=8,
                  adapter_cache_dir=os.path.join(args.tmp, "cache"))
    engine = LLMEngine.from_pretrained(base, **kw)
    refs = [AdapterRef(f"bench/a{i}/1", f"file://{f}") for i, f in enumerate(folders or [])]
    for ref in refs:
        assert engine.load_adapter(ref, wait=True) == "ready", engine.adapters.error(ref)
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    execute = engine.runner.execute

    def timed(out, sampling, lora_slots=None):
        t0 = time.perf_counter()
        result = execute(out, sampling, lora_slots=lora_slots)
        kind = "decode" if all(not s.is_prefill_chunk for s in out.scheduled) else "prefill"
        times[kind].append(time.perf_counter() - t0)
        return result

    engine.runner.execute = timed
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for i, ref in enumerate(refs or [None]):  # warm-up: one short request per adapter, not timed
        engine.add_request(f"warm{i}", [1, 2, 3, 4], SamplingParams(max_tokens=2), adapter=ref)
    while engine.has_unfinished_requests():
        engine.step()
    best = {"prefill_ms": float("inf"), "decode_ms": float("inf")}
    for rep in range(args.repeats):  # the best of a few runs: shared CPUs are noisy
        for samples in times.values():
            samples.clear()
        for i in range(args.batch):
            prompt = torch.randint(0, engine.model_config.vocab_size, (args.prompt_len,), generator=gen).tolist()
            engine.add_request(f"r{rep}-{i}", prompt, params, adapter=refs[i % len(refs)] if refs else None)
        while engine.has_unfinished_requests():
            engine.step()
        best["prefill_ms"] = min(best["prefill_ms"], 1e3 * statistics.median(times["prefill"]))
        best["decode_ms"] = min(best["decode_ms"], 1e3 * statistics.median(times["decode"]))
    best["tok_s"] = args.batch / best["decode_ms"] * 1e3
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="qwen3_moe", choices=["gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen3"])
    p.add_argument("--batch", type=int, default=16, help="concurrent requests")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setup; the best median is shown")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        base = make_tiny_checkpoint(args.family, os.path.join(tmp, "base"), **small_overrides(args.family))
        folders = make_adapters(base, args.family, tmp, 8)
        rows = [("base, LoRA off", run(base, None, False, args)),
                ("base, LoRA on", run(base, None, True, args)),
                ("8 adapters (r 8/16)", run(base, folders, True, args))]
    print(f"\n{args.family}: H={SMALL['hidden_size']}, {SMALL['num_hidden_layers']} layers, batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, {torch.get_num_threads()} threads, CPU float32")
    print(f"{'setup':<22}{'prefill step ms':>17}{'decode step ms':>16}{'decode tok/s':>14}")
    for name, r in rows:
        print(f"{name:<22}{r['prefill_ms']:>17.1f}{r['decode_ms']:>16.1f}{r['tok_s']:>14.1f}")


if __name__ == "__main__":
    main()
