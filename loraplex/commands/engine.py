"""``loraplex engine serve``: run one engine process behind its internal HTTP API (engine/server/app.py).

    loraplex engine serve --model /models/Qwen3-30B-A3B --port 8101 --enable-lora
    loraplex engine serve --null --port 8101          # no model: streams fixed tokens (gateway benchmarks)
    loraplex engine serve --model DIR --speculative-method ngram --num-speculative-tokens 3
    loraplex engine serve --model DIR --speculative-method draft --speculative-draft-model SMALL_DIR
    loraplex engine serve --model DIR --enable-lora --speculative-method draft --speculative-draft-model SMALL_DIR \
        --speculative-draft-adapter t/a/1=/adapters/t-a-1      # that adapter's requests draft with its draft LoRA
    loraplex engine serve --model DIR --speculative-method eagle --speculative-draft-head HEAD_DIR
    loraplex engine serve --model DIR --speculative-method eagle3 --speculative-draft-head EAGLE3_DIR   # published
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from loraplex.engine.fairness import DEFAULT_PREEMPT_GAP, check_preempt_gap


def register(subparsers) -> None:
    p = subparsers.add_parser("engine", help="engine processes (internal API for the platform's router)")
    sub = p.add_subparsers(dest="engine_command", required=True)
    s = sub.add_parser("serve", help="serve one engine over HTTP (ready on /health once the model is loaded)")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF folder with config.json, safetensors and tokenizer")
    src.add_argument("--null", action="store_true", help="no model: every request streams fixed tokens")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8100)
    s.add_argument("--model-name", default=None, help="name reported by /health (default: the folder's name)")
    s.add_argument("--device", default="auto")
    s.add_argument("--dtype", default="auto")
    s.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences per step (default: 256 on CUDA, 64 on CPU); decode graphs cover every batch size")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + output); default: the model's max_position_embeddings, capped at "
                        "8192; above max_position_embeddings it is refused")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step, the prefill chunk included (default: 4096 on CUDA, 2048 on CPU)")
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many GPUs of the host (gloo processes on CPU)")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly")
    s.add_argument("--cuda-graph-max-batch-size", type=int, default=None,
                   help="largest decode batch captured as a CUDA graph (default: max-num-seqs; larger batches run "
                        "eagerly)")
    s.add_argument("--cuda-graph-capture-budget-s", type=float, default=120.0,
                   help="start-up seconds allowed for graph capture; buckets past it are served by a larger one")
    s.add_argument("--mixed-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="steps with prefill chunks replay CUDA graphs of token buckets up to max-num-batched-tokens "
                        "(--no-mixed-cuda-graphs: they run eagerly)")
    s.add_argument("--eager-warmup-budget-s", type=float, default=90.0,
                   help="start-up seconds allowed for compiling the kernel variants of eager steps (prefill chunks, "
                        "mixed steps, LoRA slot counts) before serving; 0 = off (they compile on first use, "
                        "stalling that step)")
    s.add_argument("--quantization", choices=("auto", "none", "int8", "mxfp4"), default="auto",
                   help="expert weights: auto = as the checkpoint stores them (an MXFP4 checkpoint such as GPT-OSS "
                        "as published is served in MXFP4); none = float (an MXFP4 checkpoint is dequantised at "
                        "load); int8 (per channel) or mxfp4 (4.25 bits; hidden and expert intermediate sizes "
                        "multiples of 32) = weight-only, quantised at load")
    s.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch decode step n+1 before step n's tokens are read (default: on when decode steps "
                        "replay CUDA graphs)")
    s.add_argument("--scheduling-policy", choices=("vtc", "fcfs"), default="vtc",
                   help="vtc: tenant-fair (virtual token counters, each request's tenant_weight); fcfs: arrival order")
    s.add_argument("--vtc-preempt-gap", type=_preempt_gap, default=DEFAULT_PREEMPT_GAP,
                   help="vtc: counter lead over a waiting tenant beyond which running requests give up their "
                        f"sequence slots to its request (default {DEFAULT_PREEMPT_GAP:g}; 'none': never)")
    _speculative_flags(s)
    s.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (AdapterManager + slots)")
    s.add_argument("--max-loras", type=int, default=None,
                   help="optional cap on adapters resident on the GPU (default: none, the adapter memory decides)")
    s.add_argument("--max-lora-rank", type=int, default=16)
    s.add_argument("--max-cpu-loras", type=int, default=16)
    s.add_argument("--adapter-memory", type=_size, default=None,
                   help="GPU memory for resident adapters: bytes, or 24GiB / 500MB (default: "
                        "--adapter-memory-fraction of what is left after weights; the KV cache gets the rest)")
    s.add_argument("--adapter-memory-fraction", type=float, default=0.35,
                   help="share of the memory left after weights and headroom given to adapters (default 0.35)")
    s.add_argument("--adapter-cache-dir", default=os.environ.get("LORAPLEX_ADAPTER_CACHE_DIR"))
    s.add_argument("--adapter-cache-max-bytes", type=_size,
                   default=os.environ.get("LORAPLEX_ADAPTER_CACHE_MAX_BYTES", "20GiB"),
                   help="LRU cap of the adapter disk cache: bytes, or 20GiB / 20Gi / 500MB; none = unbounded, "
                        "0 = cache nothing (default 20GiB)")
    s.add_argument("--null-tokens", type=int, default=8, help="--null: tokens per request unless max_tokens says")
    s.add_argument("--null-delay-ms", type=float, default=0.0, help="--null: delay between tokens")
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=run)


def _speculative_flags(s) -> None:
    g = s.add_argument_group("speculative decoding (docs/engine.md, \"Speculative decoding\"); lossless, off by "
                             "default; a request opts out with sampling \"speculative\": false")
    g.add_argument("--speculative-method", choices=("ngram", "draft", "eagle", "eagle3"), default=None,
                   help="ngram: prompt lookup (no model); draft: a small causal LM sharing the tokenizer; eagle: a "
                        "draft head on the target's hidden states; eagle3: a published EAGLE-3 draft of the target")
    g.add_argument("--num-speculative-tokens", type=int, default=3, help="k: drafts verified per sequence per step")
    g.add_argument("--speculative-draft-model", default=None, help="draft: HF folder of the draft model")
    g.add_argument("--speculative-draft-num-kv-blocks", type=int, default=None,
                   help="draft, eagle3: KV blocks of the draft's own cache (default: max-num-seqs full sequences, on "
                        "CUDA at most half the memory left after the target)")
    g.add_argument("--speculative-draft-head", default=None,
                   help="eagle: folder of a draft head trained on this target's hidden states (config.json + "
                        "model.safetensors); eagle3: folder of a published EAGLE-3 draft of this target (config.json "
                        "+ model.safetensors or pytorch_model.bin)")
    g.add_argument("--speculative-adapter-draft-head", action="append", default=None, metavar="ADAPTER_ID=DIR",
                   help="eagle: a head trained under ADAPTER_ID drafts for its requests (repeatable; the others use "
                        "--speculative-draft-head)")
    g.add_argument("--speculative-draft-adapter", action="append", default=None, metavar="ADAPTER_ID=DIR",
                   help="draft: the LoRA of the draft model that drafts for ADAPTER_ID's requests (DIR: a PEFT "
                        "folder, or the adapter's folder holding it in draft/); repeat for more adapters; the "
                        "others use the bare draft")
    g.add_argument("--speculative-discover-draft-adapters", action="store_true",
                   help="draft: an adapter whose file:// folder holds a draft/ subfolder (a LoRA of the draft model) "
                        "drafts with it, found on its first request")
    g.add_argument("--speculative-draft-max-lora-rank", type=int, default=16,
                   help="draft: the largest rank of a draft LoRA (default 16)")
    g.add_argument("--speculative-ngram-min", type=int, default=1, help="ngram: shortest suffix matched")
    g.add_argument("--speculative-ngram-max", type=int, default=4, help="ngram: longest suffix matched")
    g.add_argument("--speculative-verify-cuda-graphs", action="store_true",
                   help="verify steps as decode rows through CUDA graphs (default: eager verify steps)")


def speculative_config(args) -> dict | None:
    """``EngineConfig.speculative`` from the flags (None without --speculative-method)."""
    if args.speculative_method is None:
        if (args.speculative_draft_model or args.speculative_draft_adapter or args.speculative_draft_head
                or args.speculative_discover_draft_adapters or args.speculative_adapter_draft_head):
            raise ValueError("--speculative-draft-model and --speculative-draft-adapter need --speculative-method "
                             "draft, --speculative-draft-head(s) need --speculative-method eagle or eagle3")
        return None
    spec = dict(method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
                draft_model=args.speculative_draft_model, draft_num_kv_blocks=args.speculative_draft_num_kv_blocks,
                ngram_min=args.speculative_ngram_min, ngram_max=args.speculative_ngram_max,
                verify_cuda_graphs=args.speculative_verify_cuda_graphs, draft_head=args.speculative_draft_head)
    if args.speculative_draft_adapter or args.speculative_discover_draft_adapters:
        spec.update(draft_adapters=_pairs("--speculative-draft-adapter", args.speculative_draft_adapter or []),
                    discover_draft_adapters=args.speculative_discover_draft_adapters,
                    draft_max_lora_rank=args.speculative_draft_max_lora_rank)
    if args.speculative_adapter_draft_head:
        spec["draft_heads"] = _pairs("--speculative-adapter-draft-head", args.speculative_adapter_draft_head)
    return spec


def _pairs(flag: str, values: list[str]) -> dict[str, str]:
    """ADAPTER_ID=DIR pairs -> {adapter_id: folder}."""
    out: dict[str, str] = {}
    for value in values:
        adapter_id, sep, folder = value.partition("=")
        if not sep or not adapter_id or not folder:
            raise ValueError(f"{flag} {value!r}: expected ADAPTER_ID=DIR")
        if adapter_id in out:
            raise ValueError(f"{flag}: adapter {adapter_id!r} given twice")
        out[adapter_id] = folder
    return out


def _quantization(choice: str) -> str | None:
    return None if choice == "none" else choice


def _preempt_gap(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        gap = float(text)
        check_preempt_gap(gap)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 or 'none', got {text!r}") from None
    return gap


def _size(text: str) -> int | None:
    from loraplex.engine.lora.disk_cache import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_settings(model: str, kwargs: dict) -> None:
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.engine_config import EngineConfig, check_against_model

    check_against_model(EngineConfig(model=model, **kwargs), ModelConfig.from_pretrained(model))


def run(args: argparse.Namespace) -> int:
    from loraplex.engine.server.serve import null_service, real_service, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.null:
        def make():
            return null_service(model_name=args.model_name or "null", num_tokens=args.null_tokens,
                                token_delay_s=args.null_delay_ms / 1000)
    else:
        kwargs = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs, progress=False,
                      max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                      tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                      cuda_graph_max_batch_size=args.cuda_graph_max_batch_size,
                      quantization=_quantization(args.quantization), async_scheduling=args.async_scheduling,
                      scheduling_policy=args.scheduling_policy, vtc_preempt_gap=args.vtc_preempt_gap,
                      cuda_graph_capture_budget_s=args.cuda_graph_capture_budget_s,
                      eager_warmup_budget_s=args.eager_warmup_budget_s, mixed_cuda_graphs=args.mixed_cuda_graphs)
        if args.enable_lora:
            kwargs.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                          max_cpu_loras=args.max_cpu_loras, adapter_cache_dir=args.adapter_cache_dir,
                          adapter_cache_max_bytes=args.adapter_cache_max_bytes,
                          adapter_memory_bytes=args.adapter_memory,
                          adapter_memory_fraction=args.adapter_memory_fraction)

        try:   # settings the model cannot honour: one line and exit, before the port opens or weights load
            kwargs["speculative"] = speculative_config(args)
            _check_settings(args.model, kwargs)
        except ValueError as e:
            print(f"loraplex engine serve: error: {e}", file=sys.stderr)
            return 2

        def make():
            return real_service(args.model, model_name=args.model_name, **kwargs)
    serve(make, host=args.host, port=args.port, log_level=args.log_level)
    return 0
