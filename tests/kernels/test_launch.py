"""kernels/launch.py: a cached launch runs the compiled variant Triton's own dispatch would run, with the arguments
it would pass, and anything it cannot key goes through the JIT.

1. The key of one argument is at least as fine as Triton's specialisation of it (``native_specialize_impl``, the
   function Triton's binder calls): two arguments with one key are specialised alike, over integers at the type and
   divisibility edges, bools, floats, None and tensors of several dtypes at aligned and unaligned addresses, for
   specialised, unspecialised and alignment-free parameters. Step-varying integers (``do_not_specialize``) share one
   key across values, so they never leave the cache.
2. ``CachedLaunch`` over a stand-in JIT function (no GPU here): the first launch of a key goes through the JIT, the
   next ones call the compiled launcher with the grid, the stream and Triton's bound arguments (positional, then
   keywords and defaults in parameter order); a new specialisation, dtype, alignment, constexpr, launch option or
   device goes through the JIT again; runtime parameters by keyword, callable grids and unkeyable types always do;
   verification mode catches a key that maps to another variant.
"""
from __future__ import annotations

import inspect
import random

import numpy
import pytest
import torch

from loraplex.kernels import launch
from loraplex.kernels.launch import CachedLaunch, cached_launch, jit_function


def _triton_spec(a, specialize: bool, align: bool):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, a, False, specialize, align)


def _arg_pool() -> list:
    ints = [0, 1, 2, 3, 15, 16, 17, 31, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31,
            -2**31 - 1, 2**40, 2**40 + 3, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16]
    rng = random.Random(0)
    ints += [rng.randrange(-2**40, 2**40) for _ in range(40)] + [16 * rng.randrange(1, 10**6) for _ in range(20)]
    tensors = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8):
        base = torch.zeros(64, dtype=dtype)
        tensors += [base, base[1:], base[2:], base[8:], base[16:]]
    return ints + [True, False, 0.5, 1.0, 16.0, None] + tensors + _descriptors()


def _descriptors() -> list:
    """Host TMA descriptors: several dtypes, ranks and boxes, over aligned tensors of different shapes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = []
    for dtype in (torch.int32, torch.bfloat16, torch.float32):
        for shape, boxes in (((64, 64), ([16, 32], [32, 16], [16, 16])),
                             ((2, 2, 8, 8, 32), ([1, 2, 4, 4, 32], [1, 1, 4, 4, 32])),
                             ((3, 2, 8, 64), ([1, 2, 4, 8], [1, 1, 8, 8]))):
            t = torch.zeros(shape, dtype=dtype)
            out += [TensorDescriptor.from_tensor(t, box) for box in boxes]
            out.append(TensorDescriptor.from_tensor(torch.zeros((shape[0] + 1,) + shape[1:], dtype=dtype), boxes[0]))
    return out


def _key_of(a, specialize: bool = True, align: bool = True):
    """The cached launch's key of ``a`` as the one argument of a kernel with those specialisation flags."""
    def one(x):
        pass

    jit = _FakeJit(one, do_not_specialize=[] if specialize else ["x"],
                   do_not_specialize_on_alignment=[] if align else ["x"])
    return CachedLaunch(jit, current_device=lambda: 0, current_stream=lambda d: 0, hooks=lambda: (None, None))._key(
        (a,), {})


@pytest.mark.parametrize("specialize,align", [(True, True), (False, True), (True, False)])
def test_one_key_means_one_triton_specialisation(specialize, align):
    pool = _arg_pool()
    seen: dict = {}
    for a in pool:
        k = _key_of(a, specialize, align)
        assert k is not None
        spec = _triton_spec(a, specialize, align)
        if k in seen:
            assert seen[k][1] == spec, f"{a!r} and {seen[k][0]!r} share key {k} but Triton specialises them as " \
                                       f"{spec} and {seen[k][1]}"
        else:
            seen[k] = (a, spec)
    if align:  # the key is not needlessly fine: no more classes than Triton's plus the two values of bools
        assert len(seen) <= len({_triton_spec(a, specialize, align) for a in pool}) + 2


def test_step_varying_integers_share_one_key():
    values = [1, 2, 16, 17, 100, 4096, 2**31 - 1]
    assert len({_key_of(v, specialize=False) for v in values}) == 1
    assert len({_key_of(v) for v in values}) == 3  # 1, divisible by 16, other
    assert _key_of(object()) is None  # an unknown type: the JIT path
    assert _key_of(numpy.float64(2.0)) is None  # a float subclass is not a float


# ---- CachedLaunch over a stand-in JIT function


class _Param:
    def __init__(self, p: inspect.Parameter, dns: set[str], dnsa: set[str]) -> None:
        self.name, self._p = p.name, p
        self.is_constexpr = "constexpr" in str(p.annotation)
        self.do_not_specialize, self.do_not_specialize_on_alignment = p.name in dns, p.name in dnsa

    @property
    def default(self):
        return self._p.default


