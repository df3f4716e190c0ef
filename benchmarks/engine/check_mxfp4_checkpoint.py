"""GPT-OSS MXFP4 checkpoints as published, on the GPU: correctness on tiny checkpoints, then memory and load time at
GPT-OSS-20B shape.

Stage "tiny" (float32, tf32 off): two tiny GPT-OSS checkpoints in the published MXFP4 layout (single file; sharded
with an index), each served by the engine on CUDA (CUDA graphs on, ``quantization`` left "auto": the experts load
as MXFP4 codes) with two PEFT adapters (attention + experts, ranks 4 and 8, made on transformers' dequantised
model) mixed with base requests; transformers + PEFT on the GPU in float32 (the MXFP4 experts dequantised by
transformers' own loader, then upcast: ``hf_model``) score each request's tokens by one teacher-forced forward.
PASS: every request gives transformers' greedy tokens, worst relative logits error (max|d| / max|ref|) <= --tol.
Each case also reports the dtypes transformers' loader gave the dequantised experts (``hf_expert_dtypes``).
``diagnose_mxfp4_gpu.py`` bisects a failure of this stage.

Stage "20b": writes a GPT-OSS-20B-shaped MXFP4 checkpoint with random codes and scales (bf16 everything else,
``model.safetensors.index.json`` + shards of <= 5 GB, ~13.7 GB; random bytes drawn on the GPU) under --tmp, loads
it with the engine on CUDA in bf16 (2 LoRA slots of rank 32, eager) and reports ``torch.cuda.memory_allocated()``
right after the weights are in place (before the KV pool: the engine's ``weights_bytes``, which it logs, beside
it), the peak during the load (no float copy of the experts may appear: peak ~ weights), and the load's seconds
(a file just written is read from the page cache: a warm load). Then a few greedy decode steps with 2 random
adapters and a base request (finite logits; the adapters change them). The checkpoint is deleted at the end.
PASS: weights <= 14 GiB. ``--layers N`` writes N of the 24 layers only (when writing 13.7 GB is too slow) and
extrapolates the weights to 24 layers from the engine's per-layer bytes (reported as such).

    PYTHONPATH=$PWD python3 benchmarks/engine/check_mxfp4_checkpoint.py            # both stages, ~2-3 min on an H200
    PYTHONPATH=$PWD python3 benchmarks/engine/check_mxfp4_checkpoint.py --stages 20b --layers 8
    PYTHONPATH=$PWD python3 benchmarks/engine/check_mxfp4_checkpoint.py --device cpu --shape tiny   # CPU smoke run
Writes $OUT/check_mxfp4_checkpoint.json (OUT defaults to .) with every stage's result.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(ROOT)

WEIGHTS_LIMIT_GIB = 14.0
SHARD_BYTES = 5 * 10**9
FULL_LAYERS = 24
TINY_CASES = {  # stage tiny: name -> (make_tiny_mxfp4_checkpoint overrides, max_shard_size)
    "single": (dict(), None),
    "sharded": (dict(num_local_experts=4, hidden_size=96, intermediate_size=64), "40KB"),
}
TINY_ADAPTERS = ["a4", None, "a8", "a4", None, "a8"]  # stage tiny: each request's adapter (None: base)


# ---- tiny: engine vs transformers (+ PEFT), float32 on the GPU -----------------------------------------------
def make_adapter(base: str, out: str, r: int, seed: int) -> str:
    """A PEFT adapter (attention + experts, random non-zero weights) made on transformers' dequantised model."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                     init_lora_weights=False)
    get_peft_model(hf_model(base, "cpu"), cfg).save_pretrained(out)
    return out


