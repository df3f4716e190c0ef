"""Triton launches without the JIT's per-call dispatch, for the launchers of an eager step.

``kernel[grid](*args, **kwargs)`` on a ``JITFunction`` binds every argument, computes Triton's specialisation of each
(type, "equal to 1", "divisible by 16", pointer alignment), builds a cache key string and looks the compiled kernel
up before it launches: tens of µs of Python per launch, and an eager step of GPT-OSS-20B with adapters makes about
460 launches. ``@cached_launch`` above ``@triton.jit`` keeps the call syntax and remembers, per launch site shape,
the compiled kernel Triton chose:

    key = (device, argument types, per positional argument the properties Triton specialises on, keyword values)
        tensor: (dtype, data_ptr % 16 == 0)            (alignment ignored where the kernel does not specialise)
        int:    32 / 64 / unsigned 64-bit range, and == 1 or % 16 == 0 unless in ``do_not_specialize``
        bool, float, None: the type (bool: its value);  a constexpr passed by position: its value
        TensorDescriptor (host TMA descriptor): its tensor's dtype, box shape, padding and tf32 rounding
        keywords: constexprs and launch options (num_warps, launch_pdl, ...) by value

The first launch of a key goes through ``JITFunction.run`` (it compiles or loads the kernel, and launches it);
later ones call the compiled kernel's launcher (``CompiledKernel.run``) with the same arguments Triton's run
would pass it: the positional arguments, then every later parameter from the keywords or its default. A call
this cannot key (an argument of another type, a runtime parameter passed by keyword, a callable grid, pre-run
hooks) goes through ``JITFunction.run`` as before. The key holds at least every property Triton's specialisation
reads (``tests/kernels/test_launch.py`` checks it against Triton's own ``native_specialize_impl``), so a key maps
to one compiled variant. The positional part comes from a small function generated per tuple of argument types
(attribute reads, no call per argument: the launch is on the host's hot path).

    LORAPLEX_FAST_LAUNCH=0          every launch through JITFunction.run (debugging)
    LORAPLEX_FAST_LAUNCH_VERIFY=1   every cached launch also asks Triton which kernel it would run (``warmup``) and
                                    raises if it is another one (GPU checks; slower than the plain JIT)

Under ``TRITON_INTERPRET=1`` (CPU tests) the decorator returns the interpreter's function unchanged.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch


def enabled() -> bool:
    return os.environ.get("LORAPLEX_FAST_LAUNCH", "1") != "0"


def verify_default() -> bool:
    return os.environ.get("LORAPLEX_FAST_LAUNCH_VERIFY") == "1"


class _Entry:
    __slots__ = ("compiled", "run", "function", "packed", "tail")

    def __init__(self, compiled, tail: tuple) -> None:
        self.compiled, self.tail = compiled, tail
        self.run, self.function, self.packed = compiled.run, compiled.function, compiled.packed_metadata


class CachedLaunch:
    """A ``JITFunction`` launched through a cache of its compiled variants (module docstring). Attributes other than
    launching (``params``, ``fn``, ``do_not_specialize``, ...) are the wrapped function's."""

    def __init__(self, jit, *, current_device: Callable[[], int] | None = None,
                 current_stream: Callable[[int], Any] | None = None, hooks: Callable[[], tuple] | None = None) -> None:
        self.jit = jit
        params = list(jit.params)
        self._names = [p.name for p in params]
        self._runtime = frozenset(p.name for p in params if not p.is_constexpr)
        # per parameter position: how a positional argument there is keyed
        self._modes = tuple("value" if p.is_constexpr else
                            (not p.do_not_specialize, not p.do_not_specialize_on_alignment) for p in params)
        self._defaults = [p.default for p in params]
        self._launchers: dict = {}
        self._key_fns: dict = {}  # argument types -> generated key function (False: not keyable)
        self._current_device, self._current_stream, self._hooks = current_device, current_stream, hooks
        self._knobs = None
        self.verify = verify_default()
        self.num_cached = 0   # launches through the cache
        self.num_jit = 0      # launches through JITFunction.run

    def __getattr__(self, name: str):
        return getattr(self.jit, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _key(self, args: tuple, kwargs: dict):
        """The launch's key (module docstring, device aside), or None where it cannot be keyed."""
        types = tuple(map(type, args))
        fn = self._key_fns.get(types)
        if fn is None:
            fn = self._key_fns[types] = self._key_function(types)
        if fn is False or not self._runtime.isdisjoint(kwargs):
            return None  # an unkeyable type, or a runtime parameter by keyword (keyed by value: a variant per value)
        return (types, fn(*args), tuple(kwargs.items()))

    def _key_function(self, types: tuple):
        """A function of the positional arguments of ``types`` giving one key part per argument (module docstring;
        a constexpr: its value); False where some type cannot be keyed."""
        if len(types) > len(self._modes):
            return False
        parts = []
        for i, (t, mode) in enumerate(zip(types, self._modes)):
            a = f"a{i}"
            if mode == "value":
                parts.append(f"('v', {a})")
            elif t is int:
                rng = f"(0 if -2147483648 <= {a} < 2147483648 else 1 if -{2**63} <= {a} < {2**63} else 2) * 4"
                parts.append(f"{rng} + (1 if {a} == 1 else 2 if {a} & 15 == 0 else 0)" if mode[0] else f"{rng} + 3")
            elif t is bool:
                parts.append(f"'T' if {a} else 'F'")
            elif isinstance(t, type) and issubclass(t, torch.Tensor):
                parts.append(f"({a}.dtype, ({a}.data_ptr() & 15) == 0)" if mode[0] and mode[1] else f"({a}.dtype, None)")
            elif t is float:
                parts.append("'f'")
            elif t is _tensor_descriptor_type():  # Triton specialises a host descriptor by dtype and box
                parts.append(f"('d', {a}.base.dtype, tuple({a}.block_shape), getattr({a}, 'padding', None), "
                             f"getattr({a}, 'round_f32_to_tf32', None))")
            elif t is type(None):
                parts.append("None")
            else:
                return False
        names = ", ".join(f"a{i}" for i in range(len(types)))
        namespace: dict = {}
        body = f"({', '.join(parts)},)" if parts else "()"
        exec(f"def key({names}):\n    return {body}\n", namespace)
        return namespace["key"]

    def _tail(self, args: tuple, kwargs: dict) -> tuple:
        """The parameters after the positional ones, as JITFunction.run binds them (keyword, else default)."""
        n = len(args)
        return tuple(kwargs[name] if name in kwargs else self._defaults[n + i]
                     for i, name in enumerate(self._names[n:]))

    def launch(self, grid, args: tuple, kwargs: dict):
        if callable(grid) or getattr(self.jit, "pre_run_hooks", None):
            self.num_jit += 1
            return self.jit[grid](*args, **kwargs)
        device = self._device()
        key = self._key(args, kwargs)
        try:
            entry = self._launchers.get((device, key)) if key is not None else None
        except TypeError:  # an unhashable constexpr value
            key, entry = None, None
        if entry is None:
            self.num_jit += 1
            compiled = self.jit[grid](*args, **kwargs)
            if key is not None and compiled is not None and hasattr(compiled, "packed_metadata"):
                self._launchers[(device, key)] = _Entry(compiled, self._tail(args, kwargs))
            return compiled
        full = args + entry.tail
        if self.verify:
            chosen = self.jit.warmup(*args, grid=grid, **kwargs)
            if chosen is not entry.compiled:
                raise AssertionError(f"cached launch of {self.jit.fn.__name__}: key {key} maps to another compiled "
                                     "variant than the one Triton chooses")
        stream = self._stream(device)
        enter, leave = self._launch_hooks()
        compiled = entry.compiled
        meta = None if enter is None else compiled.launch_metadata(grid, stream, *full)
        n = len(grid)
        entry.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, entry.function, entry.packed,
                  meta, enter, leave, *full)
        self.num_cached += 1
        return compiled

    # ---- the CUDA runtime state a launch reads (Triton's driver by default; tests inject their own)

    def _device(self) -> int:
        if self._current_device is None:
            from triton.runtime import driver

            self._current_device = driver.active.get_current_device
            self._current_stream = driver.active.get_current_stream
        return self._current_device()

    def _stream(self, device: int):
        return self._current_stream(device)

    def _launch_hooks(self) -> tuple:
        if self._hooks is not None:
            return self._hooks()
        if self._knobs is None:
            from triton import knobs

            self._knobs = knobs.runtime
        return self._knobs.launch_enter_hook, self._knobs.launch_exit_hook


def _tensor_descriptor_type():
    """Triton's host ``TensorDescriptor`` class (TMA descriptors passed as kernel arguments), None without one."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - every Triton the project supports has it
        return None
    return TensorDescriptor


def cached_launch(jit):
    """Decorator above ``@triton.jit`` for a kernel launched from host code (module docstring); the interpreter's
    function (``TRITON_INTERPRET=1``) and ``LORAPLEX_FAST_LAUNCH=0`` leave the kernel as it is."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton always has it
        return jit
    if not enabled() or type(jit) is not JITFunction:
        return jit
    return CachedLaunch(jit)


def jit_function(kernel):
    """The ``JITFunction`` under a ``cached_launch`` kernel (for ``triton.compiler.ASTSource`` and other APIs that take
    Triton's own object); any other kernel as it is."""
    return kernel.jit if isinstance(kernel, CachedLaunch) else kernel
