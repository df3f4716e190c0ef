"""``TPModelRunner``: a ModelRunner over this rank's shard of the model, its share of the KV heads and its part of
every LoRA slot. Rank 0 is the engine's runner (scheduler, sampling); ranks 1..N-1 replay rank 0's steps.

    rank 0 (LLMEngine.step)                                   rank r > 0 (worker.serve)
    ─────────────────────────                                 ─────────────────────────
    AdapterManager -> slots.load/clear  ─┐ journal
    move_blocks(out)                    ─┤ (CPU objects)
    _set_lora_tokens -> set_token_slots ─┤
    model(...)  pre-hook: broadcast ─────┴──────────────────▶ replay: loads, clears, block moves, token map
       layer by layer, all-reduce after attention and MLP ◀─▶ model(...) on the same inputs, same all-reduces
    compute_logits + sample (rank 0 only; lm_head replicated)

Before each forward rank 0 broadcasts everything since the previous one (each adapter load in a message of its
own, the rest batched), so the workers see rank 0's calls in rank 0's order. Step inputs travel as CPU tensors
through the gloo group (``TensorParallel.cpu_group``).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from loraplex.engine.distributed.lora import TPLoRASlots
from loraplex.engine.distributed.parallel_state import TensorParallel
from loraplex.engine.distributed.sharding import ShardPlan
from loraplex.engine.distributed.tensor_parallel import apply_tp
from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.model_runner import ModelRunner

_FORWARD_ARGS = ("input_ids", "positions", "attn", "kv_caches")


def _tensors_to(obj, device: torch.device | str):
    """A copy of dataclass ``obj`` (e.g. AttentionMetadata) with every tensor field on ``device``."""
    changes = {f.name: getattr(obj, f.name).to(device) for f in dataclasses.fields(obj)
               if isinstance(getattr(obj, f.name), torch.Tensor)}
    return dataclasses.replace(obj, **changes)


class TPModelRunner(ModelRunner):
    """The runner of rank ``tp.rank``: loads the full checkpoint on the host, keeps its shard on ``device``."""

    def __init__(self, config: EngineConfig, max_model_len: int, max_num_seqs: int, tp: TensorParallel) -> None:
        self.tp = tp
        self.plan: ShardPlan | None = None    # set by _load_model
        self._journal: list[tuple] = []       # rank 0: what the workers must replay before the next forward
        self.workers: list = []               # rank 0: the worker processes (set by the executor)
        super().__init__(config, max_model_len, max_num_seqs)
        if tp.is_driver:
            self.model.register_forward_pre_hook(self._ship_step, with_kwargs=True)

    # ---- ModelRunner hooks ----------------------------------------------------------------------------------
    def _load_model(self):
        """Full checkpoint into host memory, shard it (``apply_tp``), then move this rank's part to the device,
        so a device never holds more than its shard.

        Dummy weights (``load_format="dummy"``) are drawn on the device itself when the full model fits there:
        the seeded draw gives every rank the same full model (same device type, same generator), and drawing
        ~20B numbers on a host core takes minutes where a GPU takes a second. Out of memory: the host path."""
        from loraplex.engine.loader import load_model

        cfg = self.config
        progress = cfg.progress and self.tp.is_driver
        model = None
        if cfg.load_format == "dummy" and self.device.type != "cpu":
            try:
                model, model_config = load_model(cfg.model, device=self.device, dtype=self.dtype,
                                                 load_format="dummy", progress=progress)
            except torch.cuda.OutOfMemoryError:
                model = None
                torch.cuda.empty_cache()
        if model is None:
            model, model_config = load_model(cfg.model, device="cpu", dtype=self.dtype, load_format=cfg.load_format,
                                             progress=progress)
        self.plan = apply_tp(model, model_config, self.tp)
        model = model.to(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the unsharded tensors' blocks, before the KV pool is sized from free memory
        return model, model_config

    @property
    def num_kv_heads(self) -> int:
        return self.plan.num_kv_heads

    def _size_kv_pool(self, max_model_len: int, max_num_seqs: int) -> int:
        # every rank must hold the same block ids: the smallest pool any rank can afford; likewise the adapter
        # budget (rank 0 accounts for every rank's part of each adapter)
        blocks = self.tp.all_reduce_min(super()._size_kv_pool(max_model_len, max_num_seqs))
        self.adapter_budget_bytes = self.tp.all_reduce_min(self.adapter_budget_bytes)
        return blocks

    def _size_swap_pool(self) -> int:
        return self.tp.all_reduce_min(super()._size_swap_pool())

    def init_lora(self, *, max_rank: int, copier=None) -> TPLoRASlots:
        """Slots with the shard sizes; ``load`` takes full adapters (rank 0's loads reach the workers too). Copies
        are synchronous on every rank (a worker replays a load right before the forward that needs it)."""
        from loraplex.engine.lora.device_copy import DeviceCopier

        journal = self._journal.append if self.tp.is_driver else None
        self.lora = TPLoRASlots(self.model, self.model_config, plan=self.plan, journal=journal, max_rank=max_rank,
                                max_step_slots=self.max_num_seqs, device=self.device, dtype=self.dtype,
                                copier=copier or DeviceCopier(self.device, asynchronous=False))
        return self.lora

    def move_blocks(self, out) -> None:
        if self.tp.is_driver and (out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy):
            self._journal.append(("blocks", list(out.blocks_to_swap_out), list(out.blocks_to_swap_in),
                                  list(out.blocks_to_copy)))
        super().move_blocks(out)

    # ---- rank 0 -> workers ----------------------------------------------------------------------------------
    def _ship_step(self, _module, args: tuple, kwargs: dict):
        """Forward pre-hook of rank 0's model: send the journal and this forward's inputs to every worker."""
        inputs = dict(zip(_FORWARD_ARGS, args), **kwargs)
        step = ("forward", inputs["input_ids"].cpu(), inputs["positions"].cpu(), _tensors_to(inputs["attn"], "cpu"))
        self._flush(step)

    def _flush(self, last: tuple) -> None:
        """Broadcast the journal and ``last``, in order. Each adapter load (full weights: 708 MB at GPT-OSS-20B
        size, rank 32) goes in a message of its own, so a step that activates several adapters never pickles
        them into one multi-GB message; workers replay the messages in the order they arrive."""
        entries, self._journal[:] = [*self._journal, last], []
        batch: list[tuple] = []
        for entry in entries:
            if entry[0] == "load":
                if batch:
                    self.tp.broadcast_object(batch)
                self.tp.broadcast_object([entry])
                batch = []
            else:
                batch.append(entry)
        if batch:
            self.tp.broadcast_object(batch)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Rank 0: tell the workers to stop, wait for them, leave the process group. Idempotent."""
        if self.tp.world_size == 1 or self.tp.group is None:
            return
        if self.tp.is_driver:
            alive = all(p.is_alive() for p in self.workers)
            if alive:
                self._flush(("stop",))
            for p in self.workers:
                p.join(timeout)
                if p.is_alive():
                    p.terminate()
        self.tp.destroy()

    # ---- workers --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def replay(self, entry: tuple) -> bool:
        """Apply one entry of rank 0's step message; False on "stop"."""
        kind = entry[0]
        if kind == "stop":
            return False
        if kind == "forward":
            _, input_ids, positions, attn = entry
            dev = self.device
            self.model(input_ids.to(dev), positions.to(dev), _tensors_to(attn, dev), self.kv_caches)
        elif kind == "blocks":
            _, swap_out, swap_in, copy = entry
            super().move_blocks(SimpleNamespace(blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in,
                                                blocks_to_copy=copy))
        elif kind in ("load", "clear", "tokens"):
            if self.lora is None:
                raise RuntimeError(f"rank {self.tp.rank} got a LoRA {kind!r} but LoRA is not attached")
            self.lora.replay(entry)
        else:
            raise ValueError(f"unknown step entry {kind!r}")
        return True

    def serve(self) -> None:
        """Worker loop: receive rank 0's step messages and replay them until "stop"."""
        while True:
            for entry in self.tp.broadcast_object(None):
                if not self.replay(entry):
                    return


__all__ = ["TPModelRunner"]