def hf_model(path: str, device: str, adapter: str | None = None):
    """transformers (+ PEFT ``adapter``) on ``device``, every parameter float32: the float model of the checkpoint.

    ``Mxfp4Config(dequantize=True)`` decodes the experts; transformers 5.17 decodes them to bfloat16 whatever
    ``dtype`` asks (``Mxfp4Dequantize`` leaves ``convert_moe_packed_tensors`` at its bf16 default; later versions
    use the parameter's dtype), and its grouped_mm experts cast the activations to the weights' dtype, so the
    reference would run its experts in bf16 (relative logits error ~0.1). ``.float()`` upcasts those weights
    exactly: every MXFP4 value is a bf16 value."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                 quantization_config=Mxfp4Config(dequantize=True)).float()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.to(device).eval()


def hf_expert_dtypes(path: str) -> list[str]:
    """The dtypes transformers' own loader gives the dequantised experts of ``path`` (asked for float32)."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    return sorted({str(p.dtype).removeprefix("torch.") for p in model.model.layers[0].mlp.experts.parameters()})


def tiny_requests(seed: int = 0) -> list[tuple[str, str | None, list[int]]]:
    """Stage tiny's requests: (request id, adapter name or None, prompt of 3..19 random ids)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [(f"r{i}", name, torch.randint(3, 300, (int(torch.randint(3, 20, (1,), generator=gen)),),
                                          generator=gen).tolist()) for i, name in enumerate(TINY_ADAPTERS)]


def stage_tiny(args) -> dict:
    import torch

    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.lora.ref import AdapterRef
    from loraplex.engine.quantization import Mxfp4FusedExperts
    from loraplex.engine.testing.tiny import make_tiny_mxfp4_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for case, (overrides, shard) in TINY_CASES.items():
            base = make_tiny_mxfp4_checkpoint(os.path.join(tmp, case), max_shard_size=shard, **overrides)
            folders = {"a4": make_adapter(base, os.path.join(tmp, f"{case}-a4"), 4, 1),
                       "a8": make_adapter(base, os.path.join(tmp, f"{case}-a8"), 8, 2)}
            engine = LLMEngine.from_pretrained(base, device=args.device, dtype="float32", block_size=4,
                                               max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=512,
                                               progress=False, enable_lora=True, max_loras=2, max_lora_rank=8,
                                               adapter_cache_dir=os.path.join(tmp, f"cache-{case}"))
            mxfp4 = all(isinstance(getattr(layer.mlp.experts, "base", layer.mlp.experts), Mxfp4FusedExperts)
                        for layer in engine.runner.model.model.layers)  # the LoRA wrappers' bases
            logits: dict[str, list] = {}
            engine.runner.logits_hook = lambda seqs, lg: [logits.setdefault(s.request_id, []).append(
                lg[j].float().cpu()) for j, s in enumerate(seqs)]
            requests = tiny_requests()
            for rid, name, prompt in requests:
                engine.add_request(rid, prompt, SamplingParams(max_tokens=args.new_tokens, temperature=0.0,
                                                               ignore_eos=True),
                                   adapter=AdapterRef(f"t/{name}/1", f"file://{folders[name]}") if name else None)
            final = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = list(out.output_token_ids)
            graphs = engine.runner.decode_graphs.num_steps if engine.runner.decode_graphs is not None else 0
            del engine
            models, agree, worst = {}, 0, 0.0
            for rid, name, prompt in requests:
                if name not in models:
                    models[name] = hf_model(base, args.device, folders[name] if name else None)
                tokens = final[rid]
                ids = torch.tensor([prompt + tokens[:-1]], device=args.device)
                with torch.no_grad():
                    ref = models[name](input_ids=ids).logits[0, len(prompt) - 1:].float().cpu()
                agree += ref.argmax(-1).tolist() == tokens
                g = torch.stack(logits[rid])
                worst = max(worst, ((g - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item())
            del models
            rows.append(dict(case=case, mxfp4_experts=mxfp4, requests=len(requests), hf_greedy_agree=agree,
                             worst_rel_err_vs_hf=worst, graph_replays=graphs, hf_expert_dtypes=hf_expert_dtypes(base)))
    ok = all(r["mxfp4_experts"] and r["hf_greedy_agree"] == r["requests"] and r["worst_rel_err_vs_hf"] <= args.tol
             for r in rows)
    return dict(stage="tiny", ok=ok, cases=rows)


# ---- 20b: write a GPT-OSS-20B-shaped MXFP4 checkpoint, load it, decode ----------------------------------------
def checkpoint_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a published GPT-OSS MXFP4 checkpoint of ``cfg``: name -> (shape, "u8" | "bf16" | "norm")."""
    h, i, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    q, kv, v = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"], \
        cfg["vocab_size"]
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((v, h), "bf16")}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out.update({
            f"{p}.input_layernorm.weight": ((h,), "norm"), f"{p}.post_attention_layernorm.weight": ((h,), "norm"),
            f"{p}.self_attn.q_proj.weight": ((q, h), "bf16"), f"{p}.self_attn.q_proj.bias": ((q,), "bf16"),
            f"{p}.self_attn.k_proj.weight": ((kv, h), "bf16"), f"{p}.self_attn.k_proj.bias": ((kv,), "bf16"),
            f"{p}.self_attn.v_proj.weight": ((kv, h), "bf16"), f"{p}.self_attn.v_proj.bias": ((kv,), "bf16"),
            f"{p}.self_attn.o_proj.weight": ((h, q), "bf16"), f"{p}.self_attn.o_proj.bias": ((h,), "bf16"),
            f"{p}.self_attn.sinks": ((cfg["num_attention_heads"],), "bf16"),
            f"{p}.mlp.router.weight": ((e, h), "bf16"), f"{p}.mlp.router.bias": ((e,), "bf16"),
            f"{p}.mlp.experts.gate_up_proj_blocks": ((e, 2 * i, h // 32, 16), "u8"),
            f"{p}.mlp.experts.gate_up_proj_scales": ((e, 2 * i, h // 32), "scale"),
            f"{p}.mlp.experts.gate_up_proj_bias": ((e, 2 * i), "bf16"),
            f"{p}.mlp.experts.down_proj_blocks": ((e, h, i // 32, 16), "u8"),
            f"{p}.mlp.experts.down_proj_scales": ((e, h, i // 32), "scale"),
            f"{p}.mlp.experts.down_proj_bias": ((e, h), "bf16"),
        })
    out["model.norm.weight"] = ((h,), "norm")
    out["lm_head.weight"] = ((v, h), "bf16")
    return out


def write_random_checkpoint(folder: str, cfg: dict, device: str) -> tuple[int, float]:
    """config.json (with ``quantization_config``) and random tensors in <= 5 GB shards + index; returns (bytes
    written, seconds). Codes uniform over the 256 bytes; scales 2^-7 / 2^-8 (weights of std ~ 1/sqrt(2880));
    bf16 matrices N(0, 0.02); norms 1."""
    import torch
    from safetensors.torch import save_file

    from loraplex.engine.testing.tiny import MXFP4_QUANTIZATION_CONFIG

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**cfg, "quantization_config": MXFP4_QUANTIZATION_CONFIG}, f, indent=1)
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = checkpoint_shapes(cfg)
    plan: list[list[str]] = [[]]
    size = 0
    for name, (shape, kind) in shapes.items():
        n = torch.Size(shape).numel() * (1 if kind in ("u8", "scale") else 2)
        if plan[-1] and size + n > SHARD_BYTES:
            plan.append([])
            size = 0
        plan[-1].append(name)
        size += n
    start, total, weight_map = time.perf_counter(), 0, {}
    for k, names in enumerate(plan):
        tensors = {}
        for name in names:
            shape, kind = shapes[name]
            if kind == "u8":
                t = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
            elif kind == "scale":
                t = torch.randint(119, 121, shape, dtype=torch.uint8, device=device, generator=gen)
            elif kind == "norm":
                t = torch.ones(shape, dtype=torch.bfloat16, device=device)
            else:
                t = (torch.randn(shape, device=device, generator=gen) * 0.02).to(torch.bfloat16)
            tensors[name] = t.cpu()
            total += tensors[name].numel() * tensors[name].element_size()
        fname = f"model-{k:05d}-of-{len(plan) - 1:05d}.safetensors"  # the published naming (0-based)
        save_file(tensors, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in names})
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, time.perf_counter() - start


def layer_bytes(model) -> int:
    """Bytes of decoder layer 0's own tensors (not the rope table every layer shares)."""
    shared = {t.untyped_storage().data_ptr() for t in model.rotary.buffers()}
    tensors = [*model.model.layers[0].parameters(), *model.model.layers[0].buffers()]
    own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in own.items() if ptr not in shared)


def stage_20b(args) -> dict:
    import torch

    import loraplex.engine.model_runner as model_runner
    from loraplex.bench.workload import GPT_OSS_20B, GPT_OSS_TINY, write_random_adapters
    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.lora.ref import AdapterRef
    from loraplex.engine.quantization import Mxfp4FusedExperts

    full = GPT_OSS_20B if args.shape == "20b" else GPT_OSS_TINY
    layers = args.layers or full["num_hidden_layers"]
    cfg = dict(full, num_hidden_layers=layers, layer_types=full["layer_types"][:layers])
    cuda = args.device == "cuda"
    tmp = tempfile.mkdtemp(prefix="mxfp4-20b-", dir=args.tmp)
    try:
        folder = os.path.join(tmp, "gpt-oss-20b-mxfp4")
        written, write_s = write_random_checkpoint(folder, cfg, args.device)
        adapters = write_random_adapters(os.path.join(tmp, "adapters"), cfg, num=2, rank=args.rank,
                                         device=args.device)
        seen: dict = {}
        size_pool = model_runner.ModelRunner._size_kv_pool

        def at_pool_sizing(self, *a):  # weights loaded (and converted), nothing else allocated yet
            if cuda:
                torch.cuda.synchronize()
            seen.update(t=time.perf_counter(), allocated=torch.cuda.memory_allocated() if cuda else None,
                        peak=torch.cuda.max_memory_allocated() if cuda else None,
                        layer_bytes=layer_bytes(self.model), weights=self.weights_bytes,
                        mxfp4=all(isinstance(layer.mlp.experts, Mxfp4FusedExperts)
                                  for layer in self.model.model.layers))
            return size_pool(self, *a)

        model_runner.ModelRunner._size_kv_pool = at_pool_sizing
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        try:
            engine = LLMEngine.from_pretrained(folder, device=args.device, dtype="bfloat16", enable_lora=True,
                                               max_loras=2, max_lora_rank=args.rank, num_kv_blocks=256,
                                               block_size=16, max_model_len=1024, max_num_seqs=4,
                                               max_num_batched_tokens=512,
                                               enforce_eager=True, progress=False,
                                               adapter_cache_dir=os.path.join(tmp, "cache"))
        finally:
            model_runner.ModelRunner._size_kv_pool = size_pool
        load_s = seen["t"] - t0
        logits: dict[str, list] = {}
        engine.runner.logits_hook = lambda seqs, lg: [logits.setdefault(s.request_id, []).append(
            lg[j].float().cpu()) for j, s in enumerate(seqs)]
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(10, cfg["vocab_size"], (args.prompt_len,), generator=gen).tolist()
        refs = [AdapterRef(f"t/a{k}/1", f"file://{f}") for k, f in enumerate(adapters)]
        for rid, ref in (("a0", refs[0]), ("a1", refs[1]), ("base", None)):  # one prompt: the adapters differ
            engine.add_request(rid, prompt, SamplingParams(max_tokens=args.decode_steps, temperature=0.0,
                                                           ignore_eos=True), adapter=ref)
        final, t1 = {}, time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = list(out.output_token_ids)
        decode_s = time.perf_counter() - t1
        first = {rid: rows[0] for rid, rows in logits.items()}
        finite = all(torch.isfinite(torch.stack(rows)).all().item() for rows in logits.values())
        adapters_matter = all(not torch.allclose(first[a], first["base"], atol=1e-3) for a in ("a0", "a1"))
        gib = 2 ** 30
        weights = seen["allocated"] - before if cuda else seen["weights"]
        full_layers = full["num_hidden_layers"]
        extrapolated = weights + (full_layers - layers) * seen["layer_bytes"]
        del engine
        res = dict(stage="20b", shape=args.shape, layers_written=layers, layers_full=full_layers,
                   checkpoint_gb=round(written / 1e9, 2), write_s=round(write_s, 1),
                   write_gb_per_s=round(written / 1e9 / write_s, 2), load_s=round(load_s, 1),
                   weights_allocated_gib=round(weights / gib, 3), engine_weights_gib=round(seen["weights"] / gib, 3),
                   peak_during_load_gib=round((seen["peak"] - before) / gib, 3) if cuda else None,
                   per_layer_gib=round(seen["layer_bytes"] / gib, 4),
                   weights_full_model_gib=round(extrapolated / gib, 3), extrapolated=layers != full_layers,
                   mxfp4_experts=seen["mxfp4"], decode_tokens={k: len(v) for k, v in final.items()},
                   decode_s=round(decode_s, 2), finite_logits=finite, adapters_change_logits=adapters_matter)
        res["ok"] = bool(seen["mxfp4"] and finite and adapters_matter and all(
            len(v) == args.decode_steps for v in final.values())
            and (args.shape != "20b" or extrapolated / gib <= WEIGHTS_LIMIT_GIB))
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default="tiny,20b", help="comma list of: tiny, 20b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=("20b", "tiny"), default="20b", help="stage 20b's model shape (tiny: smoke)")
    p.add_argument("--layers", type=int, default=None, help="stage 20b: write this many layers and extrapolate")
    p.add_argument("--rank", type=int, default=32, help="stage 20b: LoRA rank of the two random adapters")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24, help="stage tiny: tokens per request")
    p.add_argument("--tol", type=float, default=1e-4, help="stage tiny: worst relative logits error")
    p.add_argument("--tmp", default="/tmp", help="where the checkpoints are written (deleted at the end)")
    args = p.parse_args()
    stages = {"tiny": stage_tiny, "20b": stage_20b}
    results = []
    for name in args.stages.split(","):
        t = time.perf_counter()
        try:
            res = stages[name](args)
        except Exception as e:  # noqa: BLE001 - one stage's failure is reported, the others still run
            traceback.print_exc()
            res = dict(stage=name, ok=False, error=f"{type(e).__name__}: {e}")
        res["stage_s"] = round(time.perf_counter() - t, 1)
        results.append(res)
        print(json.dumps(res), flush=True)
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "check_mxfp4_checkpoint.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    print(f"\n{'stage':<8}{'ok':<6}summary")
    for r in results:
        if r["stage"] == "tiny" and "cases" in r:
            summary = "; ".join(f"{c['case']}: {c['hf_greedy_agree']}/{c['requests']} greedy = HF, worst rel err "
                                f"{c['worst_rel_err_vs_hf']:.1e} (HF loads its experts as "
                                f"{'/'.join(c['hf_expert_dtypes'])})" for c in r["cases"])
        elif r["stage"] == "20b" and "load_s" in r:
            summary = (f"weights {r['weights_allocated_gib']:.2f} GiB allocated ({r['layers_written']} layers; "
                       f"{r['layers_full']} layers: {r['weights_full_model_gib']:.2f} GiB"
                       f"{', extrapolated' if r['extrapolated'] else ''}), peak during load "
                       f"{r['peak_during_load_gib']} GiB, load {r['load_s']} s, write {r['checkpoint_gb']} GB in "
                       f"{r['write_s']} s, decode {r['decode_tokens']} in {r['decode_s']} s")
        else:
            summary = r.get("error", "")
        print(f"{r['stage']:<8}{'PASS' if r['ok'] else 'FAIL':<6}{summary}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
