"""benchmarks/engine/check_adapter_pool_gpu.py's smoke run (``--device cpu --scale tiny``): the kernels stage in this
process (the LoRA launchers through the Triton interpreter against the torch references, mixed ranks, an empty
slot, base tokens, a table rewritten under a captured call), and the engine stage through the script's driver (a
worker subprocess, its RESULT_JSON line, the summary and the JSON file): a graph-path step after a load into a new
slot equals the eager step and moves the adapter's rows; side-stream and synchronous loads time real steps."""
from __future__ import annotations

import argparse
import json
import math

from tests.utils.scripts import load_script

pool = load_script("engine", "check_adapter_pool_gpu")


def test_kernels_stage_through_the_interpreter(monkeypatch, capsys):
    monkeypatch.setattr(pool, "DEVICE", "cpu")
    monkeypatch.setattr(pool, "SLICES", pool.SLICES)  # the tiny scale rebinds the dense widths
    monkeypatch.setattr(pool, "O_K", pool.O_K)
    res = pool.stage_kernels(argparse.Namespace(scale="tiny"))
    names = [f"{op} M={m}" for m in (1, 16, 33) for op in ("lora_shrink+expand[qkv]", "lora_shrink+expand[o]",
                                                            "fused_moe_lora[gate_up]", "fused_moe_lora[down]",
                                                            "moe_experts_lora")]
    assert list(res["errors"]) == names + ["graph replay after a table rewrite"]
    # float32 on the CPU: the kernels agree with the references to rounding, far inside the bf16 bound (an op may
    # match exactly: the interpreter's numpy products can round as torch's do); not all exactly, or the comparison
    # would be of one tensor with itself
    assert all(err < 1e-5 for err in res["errors"].values()), res["errors"]
    assert sum(err > 0 for err in res["errors"].values()) >= len(names) // 2, res["errors"]
    assert res["ok"] is True and res["timing_us"] == {} and len(res["lines"]) == len(names) + 1
    pool.print_summary([res])
    out = capsys.readouterr().out
    assert out.count("\n  ok   ") == len(names) + 1 and "PASS kernels" in out and "FAIL" not in out


def test_engine_stage_through_the_driver(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert pool.main(["--stages", "engine", "--device", "cpu", "--scale", "tiny", "--steps", "2",
                      "--prompt-len", "8"]) == 0
    (res,) = json.loads((tmp_path / "check_adapter_pool_gpu.json").read_text())
    assert res["stage"] == "engine" and res["ok"] is True and res["wall_s"] > 0
    replay = res["replay_after_load"]
    assert replay["replayed"] == 1 and replay["rel_err_graph_vs_eager"] <= pool.TOL_GRAPH
    assert replay["new_slot_changes_rows"] > 1e-2
    load = res["load_overlap"]
    assert load["steps"] == 2 and len(load["during_copy_step_ms"]) == 2
    assert 0 < load["step_ms_p50"] <= load["step_ms_max"] and load["sync_load_step_ms"] > 0
    assert load["copy_ms"] is None or (math.isfinite(load["copy_ms"]) and load["copy_ms"] >= 0)
    out = capsys.readouterr().out
    assert "replay after a load into a new slot" in out and out.rstrip().endswith("PASS engine")