class _Compiled:
    """A compiled variant: ``run`` records launches as Triton's CudaLauncher receives them."""

    def __init__(self, jit: "_FakeJit", key) -> None:
        self.jit, self.key = jit, key
        self.function, self.packed_metadata = object(), object()

    def run(self, *launch_args):
        self.jit.log.append(("cached", self, launch_args))

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream)


class _FakeJit:
    """Binds like JITFunction.run: specialisation by Triton's own function, one compiled variant per key."""

    def __init__(self, fn, do_not_specialize=(), do_not_specialize_on_alignment=()) -> None:
        self.fn = fn
        self.signature = inspect.signature(fn)
        self.params = [_Param(p, set(do_not_specialize), set(do_not_specialize_on_alignment))
                       for p in self.signature.parameters.values()]
        self.variants: dict = {}
        self.log: list = []
        self.device = 0
        self.pre_run_hooks: list = []

    def _bind(self, args, kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in ("num_warps", "num_stages")}
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        spec = tuple(("constexpr", v) if p.is_constexpr else
                     _triton_spec(v, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                     for p, v in zip(self.params, bound.arguments.values()))
        return bound, (self.device, spec, tuple(sorted(options.items())))

    def warmup(self, *args, grid, **kwargs):
        _, key = self._bind(args, dict(kwargs))
        return self.variants.setdefault(key, _Compiled(self, key))

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            bound, key = self._bind(args, dict(kwargs))
            compiled = self.variants.setdefault(key, _Compiled(self, key))
            self.log.append(("jit", compiled, tuple(bound.arguments.values())))
            return compiled
        return run


def _kernel(x_ptr, y_ptr, n, m, BLOCK: "constexpr", EVEN: "constexpr" = True, scale=1.0):
    pass


def _make(**kw):
    jit = _FakeJit(_kernel, do_not_specialize=["m"])
    cached = CachedLaunch(jit, current_device=lambda: jit.device, current_stream=lambda d: f"stream{d}",
                          hooks=lambda: ("enter", "leave"))
    return jit, cached


def test_second_launch_of_a_key_calls_the_compiled_launcher_with_tritons_arguments():
    jit, k = _make()
    x, y = torch.zeros(32, dtype=torch.bfloat16), torch.zeros(32)
    first = k[(3, 2)](x, y, 17, 5, BLOCK=64, num_warps=4)
    second = k[(7,)](x, y, 33, 9, BLOCK=64, num_warps=4)  # 33, 17: same class; m is not specialised
    assert [e[0] for e in jit.log] == ["jit", "cached"] and first is second
    _, compiled, launch_args = jit.log[1]
    g0, g1, g2, stream, function, packed, meta, enter, leave, *args = launch_args
    assert (g0, g1, g2, stream, enter, leave) == (7, 1, 1, "stream0", "enter", "leave")
    assert function is compiled.function and packed is compiled.packed_metadata and meta == ("meta", (7,), "stream0")
    bound, _ = jit._bind((x, y, 33, 9), {"BLOCK": 64})
    assert tuple(args) == tuple(bound.arguments.values()) == (x, y, 33, 9, 64, True, 1.0)
    assert (k.num_jit, k.num_cached) == (1, 1)


@pytest.mark.parametrize("change", ["int class", "dtype", "alignment", "constexpr", "default constexpr", "option",
                                    "device"])
def test_a_new_specialisation_goes_through_the_jit(change):
    jit, k = _make()
    x, y = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64)
    call = dict(args=(x, y, 17, 5), kwargs=dict(BLOCK=64, num_warps=4))
    k[(1,)](*call["args"], **call["kwargs"])
    args, kwargs = list(call["args"]), dict(call["kwargs"])
    if change == "int class":
        args[2] = 32
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "alignment":
        args[0] = x[1:]
    elif change == "constexpr":
        kwargs["BLOCK"] = 128
    elif change == "default constexpr":
        kwargs["EVEN"] = False
    elif change == "option":
        kwargs["num_warps"] = 8
    else:
        jit.device = 1
    k[(1,)](*args, **kwargs)
    assert [e[0] for e in jit.log] == ["jit", "jit"]
    assert jit.log[0][1] is not jit.log[1][1]  # Triton chose another variant too
    k[(1,)](*args, **kwargs)
    assert jit.log[-1][0] == "cached" and jit.log[-1][1] is jit.log[1][1]


