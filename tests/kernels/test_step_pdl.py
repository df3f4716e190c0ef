"""A step's small kernels (norms, router, routing, alignment, rotary + KV write, paged attention, activation) as PDL
launches: built for sm_90 on the CPU (a child process without the interpreter), each carries the grid-dependency
wait with USE_PDL and none without it; nothing is stored before the wait (the kernel before may still be reading
the memory the caching allocator hands out again), and only weights are loaded before it. Early triggers only where
the kernel's grid is one small wave. The launchers ask for PDL only where ``step_pdl`` says so: never on the CPU or
under the interpreter, and not with ``LORAPLEX_STEP_PDL=0`` (read at import)."""

import os
import subprocess
import sys

import torch

from loraplex.kernels import slot_blocks
from tests.kernels.sm90_build import build_in_child
from tests.utils.scripts import ROOT

BUILD = r'''
import json, re, sys
sys.path.insert(0, "benchmarks/kernels")
from sm90_loops import build_sm90
from loraplex.kernels import activation, moe_align, moe_route, paged_attention, rms_norm, rms_norm_router, rotary

F32 = {**dict.fromkeys(("eps", "alpha", "limit", "scale_log2"), "fp32"),
       **dict.fromkeys(("cs_ptr", "weights_ptr", "part_m_ptr", "part_l_ptr", "part_acc_ptr", "sinks_ptr"), "*fp32")}
I32 = dict.fromkeys(("lora_ptr", "sorted_ptr", "expert_ids_ptr", "num_post_ptr", "counts_ptr", "offsets_ptr",
                     "lora_sorted_ptr", "lora_expert_ids_ptr", "lora_num_post_ptr", "lora_counts_ptr",
                     "lora_offsets_ptr", "bt_ptr", "seq_lens_ptr", "qsl_ptr"), "*i32")
I64 = dict.fromkeys(("ids_ptr", "pos_ptr", "slot_ptr"), "*i64")
TYPES = {**F32, **I32, **I64}
CASES = {  # kernel, constexprs, warps
    "rms_norm": (rms_norm._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK_H=4096), 16),
    "rms_norm_router": (rms_norm_router._rms_norm_router_kernel, dict(HAS_BIAS=True, BLOCK_H=4096, BLOCK_E=8), 16),
    "moe_route": (moe_route._moe_route_kernel, dict(TOP_K=4, SOFTMAX_FIRST=False, RENORMALIZE=False, BLOCK_E=32,
                                                   BLOCK_A=4), 1),
    "moe_align": (moe_align._moe_align_kernel, dict(TOP_K=4, HAS_LORA=True, BLOCK_SIZE=16, PAD_BLOCK=16,
                                                   BLOCK_E=64, BLOCK=1024), 4),
    "moe_align_pair": (moe_align._moe_align_pair_kernel, dict(TOP_K=4, BLOCK_SIZE=8, PAD_BLOCK=8, LORA_BLOCK_SIZE=16,
                                                             LORA_PAD_BLOCK=16, BLOCK_E=64, BLOCK=1024), 4),
    "rotary": (rotary._rotary_kernel, dict(BLOCK_H=8, BLOCK_HALF=32), 4),
    "rotary_cache": (rotary._rotary_cache_kernel, dict(ROW=512, HEAD_DIM=64, BLOCK_H=8, BLOCK_HALF=32,
                                                      BLOCK_ROW=512), 4),
    "paged_attention": (paged_attention._paged_attention_kernel, dict(
        HEAD_DIM=64, BLOCK_D=64, GROUP=8, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64, KV_BLOCK_SIZE=16, SEARCH_BLOCK=128,
        USE_WINDOW=True, SINK_IN_LOOP=False, SPLIT=True), 4),
    "merge_splits": (paged_attention._merge_splits_kernel, dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_S=16,
                                                                 USE_SINKS=True), 1),
    "act_and_mul": (activation._act_and_mul_kernel, dict(ACT=1, BLOCK=1024), 4),
}

def first(ptx, pattern):
    m = re.search(pattern, ptx)
    return m.start() if m else len(ptx)

out = {}
for name, (kernel, consts, warps) in CASES.items():
    on = build_sm90(kernel, {**consts, "USE_PDL": True}, TYPES, warps, 1).asm["ptx"]
    off = build_sm90(kernel, {**consts, "USE_PDL": False}, TYPES, warps, 1).asm["ptx"]
    wait = first(on, r"griddepcontrol\.wait")
    out[name] = {"waits": on.count("griddepcontrol.wait"), "triggers": on.count("griddepcontrol.launch_dependents"),
                 "without": off.count("griddepcontrol"), "stores_before_wait": first(on, r"\bst\.global") < wait,
                 "loads_before_wait": first(on, r"\bld\.global") < wait}
print("RESULT " + json.dumps(out))
'''

EARLY_TRIGGER = {"rms_norm", "rms_norm_router", "moe_route", "moe_align", "moe_align_pair", "rotary", "rotary_cache"}
WEIGHTS_FIRST = {"rms_norm", "rms_norm_router"}  # the norm's weight (and the router's rows) load before the wait


