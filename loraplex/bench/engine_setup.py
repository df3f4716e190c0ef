"""The bench's engine: EngineConfig keywords for the workload, the optional engine features it asks for, and what
the started engine reports about itself (KV pool, CUDA graphs, tensor parallelism, quantization).

    kw, in_place, notes = engine_kwargs(cfg, work_dir, device="cuda", dtype="bfloat16", quantization="int8")
    with timed_model_load(setup_s, "model_load"):
        engine = LLMEngine.from_pretrained(model_folder, **kw)
    use_in_place_fetcher(engine)          # file:// adapters are read where they are (no copy into the cache)
    info = engine_info(engine)            # {"kv_blocks": ..., "cuda_graphs": ..., ...}

``quantization`` and ``enforce_eager`` are EngineConfig fields of newer engines; when the running engine lacks
one, the bench falls back (INT8: transform the built model in place, eager only) and says so in ``notes``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager

from loraplex.engine.lora.fetch import AdapterFetchError


def engine_fields() -> set[str]:
    from loraplex.engine.engine_config import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


def engine_kwargs(cfg, work_dir: str, *, device: str, dtype: str, quantization: str | None) -> tuple[dict, bool, list]:
    """(EngineConfig keywords, whether INT8 must be applied in place after the start, notes).

    The KV pool is sized for the workload (``max(concurrency, adapters)`` full sequences + 64 blocks) rather
    than from free memory, so a run measures the same pool on any device and starts fast."""
    fields = engine_fields()
    bs = cfg.block_size
    seqs = max(cfg.concurrency, cfg.num_adapters)
    per_seq = -(-(cfg.input_len + cfg.output_len + bs) // bs)
    kw = dict(dtype=dtype, device=device, load_format="dummy", progress=False,
              max_model_len=cfg.input_len + cfg.output_len + bs, max_num_seqs=seqs,
              max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=bs, num_kv_blocks=per_seq * seqs + 64,
              swap_space_bytes=0, enable_prefix_caching=False, enable_lora=cfg.num_adapters > 0,
              max_loras=max(1, cfg.num_adapters), max_lora_rank=cfg.rank, max_cpu_loras=max(16, cfg.num_adapters),
              adapter_cache_dir=os.path.join(work_dir, "adapter-cache"))
    notes: list[str] = []
    if cfg.tensor_parallel_size != 1:
        kw["tensor_parallel_size"] = cfg.tensor_parallel_size
    if "enforce_eager" in fields:
        kw["enforce_eager"] = cfg.enforce_eager
    elif cfg.enforce_eager:
        notes.append("this engine has no CUDA graphs (no EngineConfig.enforce_eager): --enforce-eager changes nothing")
    if getattr(cfg, "async_scheduling", None) is not None:
        if "async_scheduling" not in fields:
            raise ValueError("this engine has no overlapped scheduling (no EngineConfig.async_scheduling); drop "
                             "--async-scheduling / --no-async-scheduling")
        kw["async_scheduling"] = cfg.async_scheduling
    in_place = False
    if quantization is not None:
        if "quantization" in fields:
            kw["quantization"] = quantization
        elif cfg.tensor_parallel_size > 1:
            raise ValueError("INT8 experts with tensor parallelism need EngineConfig.quantization (every rank "
                             "quantises its shard at load); this engine has no such field")
        else:
            in_place = True
            if "enforce_eager" in fields:
                kw["enforce_eager"] = True  # graphs captured before an in-place swap would replay freed weights
            notes.append("INT8 experts applied in place after the engine started (no EngineConfig.quantization); "
                         "that engine runs eager")
    return kw, in_place, notes


def engine_info(engine) -> dict:
    """What the started engine is: KV pool, tensor parallelism, quantization, CUDA graphs (None: the engine does
    not say; 0: none captured)."""
    runner, config = engine.runner, engine.config
    info = dict(kv_blocks=runner.num_blocks, kv_tokens=runner.num_blocks * runner.block_size,
                kv_gib=runner.num_blocks * runner.bytes_per_block / 2**30,
                tensor_parallel_size=getattr(config, "tensor_parallel_size", 1),
                enforce_eager=getattr(config, "enforce_eager", None),
                quantization=getattr(config, "quantization", None), cuda_graphs=cuda_graph_count(runner),
                async_scheduling=getattr(engine, "async_scheduling", None))
    graphs = getattr(runner, "decode_graphs", None)
    if info["cuda_graphs"]:
        info["cuda_graph_buckets"] = list(getattr(runner, "cuda_graph_buckets", []) or [])
        for name in ("capture_seconds", "graph_memory_bytes"):
            if getattr(graphs, name, None) is not None:
                info[f"cuda_graph_{name}"] = getattr(graphs, name)
    return info


def cuda_graph_count(runner) -> int | None:
    """Graphs the runner captured (``num_cuda_graphs``); None when the engine has no such notion."""
    n = getattr(runner, "num_cuda_graphs", None)
    if callable(n):
        n = n()
    return int(n) if n is not None else None


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
