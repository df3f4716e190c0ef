"""The bench's engine: EngineConfig keywords for the workload and what the started engine reports about itself
(KV pool, CUDA graphs, tensor parallelism, quantization).

    kw = engine_kwargs(cfg, work_dir, device="cuda", dtype="bfloat16", quantization="int8",
                       max_loras=16, extra=optional_engine_kwargs(adapter_memory_bytes=...))   # engine_knobs.py
    with timed_model_load(setup_s, "model_load"):
        engine = LLMEngine.from_pretrained(model_folder, **kw)
    use_in_place_fetcher(engine)          # file:// adapters are read where they are (no copy into the cache)
    info = engine_info(engine)            # {"kv_blocks": ..., "cuda_graphs": ..., ...}
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

from loraplex.engine.lora.fetch import AdapterFetchError


def engine_kwargs(cfg, work_dir: str, *, device: str, dtype: str, quantization: str | None,
                  max_loras: int | None = None, extra: dict | None = None) -> dict:
    """EngineConfig keywords of the workload ``cfg`` (a ServeBenchConfig).

    ``kv_sizing="engine"`` (default): the engine's own ``max_num_seqs`` and KV pool (sized from free memory), as a
    deployment runs; ``"workload"``: ``max_num_seqs`` = the most sequences the workload runs at once (its largest
    concurrency level, its adapter count, a heavy tenant's ``n``) and a KV pool of that many full sequences + 64
    blocks, so a run measures the same pool on any device and starts fast. ``max_loras``: this phase's cap on
    distinct adapters (default ``cfg.max_loras``, else none: the engine's adapter memory budget decides);
    ``max_num_batched_tokens`` only when the workload sets it; ``extra``: keywords of ``engine_knobs``."""
    bs = cfg.block_size
    seqs = max(cfg.concurrency, cfg.num_adapters, max(cfg.heavy_n) if cfg.scenario == "fairness" else 1)
    per_seq = -(-(cfg.input_len + cfg.output_len + bs) // bs)
    loras = max_loras or cfg.max_loras
    kw = dict(dtype=dtype, device=device, load_format="dummy", progress=False,
              max_model_len=cfg.input_len + cfg.output_len + bs,
              block_size=bs,
              swap_space_bytes=0, enable_prefix_caching=False, enable_lora=cfg.num_adapters > 0,
              max_loras=loras, max_lora_rank=cfg.rank,
              max_cpu_loras=cfg.max_cpu_loras or max(16, cfg.num_adapters, loras or 0),
              adapter_cache_dir=os.path.join(work_dir, "adapter-cache"),
              tensor_parallel_size=cfg.tensor_parallel_size, enforce_eager=cfg.enforce_eager,
              async_scheduling=cfg.async_scheduling, quantization=quantization,
              mixed_cuda_graphs=cfg.mixed_cuda_graphs)
    if cfg.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.kv_sizing == "workload":
        kw.update(max_num_seqs=seqs, num_kv_blocks=per_seq * seqs + 64)
    if cfg.cuda_graph_max_batch_size is not None:
        kw["cuda_graph_max_batch_size"] = cfg.cuda_graph_max_batch_size
    speculative = _speculative(cfg)
    if speculative is not None:
        kw["speculative"] = speculative
    kw.update(extra or {})
    return kw


def _speculative(cfg) -> dict | None:
    from loraplex.bench.speculative import speculative_config

    return speculative_config(cfg)


def engine_info(engine) -> dict:
    """What the started engine is: KV pool, tensor parallelism, quantization, CUDA graphs (0: none captured)."""
    runner, config = engine.runner, engine.config
    info = dict(kv_blocks=runner.num_blocks, kv_tokens=runner.num_blocks * runner.block_size,
                kv_gib=runner.num_blocks * runner.bytes_per_block / 2**30,
                max_num_seqs=engine.scheduler.config.max_num_seqs,
                tensor_parallel_size=config.tensor_parallel_size, enforce_eager=config.enforce_eager,
                quantization=config.quantization, cuda_graphs=runner.num_cuda_graphs,
                async_scheduling=engine.async_scheduling)
    graphs = runner.decode_graphs
    if info["cuda_graphs"]:
        info["cuda_graph_buckets"] = runner.cuda_graph_buckets
        info["cuda_graph_capture_seconds"] = graphs.capture_seconds
        info["cuda_graph_memory_bytes"] = graphs.graph_memory_bytes
    mixed = runner.mixed_graphs
    info["mixed_cuda_graphs"] = runner.num_mixed_cuda_graphs
    if info["mixed_cuda_graphs"]:
        info["mixed_cuda_graph_buckets"] = list(mixed.buckets)
        info["mixed_cuda_graph_capture_seconds"] = mixed.capture_seconds
        info["mixed_cuda_graph_memory_bytes"] = mixed.graph_memory_bytes
    warmup = getattr(engine, "warmup", None)
    if warmup is not None:   # the start-up compile of eager steps' kernel variants (engine/eager_warmup.py)
        info["eager_warmup"] = {"shapes": warmup.shapes, "planned": warmup.planned,
                                "seconds": round(warmup.seconds, 2), "compiles": warmup.compiles,
                                "compile_seconds": warmup.compile_seconds}
    return info


@contextmanager
def timed_model_load(into: dict, key: str):
    """Adds the seconds the engine spends in ``loader.load_model`` (build + dummy init of the weights; synced on
    CUDA) to ``into[key]``: the part of an engine start that is weights, apart from KV pool, slots and graphs.
    On a tensor-parallel engine this is rank 0's load (the workers load theirs at the same time)."""
    import torch

    from loraplex.engine import loader

    original = loader.load_model

    def load_model(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            into[key] = into.get(key, 0.0) + time.monotonic() - t0

    loader.load_model = load_model  # the runners import it at call time
    try:
        yield
    finally:
        loader.load_model = original


class InPlaceFileFetcher:
    """``file://`` adapters read where they are: the fetch returns the source folder instead of copying it into
    the engine's cache (the bench wrote them a moment ago; a second 708 MB write per adapter measures nothing).
    The engine's loader still validates the folder and reads every tensor."""

    def fetch(self, uri: str, dest_dir: str) -> str:
        from urllib.parse import unquote, urlparse

        parsed = urlparse(uri)
        if parsed.scheme != "file":
            raise AdapterFetchError(f"InPlaceFileFetcher handles file:// URIs, got {uri!r}")
        folder = unquote(parsed.path)
        if not os.path.isdir(folder):
            raise AdapterFetchError(f"adapter folder {folder!r} (from {uri!r}) does not exist")
        return folder


def use_in_place_fetcher(engine) -> None:
    if engine.adapters is not None:
        engine.adapters.register_fetcher("file", InPlaceFileFetcher())
