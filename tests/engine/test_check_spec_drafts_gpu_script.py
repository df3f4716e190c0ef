"""benchmarks/engine/check_spec_drafts_gpu.py with ``--device cpu`` on tiny llama: the draft LoRAs propose what
transformers + PEFT propose, and every speculative setup (per-adapter drafts with eager and padded-graph verify
steps, an EAGLE head, an EAGLE-3 draft) gives the non-speculative greedy tokens with every KV block freed; its work
folder is removed at the end."""
from __future__ import annotations

import json
import tempfile

from tests.utils.scripts import load_script

check = load_script("engine", "check_spec_drafts_gpu")


def test_every_case_passes_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the script's work folder goes
    (tmp_path / "tmp").mkdir()
    assert check.main(["--device", "cpu", "--families", "llama", "--out", str(tmp_path / "out")]) == 0
    # the work folder (checkpoints, adapters) is removed; torch may leave its own cache folder there
    assert not [p for p in (tmp_path / "tmp").iterdir() if p.name.startswith("spec-drafts-")]
    report = json.loads((tmp_path / "out" / "check_spec_drafts_gpu.json").read_text())
    assert report["env"]["device"] == "cpu"
    cases = {c["case"]: c for c in report["results"]}
    assert list(cases) == ["proposals", "lossless per-adapter drafts, eager verify",
                           "lossless per-adapter drafts, verify graphs", "lossless EAGLE head",
                           "lossless EAGLE-3 draft, eager", "lossless EAGLE-3 draft, verify graphs"]
    assert all(c["ok"] is True and c["family"] == "llama" and c["kv_free"] is True for c in cases.values())
    assert cases["proposals"]["first"] is True and cases["proposals"]["second"] is True
    for name, c in cases.items():
        if name == "proposals":
            continue
        assert c["identical"] is True and c["proposed"] > 0 and 0 <= c["accepted"] <= c["proposed"], c
        assert (c["graph_steps"] > 0) == name.endswith("verify graphs"), c
    out = capsys.readouterr().out
    assert out.count("PASS llama") == len(cases) and "FAIL" not in out
