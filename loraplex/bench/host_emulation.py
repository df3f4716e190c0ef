"""The CUDA path's host code on a CPU: Triton launchers run on CPU tensors with every kernel launch a no-op.

The engine's eager steps (an arrival's prefill beside the decoding rows) enqueue a few hundred launches, and with
adapters the host can take longer to enqueue them than the GPU takes to run them. What the host does there is the
Python of the launchers (config lookups, checks, allocations, argument lists), torch's small ops and Triton's
launch calls; all of it but the CUDA driver call runs the same on a CPU. Inside ``emulated_launches()``:

- ``dispatch.resolve`` hands out the Triton launchers for CPU tensors too (``ops`` reads it through that module);
- the first launch of a kernel variant returns a stand-in for the compiled kernel instead of compiling, so
  ``CachedLaunch`` keys it and every later launch goes through its cached path, up to the launcher call, which
  records the launch and does nothing; a kernel launched without ``cached_launch`` is recorded the same way;
- tuning files are looked up under ``device_name`` (the configs the GPU would run, where the shapes match);
- MXFP4 experts are repacked as the engine does at load on CUDA by the caller
  (``mxfp4_experts.use_mxfp4_kernel_layout(model, any_device=True)``);
- torch runs on one CPU thread with denormals flushed, so its small ops (which stand for launches on the GPU)
  cost what a call costs, not a thread pool's wake-up or slow arithmetic on the garbage the outputs hold.

Kernel outputs are left as allocated, so the numbers a step computes are meaningless; token ids stay in range
(sampling reads its own logits). Use it to time and count host work, never to check results. ``Launches``
counts launches by kernel and by path. Nothing here touches a GPU; entering twice is refused, and so is
entering under ``TRITON_INTERPRET`` (the kernels are then the interpreter's and would run).
"""
from __future__ import annotations

import collections
import contextlib
import os
from dataclasses import dataclass, field


@dataclass
class Launches:
    """Launches recorded while emulating: by kernel name, and how many went through the cached path."""
    by_kernel: collections.Counter = field(default_factory=collections.Counter)
    cached: int = 0
    jit: int = 0

    @property
    def total(self) -> int:
        return self.cached + self.jit

    def clear(self) -> None:
        self.by_kernel.clear()
        self.cached = self.jit = 0


class _Compiled:
    """Stands for a ``CompiledKernel``: what ``CachedLaunch`` reads from one (``run``, ``function``,
    ``packed_metadata``, ``launch_metadata``)."""

    def __init__(self, name: str, launches: Launches) -> None:
        self.name, self._launches = name, launches
        self.function = None
        self.packed_metadata = None

    def run(self, *args) -> None:  # the C launcher's signature: grid, stream, function, metadata, hooks, args
        self._launches.by_kernel[self.name] += 1
        self._launches.cached += 1

    def launch_metadata(self, *args):
        return None


_active = False


@contextlib.contextmanager
def emulated_launches(device_name: str = "NVIDIA H200"):
    """Yields a ``Launches`` (module docstring); everything patched is restored on exit."""
    global _active
    if _active:
        raise RuntimeError("emulated_launches() is already active")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("emulated_launches() needs Triton's JIT: unset TRITON_INTERPRET (under the interpreter "
                           "every kernel runs on the CPU for real)")
    from triton.runtime.jit import JITFunction

    from loraplex.kernels import dispatch, ops, tuning
    from loraplex.kernels.launch import CachedLaunch

    launches = Launches()
    compiled: dict[str, _Compiled] = {}
    reference = dispatch.reference

    def resolve(name, tensor):
        if dispatch.kernel_mode() == "auto":
            launcher = dispatch._load_launcher(name)
            if launcher is not None:
                return launcher
        return getattr(reference, name)

    def jit_run(self, *args, grid, warmup, **kwargs):
        name = self.fn.__name__
        kernel = compiled.setdefault(name, _Compiled(name, launches))
        if not warmup:
            launches.by_kernel[name] += 1
            launches.jit += 1
        return kernel

    patches = [(dispatch, "resolve", resolve), (ops, "resolve", resolve), (JITFunction, "run", jit_run),
               (CachedLaunch, "_device", lambda self: 0), (CachedLaunch, "_stream", lambda self, device: 0),
               (CachedLaunch, "_launch_hooks", lambda self: (None, None)),
               (tuning, "current_device_name", lambda: device_name)]
    saved = [(obj, attr, obj.__dict__.get(attr, _MISSING)) for obj, attr, _ in patches]
    import torch

    flush = torch.set_flush_denormal(True)  # outputs left as allocated may hold denormals: slow CPU arithmetic
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's own CPU arithmetic stands for launches: no thread pool waking per op
    _active = True
    try:
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        yield launches
    finally:
        for obj, attr, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)
        for kernel in _cached_launch_kernels():
            kernel._launchers.clear()  # entries holding stand-ins must not outlive the emulation
        tuning.clear_cache()
        if flush:
            torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
        _active = False


_MISSING = object()


def _cached_launch_kernels():
    """Every ``CachedLaunch`` kernel of the loaded ``loraplex.kernels`` modules."""
    import sys

    from loraplex.kernels.launch import CachedLaunch

    for name, module in list(sys.modules.items()):
        if name.startswith("loraplex.kernels.") and module is not None:
            for value in vars(module).values():
                if isinstance(value, CachedLaunch):
                    yield value
