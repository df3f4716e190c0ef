"""Host time of one Triton launch on the GPU: Triton's dispatch against the cached launch of ``kernels/launch.py``,
and the parts of each, at the LoRA shrink of a GPT-OSS-20B qkv projection (14 runtime arguments, 9 keywords).

    python3 benchmarks/kernels/launch_overhead_gpu.py --out "$OUT"      # about 10 s on an H200 (after compiles)

One launch of ``lora_shrink`` through ``ops`` is recorded (grid, arguments, keywords as the launcher builds them),
then each variant is called ``--calls`` times in a loop and timed on the host (``time.perf_counter``, the device
synchronised only before and after the loop; the kernel is small, so the queue never fills):

    ops.lora_shrink / ops.lora_expand     the whole op wrappers (checks, config lookup, buffer, launch)
    jit launch                            kernel.jit[grid](...): Triton's JITFunction.run
    cached launch                         kernel[grid](...): the key, the cache lookup, the compiled launcher
    key / binder                          CachedLaunch._key against Triton's binder (its specialisation)
    compiled launcher                     CompiledKernel.run alone (what both paths end in)
    torch.zeros / torch.empty             the op's buffer allocation, for scale

Writes ``launch_overhead.json`` (µs per call) under ``--out`` and prints one line per variant.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def host_us(fn, calls: int) -> float:
    """Mean host time of ``fn`` over ``calls`` calls, after 20 warm-up calls."""
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return round(elapsed / calls * 1e6, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("launch_overhead_gpu needs a CUDA GPU (it times real launches)")
    import triton
    from triton import knobs

    from loraplex.kernels import launch, ops
    from loraplex.kernels import lora_shrink as ls
    from loraplex.kernels.lora_table import LoRATable

    if not isinstance(ls._lora_shrink_kernel, launch.CachedLaunch):
        raise SystemExit("the shrink kernel is not a cached launch here (LORAPLEX_FAST_LAUNCH=0 or TRITON_INTERPRET=1)")
    dev, tokens, k, rank, slots, outs = "cuda", 16, 2880, 32, 8, (4096, 512, 512)
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    factors = [[(torch.randn(rank, k, device=dev, dtype=torch.bfloat16) * 0.01,
                 torch.randn(n, rank, device=dev, dtype=torch.bfloat16) * 0.01) for n in outs] for _ in range(slots)]
    table = LoRATable.from_factors(factors, in_features=k, out_features=outs, device=dev)
    idx = (torch.arange(tokens, device=dev) % slots).to(torch.int32)
    scaling = torch.ones(slots, device=dev)
    seg = ops.lora_segments(idx, slots)
    y = torch.zeros(tokens, sum(outs), device=dev, dtype=torch.bfloat16)

    cached = ls._lora_shrink_kernel
    recorded: dict = {}

    class Recorder:  # stands in for the kernel for one op call: records what the launcher passes
        def __getitem__(self, grid):
            def run(*a, **kw):
                recorded.update(grid=grid, args=a, kwargs=kw)
                return cached[grid](*a, **kw)
            return run

    ls._lora_shrink_kernel = Recorder()
    try:
        buf = ops.lora_shrink(x, table, idx, scaling, segments=seg)
    finally:
        ls._lora_shrink_kernel = cached
    grid, kargs, kwargs = recorded["grid"], recorded["args"], recorded["kwargs"]
    cached[grid](*kargs, **kwargs)  # the cache holds this key now
    entry = cached._launchers[(torch.cuda.current_device(), cached._key(kargs, kwargs))]
    compiled, full = entry.compiled, kargs + entry.tail
    stream = torch.cuda.current_stream().cuda_stream
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    binder = cached.jit.device_caches[torch.cuda.current_device()][-1]
    variants = {
        "ops.lora_shrink": lambda: ops.lora_shrink(x, table, idx, scaling, segments=seg),
        "ops.lora_expand": lambda: ops.lora_expand(y, buf, table, idx, outs, segments=seg),
        "jit launch": lambda: cached.jit[grid](*kargs, **kwargs),
        "cached launch": lambda: cached[grid](*kargs, **kwargs),
        "key (cached launch)": lambda: cached._key(kargs, kwargs),
        "binder (Triton)": lambda: binder(*kargs, **kwargs),
        "compiled launcher": lambda: compiled.run(grid[0], grid[1], 1, stream, compiled.function,
                                                  compiled.packed_metadata, None, enter, leave, *full),
        "torch.zeros": lambda: torch.zeros(3, tokens, rank, dtype=torch.float32, device=dev),
        "torch.empty": lambda: torch.empty(3, tokens, rank, dtype=torch.float32, device=dev),
    }
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "grid": list(grid), "runtime_args": len(kargs),
              "keywords": sorted(kwargs), "calls": args.calls, "us": {}}
    for name, fn in variants.items():
        report["us"][name] = host_us(fn, args.calls)
        print(f"{name:24s} {report['us'][name]:8.2f} us", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_overhead.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