def test_step_kernels_build_for_sm90_with_the_wait_before_any_store():
    got = build_in_child(BUILD, timeout=600)
    assert set(got) == EARLY_TRIGGER | {"paged_attention", "merge_splits", "act_and_mul"}
    for name, b in got.items():
        assert b["waits"] >= 1 and b["without"] == 0, (name, b)
        assert not b["stores_before_wait"], (name, b)
        assert (b["triggers"] >= 1) == (name in EARLY_TRIGGER), (name, b)
        assert b["loads_before_wait"] == (name in WEIGHTS_FIRST), (name, b)


def test_step_pdl_off_on_cpu_and_by_switch(monkeypatch):
    assert not slot_blocks.step_pdl(torch.device("cpu"))
    monkeypatch.setattr(slot_blocks, "pdl_enabled", lambda device: True)  # as on an sm_90 GPU
    monkeypatch.setattr(slot_blocks, "STEP_PDL", True)
    assert slot_blocks.step_pdl(torch.device("cpu"))
    monkeypatch.setattr(slot_blocks, "STEP_PDL", False)  # LORAPLEX_STEP_PDL=0
    assert not slot_blocks.step_pdl(torch.device("cpu"))


def test_the_switch_is_read_from_the_environment():
    """``LORAPLEX_STEP_PDL=0`` in a fresh process turns the launches plain; unset, they are PDL launches."""
    code = "from loraplex.kernels import slot_blocks; print(slot_blocks.STEP_PDL)"
    for value, want in (("0", "False"), (None, "True")):
        env = {k: v for k, v in os.environ.items() if k != "LORAPLEX_STEP_PDL"}
        if value is not None:
            env["LORAPLEX_STEP_PDL"] = value
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == want, (value, out.stdout, out.stderr[-2000:])


class _Recorder:
    """Stands for a kernel: records each launch's keyword arguments instead of running it."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


def test_launchers_ask_for_pdl_exactly_when_the_kernel_waits(monkeypatch):
    """A kernel launched with PDL but compiled without its wait would read before the kernel before it is done:
    every step launcher passes ``launch_pdl`` if and only if USE_PDL, and both follow ``step_pdl``."""
    from loraplex.kernels import activation, moe_align, moe_route, paged_attention, rms_norm, rms_norm_router, rotary

    kernels = {(rms_norm, "_rms_norm_kernel"), (rms_norm_router, "_rms_norm_router_kernel"),
               (moe_route, "_moe_route_kernel"), (moe_align, "_moe_align_kernel"),
               (moe_align, "_moe_align_pair_kernel"), (rotary, "_rotary_kernel"), (rotary, "_rotary_cache_kernel"),
               (paged_attention, "_paged_attention_kernel"), (paged_attention, "_merge_splits_kernel"),
               (activation, "_act_and_mul_kernel")}
    x, w = torch.randn(3, 64), torch.ones(64)
    calls = {
        "rms_norm": lambda: rms_norm.rms_norm(x, w, 1e-6, x),
        "rms_norm_router": lambda: rms_norm_router.rms_norm_router(x, w, 1e-6, x, torch.randn(8, 64), None),
        "moe_route": lambda: moe_route.moe_route(torch.randn(3, 8), 2, scoring="softmax", renormalize=True),
        "moe_align": lambda: moe_align.moe_align(torch.tensor([[0, 1], [1, 2], [3, 0]]), 4, 4),
        "moe_align_pair": lambda: moe_align.moe_align_pair(torch.tensor([[0, 1], [1, 2], [3, 0]]),
                                                           torch.tensor([0, -1, 1], dtype=torch.int32), 4, 2, 4, 4),
        "rotary": lambda: rotary.rotary_embedding(torch.arange(3), torch.randn(3, 4, 8), torch.randn(3, 2, 8),
                                                  torch.randn(16, 8)),
        "rotary_cache": lambda: rotary.rotary_embedding_and_cache(
            torch.arange(3), torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(16, 8),
            torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8), torch.arange(3)),
        "paged_attention": lambda: paged_attention.paged_attention(
            torch.randn(2, 4, 8), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8),
            torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32),
            torch.tensor([0, 1, 2], dtype=torch.int32), 0.3, num_splits=2),
        "act_and_mul": lambda: activation.silu_and_mul(torch.randn(3, 16)),
    }
    for pdl in (False, True):
        monkeypatch.setattr(slot_blocks, "pdl_enabled", lambda device, pdl=pdl: pdl)
        recorders = {}
        for module, name in kernels:
            recorders[name] = _Recorder()
            monkeypatch.setattr(module, name, recorders[name])
        for call in calls.values():
            call()
        launched = {name: r.launches for name, r in recorders.items()}
        assert all(len(v) >= 1 for v in launched.values()), {k: len(v) for k, v in launched.items()}
        for name, launches in launched.items():
            for kw in launches:
                assert kw["USE_PDL"] is pdl and kw.get("launch_pdl", False) is pdl, (name, kw)


def test_no_pdl_on_a_rocm_build(monkeypatch):
    """MI300's capability reads (9, 4) under ROCm, which has no grid-dependency control."""
    slot_blocks._sm90_or_later.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    try:
        assert not slot_blocks._sm90_or_later(0)
        monkeypatch.setattr(torch.version, "hip", None)
        slot_blocks._sm90_or_later.cache_clear()
        assert slot_blocks._sm90_or_later(0)  # an H100 / H200
    finally:
        slot_blocks._sm90_or_later.cache_clear()
