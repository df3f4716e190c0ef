"""benchmarks/engine/probe_arrival_host.py on the CPU (tiny model): both phases report their arrivals, each arrival's
steps end with its first token, and the sections show the LoRA path only where adapters run."""
from __future__ import annotations

import json

import pytest

from tests.utils.scripts import load_script

probe = load_script("engine", "probe_arrival_host")


def test_probe_reports_both_phases_by_section(tmp_path):
    from loraplex.engine.lora import layers

    forwards = (layers.LoRALinear.forward, layers.LoRAFusedExperts.forward)
    out = tmp_path / "out"
    rc = probe.main(["--scale", "tiny", "--device", "cpu", "--concurrency", "3", "--num-adapters", "2",
                     "--adapter-files", "2", "--rank", "4", "--prompt-len", "20", "--arrivals", "3", "--skip", "1",
                     "--profile", "5", "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "probe_arrival_host.json").read_text())
    rows = report["rows"]
    # arrivals 1 and 2 of each phase (0 skipped), each served as in flight and after a sync
    assert [(r["phase"], r["arrival"], r["after_sync"]) for r in rows] == [
        (phase, a, synced) for phase in ("base", "adapters") for a in (1, 2) for synced in (False, True)]
    for r in rows:
        assert r["steps_ms"] and all(ms > 0 for ms in r["steps_ms"])
        sections = r["sections"]
        calls, ms = sections["model.forward"]
        assert calls == len(r["steps_ms"]) and 0 < ms <= sum(r["steps_ms"])
        assert sections["schedule"][0] == len(r["steps_ms"])
        # the tiny model's attention and expert modules are the LoRA wrappers in both phases
        assert sections["LoRALinear.forward"][0] > 0 and sections["LoRAFusedExperts.forward"][0] > 0
        # the step's LoRA table is written only when a scheduled sequence has an adapter
        assert ("step_table.write" in sections) == (r["phase"] == "adapters")
    # --profile 5: each phase's five functions with the most own time, slowest first
    for phase in ("base", "adapters"):
        top = report["profile"][phase]
        assert len(top) == 5 and all(calls > 0 and 0 <= own <= cum for _, calls, own, cum in top)
        assert [own for _, _, own, _ in top] == sorted((own for _, _, own, _ in top), reverse=True)
    assert any("lora" in name for name, *_ in report["profile"]["adapters"])
    # the timed class methods are put back: later engines in this process run untimed
    assert (layers.LoRALinear.forward, layers.LoRAFusedExperts.forward) == forwards


def _run_emulated(tmp_path, *extra: str) -> dict:
    """The probe with --emulate-launches in a fresh interpreter without TRITON_INTERPRET (the kernel tests set it
    for this process, and emulation needs Triton's JIT functions)."""
    import os
    import subprocess
    import sys

    from tests.utils.scripts import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "engine", "probe_arrival_host.py"), "--emulate-launches",
         "--concurrency", "3", "--num-adapters", "2", "--adapter-files", "2", "--rank", "4", "--prompt-len", "24",
         "--arrivals", "2", "--skip", "1", "--work-dir", str(tmp_path / "work"), "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "probe_arrival_host.json").read_text())


def test_emulated_launches_count_the_cuda_paths_launches(tmp_path):
    """On a CPU, --emulate-launches runs the CUDA path's launchers at GPT-OSS-20B's depth (24 layers, 32 experts)
    with MXFP4 experts in the kernel layout: every layer launches the same kernels, the expert layers with LoRA
    make both alignments in one launch, and the dense and expert LoRA kernels run only where adapters do. The host
    scale's widths have no tuned MXFP4 config, so the default's row blocks decide whether the expert LoRA expands
    are launches of their own or ride in the GEMMs' epilogues."""
    from loraplex.kernels import fused_moe_mxfp4, moe_experts_lora, rms_norm_router

    report = _run_emulated(tmp_path, "--quantization", "mxfp4")
    assert report["device"] == "cpu, launches emulated" and report["args"]["scale"] == "host"
    per_layer = {"_rotary_cache_kernel", "_paged_attention_kernel", "_moe_route_kernel",
                 "_gate_up_kernel", "_down_kernel"}
    in_epilogue = fused_moe_mxfp4.DEFAULT_CONFIG["BLOCK_M"] <= moe_experts_lora.EPILOGUE_MAX_BLOCK_M
    lora = {"_lora_shrink_kernel", "_lora_expand_kernel", "_moe_lora_shrink_kernel"}
    if not in_epilogue:
        lora.add("_moe_lora_expand_kernel")
    for row in report["rows"]:
        by_kernel = row["launches"]["by_kernel"]
        assert sum(by_kernel.values()) == row["launches"]["total"] > 0
        # each layer's input norm and the final norm; the MoE layer's norm takes the router with it (an arrival
        # step here is a 24-token prompt beside 2 decodes, within rms_norm_router.MAX_TOKENS)
        assert 24 + 2 <= rms_norm_router.MAX_TOKENS
        assert by_kernel["_rms_norm_kernel"] == 24 + 1 and by_kernel["_rms_norm_router_kernel"] == 24, by_kernel
        assert all(by_kernel[k] == 24 for k in per_layer), by_kernel
        if row["phase"] == "base":
            assert by_kernel["_moe_align_kernel"] == 24 and not lora & set(by_kernel)
            assert "_moe_align_pair_kernel" not in by_kernel
        else:  # q/k/v and o: a shrink and an expand each; gate_up and down: the same, over (slot, expert) pairs
            assert all(by_kernel[k] == 48 for k in lora), by_kernel
            assert in_epilogue == ("_moe_lora_expand_kernel" not in by_kernel), by_kernel
            assert by_kernel["_moe_align_pair_kernel"] == 24
            assert by_kernel["_moe_align_kernel"] == 1  # the step's tokens grouped by slot, once (lora_segments)
        sections = row["sections"]
        assert sections["cached launch"][0] + sections.get("triton launch", [0])[0] == row["launches"]["total"]
        assert sections["model.forward"][0] == len(row["steps_ms"])


def test_emulation_refuses_the_interpreter(monkeypatch):
    from loraplex.bench import host_emulation

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="unset TRITON_INTERPRET"):
        with host_emulation.emulated_launches():
            pass
