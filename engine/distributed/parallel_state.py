"""The process group of one tensor-parallel engine: every rank of it runs the same forward on its shard.

    tp = init_tensor_parallel(rank=0, world_size=2, backend="gloo", master_port=29517)
    tp.all_reduce(partial)        # in place: the sum over ranks (row-parallel outputs)
    tp.broadcast_object(step)     # rank 0 -> every rank, through the CPU (gloo) group
    tp.destroy()

Two groups: ``group`` carries the activations (NCCL on CUDA, gloo on CPU) and ``cpu_group`` (always gloo, with a
long timeout because workers wait in it while the engine is idle) the pickled step metadata, so metadata never
takes a trip through device memory. A rank that dies closes its sockets, so the others fail fast rather than
waiting out the timeout.
"""
from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 1800.0          # a collective of the forward (and the rendezvous) that takes longer fails
IDLE_TIMEOUT_S = 30 * 24 * 3600.0   # workers wait this long for rank 0's next step (an idle engine is normal)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for MASTER_PORT on loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass
class TensorParallel:
    """This process's place in a TP engine. ``world_size == 1`` needs no process group (``group`` is None)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None       # activations: NCCL on CUDA, gloo on CPU
    cpu_group: Any = None   # step metadata: gloo

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel world of size {self.world_size}")

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and samples; the others only replay its steps."""
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (for sizes every rank must agree on, e.g. KV blocks)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; keep tensors inside it on the CPU)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def destroy(self) -> None:
        """Leaves the process group (each rank once, at shutdown)."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.group = self.cpu_group = None


def init_tensor_parallel(rank: int, world_size: int, *, backend: str = "gloo", master_addr: str = "127.0.0.1",
                         master_port: int, device: torch.device | str = "cpu",
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallel:
    """Joins (creates) the default process group of a TP engine on ``master_addr:master_port`` (loopback: one
    host). On CUDA each rank uses GPU ``rank``. Raises RuntimeError when this process is already in a group."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not supported; choose one of {', '.join(BACKENDS)}")
    if world_size == 1:
        return TensorParallel(0, 1)
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group; one tensor-parallel engine "
                           "per process (close the other engine first)")
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            init_method=f"tcp://{master_addr}:{master_port}")
    cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
    return TensorParallel(rank, world_size, dist.group.WORLD, cpu_group)


__all__ = ["TensorParallel", "init_tensor_parallel", "free_port", "default_backend", "BACKENDS"]