@pytest.mark.parametrize("case", ["runtime keyword", "callable grid", "unkeyable type", "pre-run hook"])
def test_calls_it_cannot_key_always_go_through_the_jit(case):
    jit, k = _make()
    x, y = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64)
    for _ in range(3):
        if case == "runtime keyword":
            k[(1,)](x, y, 17, m=5, BLOCK=64)
        elif case == "callable grid":
            k[lambda meta: (1,)](x, y, 17, 5, BLOCK=64)
        elif case == "unkeyable type":
            k[(1,)](x, y, 17, 5, 64, True, numpy.float64(2.0))  # a float subclass: not keyed
        else:
            jit.pre_run_hooks = [lambda *a, **kw: None]
            k[(1,)](x, y, 17, 5, BLOCK=64)
    assert [e[0] for e in jit.log] == ["jit"] * 3 and k.num_cached == 0


def test_keys_over_random_calls_always_pick_tritons_variant():
    """Random argument mixes: every launch (cached or not) runs the variant Triton's binder picks for it."""
    jit, k = _make()
    k.verify = True
    rng = random.Random(1)
    base = {dt: torch.zeros(80, dtype=dt) for dt in (torch.bfloat16, torch.float32)}
    for _ in range(300):
        x = base[rng.choice(list(base))][rng.choice([0, 1, 8, 16]):]
        n, m = rng.choice([1, 2, 16, 17, 32, 2**31, 2**31 + 16]), rng.randrange(1, 4096)
        kwargs = {"BLOCK": rng.choice([32, 64])}
        if rng.random() < 0.3:
            kwargs["EVEN"] = rng.random() < 0.5
        k[(rng.randrange(1, 9),)](x, base[torch.float32], n, m, **kwargs)
        assert jit.log[-1][1] is jit.variants[jit._bind((x, base[torch.float32], n, m), dict(kwargs))[1]]
    assert k.num_cached > 200  # most launches skipped the JIT


def test_verification_catches_a_key_that_maps_to_another_variant():
    jit, k = _make()
    k.verify = True
    x, y = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64)
    k[(1,)](x, y, 17, 5, BLOCK=64)
    k[(1,)](x, y, 17, 5, BLOCK=64)
    jit.variants.clear()  # Triton would now pick (build) another variant for the same call
    with pytest.raises(AssertionError, match="another compiled variant"):
        k[(1,)](x, y, 17, 5, BLOCK=64)


def test_the_decorator_keeps_kernels_it_cannot_cache():
    """Interpreted kernels (``TRITON_INTERPRET=1``, as in these tests) and anything but a JITFunction are returned
    unchanged; ``jit_function`` gives Triton's object under a cached kernel."""
    from loraplex.kernels import lora_shrink

    assert not isinstance(lora_shrink._lora_shrink_kernel, CachedLaunch)
    obj = object()
    assert cached_launch(obj) is obj and jit_function(obj) is obj
    jit, k = _make()
    assert jit_function(k) is jit and k.params is jit.params and k.fn is _kernel


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("LORAPLEX_FAST_LAUNCH", "0")
    assert not launch.enabled()
    monkeypatch.setenv("LORAPLEX_FAST_LAUNCH", "1")
    assert launch.enabled()
    monkeypatch.setenv("LORAPLEX_FAST_LAUNCH_VERIFY", "1")
    assert _make()[1].verify


def test_launch_overhead_benchmark_refuses_without_a_gpu(tmp_path):
    """benchmarks/kernels/launch_overhead_gpu.py times real launches: on a machine without CUDA it says so and writes
    nothing."""
    from tests.utils.scripts import load_script

    script = load_script("kernels", "launch_overhead_gpu")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        script.main(["--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_tma_descriptor_arguments_are_cached_per_dtype_and_box():
    """A host TensorDescriptor in a pointer's place (the TMA configs): a second descriptor of the same dtype and box
    (other tensor, other shape) reuses the compiled variant and reaches the launcher as it is; another box or dtype
    goes through the JIT."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    jit, k = _make()
    y = torch.zeros(64)
    desc = lambda t, box: TensorDescriptor.from_tensor(t, box)  # noqa: E731
    a = desc(torch.zeros(4, 64, dtype=torch.int32), [2, 32])
    b = desc(torch.zeros(8, 128, dtype=torch.int32), [2, 32])
    k[(1,)](a, y, 17, 5, BLOCK=64)
    k[(2,)](b, y, 17, 5, BLOCK=64)
    assert [e[0] for e in jit.log] == ["jit", "cached"] and jit.log[1][2][9] is b
    k[(1,)](desc(torch.zeros(8, 128, dtype=torch.int32), [4, 32]), y, 17, 5, BLOCK=64)
    k[(1,)](desc(torch.zeros(8, 128, dtype=torch.float32), [2, 32]), y, 17, 5, BLOCK=64)
    assert [e[0] for e in jit.log] == ["jit", "cached", "jit", "jit"]
    assert len({id(e[1]) for e in jit.log}) == 3  # Triton chose a variant per box and dtype too
