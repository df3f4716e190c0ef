"""The JIT compile watch: counts and times compiles through Triton's hooks, keeps the hooks set before it, and
reports a window's compiles (the serving benchmark's "kernel compiles" note)."""
import triton

from loraplex.bench.report import compiles_note
from loraplex.kernels import compile_watch
from loraplex.kernels.compile_watch import CompileWatch


class _Fn:
    def __init__(self, name):
        self.name = name


def _compile(pre, post, name, key):
    skipped = pre(key=key, fn=_Fn(name), repr=name, compile={}, is_manual_warmup=False, already_compiled=False)
    if not skipped:
        post(key=key, fn=_Fn(name), repr=name, compile={}, is_manual_warmup=False, already_compiled=False)
    return skipped


def test_counts_compiles_per_kernel_and_keeps_the_previous_hooks():
    calls = []
    watch = CompileWatch()
    pre = watch.pre_hook(lambda **kw: calls.append(("pre", kw["fn"].name)) or (kw["key"] == "skip"))
    post = watch.post_hook(lambda **kw: calls.append(("post", kw["fn"].name)))
    before = watch.snapshot()
    _compile(pre, post, "_expand", "a")
    _compile(pre, post, "_expand", "b")
    _compile(pre, post, "_shrink", "c")
    assert _compile(pre, post, "_shrink", "skip")  # the previous hook's "skip this compile" is passed on
    delta = watch.since(before)
    assert delta["compiles"] == 3 and delta["kernels"] == {"_expand": 2, "_shrink": 1} and delta["seconds"] >= 0
    assert calls[:2] == [("pre", "_expand"), ("post", "_expand")] and len(calls) == 7
    mid = watch.snapshot()
    assert watch.since(mid) == {"compiles": 0, "seconds": 0.0, "kernels": {}, "variants": []}
    assert delta["variants"] == ["_expand", "_expand", "_shrink"]  # Triton's repr of each compile


def test_install_chains_onto_tritons_hooks_once():
    watch = compile_watch.install()
    assert watch is not None and compile_watch.install() is watch
    runtime = triton.knobs.runtime
    before = watch.snapshot()
    _compile(runtime.jit_cache_hook, runtime.jit_post_compile_hook, "_moe_lora_expand_kernel", "k1")
    assert watch.since(before)["kernels"] == {"_moe_lora_expand_kernel": 1}


def test_report_note_names_compiles_inside_a_run():
    assert compiles_note({"kernel_compiles": {"compiles": 2, "seconds": 3.14, "kernels": {"k": 2}}}) == \
        "2 kernel compiles (3.1 s)"
    assert compiles_note({"kernel_compiles": {"compiles": 0, "seconds": 0.0, "kernels": {}}}) == ""
    assert compiles_note({"kernel_compiles": None}) == compiles_note({}) == ""
