"""Time of the upload-time numerical check (platform/uploads/numerical_check.py) on CPU, where the platform runs.

    PYTHONPATH=$PWD python benchmarks/engine/bench_numerical_check.py              # GPT-OSS-20B shape, rank 32
    PYTHONPATH=$PWD python benchmarks/engine/bench_numerical_check.py --tiny       # + the tests' tiny models
    OUT=/tmp/results PYTHONPATH=$PWD python benchmarks/engine/bench_numerical_check.py --rank 64 --repeat 5

Builds one adapter at the GPT-OSS-20B shape (24 layers, hidden 2880, 64 query / 8 KV heads of 64, 32 experts of
intermediate 2880) targeting attention (q/k/v/o_proj) and the fused experts (gate_up_proj, down_proj through
``target_parameters``), random bf16 weights as PEFT would save them, and a config.json of that shape (no base
weights: the check needs none). Times, per upload: the check itself (wall min and median of ``--repeat`` runs, and
the CPU seconds it used: the figure that holds on a loaded machine), and
for scale the NaN scan + sha256 pass that validation already makes over the same file; the check's peak RSS
growth. With ``--tiny`` also every family of tests/utils/tiny_models.py with real PEFT adapters (needs peft).
No GPU, no web stack. Prints a table and writes ``$OUT/bench_numerical_check.json`` (default ``.``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch

GPT_OSS_20B = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
                   num_local_experts=32, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                   rope_theta=150000.0)


def build_gpt_oss_adapter(folder: str, rank: int, seed: int = 0) -> tuple[str, int]:
    """config.json of the base shape + a PEFT-layout rank-``rank`` adapter; returns (base folder, file bytes)."""
    from safetensors.torch import save_file

    base = os.path.join(folder, "base")
    os.makedirs(base)
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump(GPT_OSS_20B, f)
    c = GPT_OSS_20B
    h, e, i = c["hidden_size"], c["num_local_experts"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        p = f"base_model.model.model.layers.{layer}"
        for name, (fan_in, fan_out) in {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv),
                                        "o_proj": (q, h)}.items():
            tensors[f"{p}.self_attn.{name}.lora_A.weight"] = rand(rank, fan_in)
            tensors[f"{p}.self_attn.{name}.lora_B.weight"] = rand(fan_out, rank)
        # PEFT nests the expert ParamWrappers: gate_up_proj (wrapped first) is the inner one
        tensors[f"{p}.mlp.experts.base_layer.lora_A.weight"] = rand(rank * e, h)
        tensors[f"{p}.mlp.experts.base_layer.lora_B.weight"] = rand(2 * i, rank * e)
        tensors[f"{p}.mlp.experts.lora_A.weight"] = rand(rank * e, i)
        tensors[f"{p}.mlp.experts.lora_B.weight"] = rand(h, rank * e)
    adapter = os.path.join(folder, "adapter")
    os.makedirs(adapter)
    save_file(tensors, os.path.join(adapter, "adapter_model.safetensors"))
    del tensors
    with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                   "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                   "base_model_name_or_path": "openai/gpt-oss-20b"}, f)
    return base, os.path.getsize(os.path.join(adapter, "adapter_model.safetensors"))


def time_check(adapter: str, base: str, repeat: int, max_rank: int) -> dict:
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.lora.format import check_adapter, parse_adapter_config, read_safetensors_header
    from loraplex.platform.uploads.numerical_check import check_conversion
    from loraplex.platform.uploads.scan import hash_and_scan

    weights = os.path.join(adapter, "adapter_model.safetensors")
    raw = open(os.path.join(adapter, "adapter_config.json"), "rb").read()
    model = ModelConfig.from_pretrained(base)
    header = read_safetensors_header(weights)
    spec = check_adapter(parse_adapter_config(raw, max_rank=max_rank), header, model, max_rank=max_rank)
    config = json.loads(raw)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, cpu, report = [], [], None
    for _ in range(repeat):
        start, cpu0 = time.perf_counter(), time.process_time()
        report = check_conversion(weights, config, header, spec, model)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu0)
    rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    start, cpu0 = time.perf_counter(), time.process_time()
    hash_and_scan(weights, header)
    scan_s, scan_cpu = time.perf_counter() - start, time.process_time() - cpu0
    return {"modules": report.modules, "comparisons": report.comparisons,
            "worst_relative_error": report.worst_relative_error, "check_s_min": min(times),
            "check_s_median": statistics.median(times), "check_cpu_s_min": min(cpu),
            "scan_sha256_s": scan_s, "scan_sha256_cpu_s": scan_cpu,
            "check_peak_rss_growth_mb": rss_growth_mb, "file_bytes": header.file_size}


def tiny_rows(repeat: int) -> list[dict]:
    sys.path.insert(0, os.getcwd())
    __import__("loraplex")  # first: transformers must find its own ``kernels``, not the checkout's kernels/
    from tests.utils.adapters import make_peft_adapter
    from tests.utils.tiny_models import FAMILIES, make_tiny_base

    rows = []
    for family in FAMILIES:
        with tempfile.TemporaryDirectory() as d:
            base = make_tiny_base(family, os.path.join(d, "base"))
            adapter = make_peft_adapter(family, os.path.join(d, "adapter"), r=4, alpha=8, base_model_name=None)
            rows.append({"shape": f"tiny {family}", "rank": 4, **time_check(adapter, base, repeat, 16)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of the check per adapter")
    ap.add_argument("--tiny", action="store_true", help="also the tests' tiny models (needs peft)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = tiny_rows(args.repeat) if args.tiny else []
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        base, size = build_gpt_oss_adapter(d, args.rank)
        print(f"built a rank-{args.rank} GPT-OSS-20B-shape adapter ({size / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        rows.append({"shape": "gpt-oss-20b attn+experts", "rank": args.rank,
                     **time_check(os.path.join(d, "adapter"), base, args.repeat, max(64, args.rank))})
    print(f"\n{'shape':26} {'rank':>4} {'MiB':>6} {'modules':>7} {'cmp':>5} {'check s min/med':>16} {'CPU s':>7} "
          f"{'scan+sha s':>10} {'RSS+ MB':>7} {'worst rel':>9}")
    for r in rows:
        print(f"{r['shape']:26} {r['rank']:>4} {r['file_bytes'] / 2**20:>6.1f} {r['modules']:>7} {r['comparisons']:>5} "
              f"{r['check_s_min']:>7.3f}/{r['check_s_median']:<8.3f} {r['check_cpu_s_min']:>7.3f} "
              f"{r['scan_sha256_s']:>10.3f} {r['check_peak_rss_growth_mb']:>7.0f} {r['worst_relative_error']:>9.1e}")
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "bench_numerical_check.json")
    with open(path, "w") as f:
        json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
