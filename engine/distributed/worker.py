"""A tensor-parallel worker (ranks 1..N-1): builds its shard of the model, KV cache and LoRA slots, then replays
rank 0's step messages until rank 0 says stop. The executor starts these with torch.multiprocessing; the same
entry runs from a shell for debugging (rank 0 is an ``LLMEngine`` with ``tensor_parallel_size=N`` on this host):

    python -m loraplex.engine.distributed.worker --config engine.json --rank 1 --world-size 2 \
        --master-port 29517 --max-model-len 2048

``engine.json`` holds the EngineConfig fields as rank 0 has them (same model, dtype, block size, LoRA limits).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from loraplex.engine.engine_config import EngineConfig

logger = logging.getLogger(__name__)


def run_worker(config: EngineConfig, rank: int, world_size: int, master_port: int, max_model_len: int,
               master_addr: str = "127.0.0.1", backend: str | None = None) -> None:
    """Join the group as ``rank``, build this rank's runner exactly as rank 0 builds its own, serve until stop."""
    import torch

    from loraplex.engine.distributed.parallel_state import default_backend, init_tensor_parallel
    from loraplex.engine.distributed.tp_runner import TPModelRunner
    from loraplex.engine.model_runner import resolve_device

    torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    device = resolve_device(config.device)
    tp = init_tensor_parallel(rank, world_size, backend=backend or default_backend(device), master_addr=master_addr,
                              master_port=master_port, device=device)
    try:
        runner = TPModelRunner(config, max_model_len, config.max_num_seqs, tp)
        if config.enable_lora:
            runner.init_lora(max_rank=config.max_lora_rank)
        runner.serve()
    finally:
        tp.destroy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="JSON file with the EngineConfig fields of rank 0")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True, help="rank 0's resolved max_model_len")
    args = p.parse_args(argv)
    if not 1 <= args.rank < args.world_size:
        p.error(f"--rank must be in [1, {args.world_size}) (rank 0 is the engine)")
    with open(args.config, encoding="utf-8") as f:
        config = EngineConfig(**json.load(f))
    logging.basicConfig(level=logging.INFO)
    run_worker(config, args.rank, args.world_size, args.master_port, args.max_model_len, args.master_addr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
