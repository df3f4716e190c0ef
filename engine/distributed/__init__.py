"""Tensor parallelism across the GPUs (or CPU processes) of one host, through torch.distributed.

    parallel_state.py   the process group of a TP engine (gloo on CPU, NCCL on CUDA) and its all-reduce
    sharding.py         which rows / columns / heads each rank keeps (pure index arithmetic, one source of truth)
    tensor_parallel.py  ``apply_tp(model, cfg, tp)``: shards a built model in place (gpt-fast style)
    lora.py             per-rank LoRA slots: full adapter weights in, this rank's shard into the slots
    tp_runner.py        ``TPModelRunner``: a ModelRunner over a sharded model; rank 0 ships each step to workers
    worker.py           ranks 1..N-1: replay rank 0's step messages (``python -m loraplex.engine.distributed.worker``)
    executor.py         spawns the workers and builds rank 0's runner for ``LLMEngine``

See docs/engine.md, "Tensor parallelism".
"""
