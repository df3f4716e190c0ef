"""Start a tensor-parallel engine on one host: spawn ranks 1..N-1 (torch.multiprocessing, "spawn"), join the
group as rank 0 on a free loopback port, and return rank 0's runner for ``LLMEngine``.

    runner = start_tensor_parallel(config, max_model_len)     # config.tensor_parallel_size = N
    ...                                                         # LLMEngine drives runner as any ModelRunner
    runner.shutdown()                                           # LLMEngine.close()

Each worker builds the same runner from the same EngineConfig (so every rank agrees on block ids, slots and the
KV pool, whose size is the minimum over the ranks); on CUDA rank r uses GPU r, on CPU each worker takes an equal
share of the CPU threads (rank 0, the caller's process, keeps its own setting).
"""
from __future__ import annotations

import logging
import threading

import torch
import torch.multiprocessing as mp

from loraplex.engine.distributed.parallel_state import default_backend, free_port, init_tensor_parallel
from loraplex.engine.distributed.tp_runner import TPModelRunner
from loraplex.engine.distributed.worker import run_worker
from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.model_runner import resolve_device

logger = logging.getLogger(__name__)


def start_tensor_parallel(config: EngineConfig, max_model_len: int, world_size: int | None = None) -> TPModelRunner:
    """Rank 0's runner of a ``world_size``-way (default ``config.tensor_parallel_size``) TP engine, workers
    started. Raises ValueError when the host lacks the GPUs, TensorParallelError when the model cannot be split."""
    world = world_size if world_size is not None else config.tensor_parallel_size
    if world < 2:
        raise ValueError(f"tensor parallelism needs tensor_parallel_size >= 2, got {world}")
    device = resolve_device(config.device)
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs on this host, found "
                         f"{torch.cuda.device_count()}")
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.distributed.sharding import shard_plan

    shard_plan(ModelConfig.from_pretrained(config.model), 0, world)  # refuse before any process starts
    backend, port = default_backend(device), free_port()
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=run_worker, args=(config, rank, world, port, max_model_len),
                           kwargs={"backend": backend}, name=f"loraplex-tp-{rank}", daemon=True)
               for rank in range(1, world)]
    for p in workers:
        p.start()
    logger.info("tensor parallel: %d ranks (%s) on 127.0.0.1:%d", world, backend, port)
    tp = None
    try:
        tp = _join_watching(workers, lambda: init_tensor_parallel(0, world, backend=backend, master_port=port,
                                                                  device=device))
        runner = TPModelRunner(config, max_model_len, config.max_num_seqs, tp)
    except BaseException:
        for p in workers:
            p.terminate()
        if tp is not None:
            tp.destroy()
        raise
    runner.workers = workers
    return runner


def _join_watching(workers: list, join):
    """Run ``join()`` (the rendezvous) on a helper thread; fail at once if a worker dies before it completes
    (its traceback is on stderr) instead of waiting out the rendezvous timeout."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = join()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="loraplex-tp-rendezvous", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        dead = [p for p in workers if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"tensor-parallel worker {dead[0].name} exited with code {dead[0].exitcode} during "
                               "startup; its traceback is on stderr")
    if "error" in box:
        raise box["error"]
    return box["value"]


__all__ = ["start_tensor_parallel"]
