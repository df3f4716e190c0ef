"""Fixtures of the tensor-parallel tests: PEFT adapters of the shared tiny checkpoints, and a threaded stand-in
for a process group so a sharded forward of any world size runs inside one process."""
from __future__ import annotations

import threading

import pytest
import torch

MOE_FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral")


@pytest.fixture(scope="session")
def tp_adapter(tmp_path_factory):
    """``tp_adapter(base_path, *, r=4, seed=0) -> folder``: a PEFT LoRA of the checkpoint at ``base_path`` with
    random non-zero weights on attention plus the fused experts (MoE) or gate/up/down (dense)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def make(base_path: str, *, r: int = 4, seed: int = 0) -> str:
        key = (base_path, r, seed)
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
            moe = model.config.model_type in MOE_FAMILIES
            modules = ["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else ["gate_proj", "up_proj", "down_proj"])
            params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else None
            torch.manual_seed(seed)
            cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=modules, target_parameters=params,
                             init_lora_weights=False)
            out = str(tmp_path_factory.mktemp(f"tp-lora-{model.config.model_type}-s{seed}"))
            get_peft_model(model, cfg).save_pretrained(out)
            cache[key] = out
        return cache[key]

    return make


class ThreadGroup:
    """``world_size`` ranks as threads of this process: ``rank(r)`` is a TensorParallel-like object whose
    ``all_reduce`` sums the ranks' tensors in rank order (the same bits on every rank)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=60)
        self._parts: list[torch.Tensor | None] = [None] * world_size

    def rank(self, r: int) -> "_ThreadRank":
        return _ThreadRank(self, r)

    def run(self, fn) -> list:
        """``fn(tp)`` on every rank at once; the list of results in rank order (re-raises a rank's error)."""
        results: list = [None] * self.world_size
        errors: list = []

        def target(r: int) -> None:
            try:
                results[r] = fn(self.rank(r))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class _ThreadRank:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        g = self.group
        g._parts[self.rank] = t.clone()
        g._barrier.wait()
        total = g._parts[0].clone()
        for p in g._parts[1:]:
            total += p
        g._barrier.wait()
        t.copy_(total)
        return t


@pytest.fixture
def thread_group():
    """``thread_group(world_size) -> ThreadGroup``."""
    return ThreadGroup
