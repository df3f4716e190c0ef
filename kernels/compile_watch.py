"""Triton JIT compiles in this process: how many, how long, which kernels.

A Triton kernel compiles (or loads from the disk cache) the first time a process launches it with a new
specialisation: other constexprs or launch options, integer arguments equal to 1 or divisible by 16. A compile
inside a serving step stalls every running request for its duration (seconds for a LoRA kernel), so a serving
run should see none once it is warm. ``install()`` chains onto Triton's JIT hooks once per process (the hooks
set before it keep being called); a window's compiles are ``watch.since(before)``:

    watch = compile_watch.install()          # None where this Triton has no JIT hooks
    before = watch.snapshot()
    ...                                      # serve
    watch.since(before)                      # {"compiles": 2, "seconds": 3.1, "kernels": {"_moe_lora_expand_kernel": 2}}

Under ``TRITON_INTERPRET=1`` nothing compiles, so nothing is counted.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Snapshot:
    compiles: int
    seconds: float
    kernels: dict[str, int] = field(default_factory=dict)


class CompileWatch:
    """Counts compiles between Triton's pre-compile hook and its post-compile hook (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: dict[tuple[str, str], float] = {}
        self.compiles = 0
        self.seconds = 0.0
        self.kernels: Counter[str] = Counter()
        self.recent: deque[tuple[int, str]] = deque(maxlen=RECENT)  # (compile number, Triton's repr of it)

    def pre_hook(self, previous):
        """Triton's ``jit_cache_hook``: called before a compile; a truthy return skips it (only ``previous``'s)."""
        def hook(*, key, fn, **kwargs):
            with self._lock:
                self._started[(_name(fn), str(key))] = time.perf_counter()
            return previous(key=key, fn=fn, **kwargs) if previous is not None else None
        return hook

    def post_hook(self, previous):
        """Triton's ``jit_post_compile_hook``: called once the kernel is compiled."""
        def hook(*, key, fn, **kwargs):
            name, now = _name(fn), time.perf_counter()
            with self._lock:
                t0 = self._started.pop((name, str(key)), now)
                self.compiles += 1
                self.seconds += now - t0
                self.kernels[name] += 1
                self.recent.append((self.compiles, str(kwargs.get("repr") or name)[:REPR_CHARS]))
            return previous(key=key, fn=fn, **kwargs) if previous is not None else None
        return hook

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self.compiles, self.seconds, dict(self.kernels))

    def since(self, before: Snapshot) -> dict:
        """Compiles after ``before``: count, seconds, count per kernel, and Triton's description of the last few
        (kernel, launch options and each argument's specialisation: what made the variant new)."""
        now = self.snapshot()
        kernels = {k: n - before.kernels.get(k, 0) for k, n in now.kernels.items() if n > before.kernels.get(k, 0)}
        with self._lock:
            variants = [r for i, r in self.recent if i > before.compiles]
        return {"compiles": now.compiles - before.compiles, "seconds": round(now.seconds - before.seconds, 3),
                "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])), "variants": variants}


def _name(fn) -> str:
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or fn)


RECENT = 16  # compiles whose description is kept
REPR_CHARS = 600
_WATCH: CompileWatch | None = None
_INSTALL_LOCK = threading.Lock()


def current() -> CompileWatch | None:
    """The installed watch, or None (nothing installed it in this process)."""
    return _WATCH


def install() -> CompileWatch | None:
    """The process's watch, its hooks chained onto Triton's on the first call; None without Triton or its hooks."""
    global _WATCH
    with _INSTALL_LOCK:
        if _WATCH is not None:
            return _WATCH
        holder = _hook_holder()
        if holder is None:
            return None
        obj, pre, post = holder
        watch = CompileWatch()
        setattr(obj, pre, watch.pre_hook(getattr(obj, pre)))
        setattr(obj, post, watch.post_hook(getattr(obj, post)))
        _WATCH = watch
        return watch


def _hook_holder():
    """(object, pre-compile attribute, post-compile attribute) of this Triton: ``triton.knobs.runtime``
    (Triton 3.4+), else ``JITFunction``'s class attributes (older); None when neither exists."""
    try:
        import triton
    except ImportError:
        return None
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook"):
        return runtime, "jit_cache_hook", "jit_post_compile_hook"
    from triton.runtime.jit import JITFunction

    if hasattr(JITFunction, "cache_hook") and hasattr(JITFunction, "compiled_hook"):
        return JITFunction, "cache_hook", "compiled_hook"
    return None


__all__ = ["CompileWatch", "Snapshot", "current", "install"]
