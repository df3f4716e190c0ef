"""benchmarks/engine/probe_arrival_host.py on the CPU (tiny model): both phases report their arrivals, each arrival's
steps end with its first token, and the sections show the LoRA path only where adapters run."""
from __future__ import annotations

import json

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
