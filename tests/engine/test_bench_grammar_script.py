"""benchmarks/engine/bench_grammar.py at its smallest: llguidance on the tiny models' 320-id vocabulary and a 1,100-id
synthetic BPE (``grammar_vocab.py``), batches 1 and 3; xgrammar, not a dependency, is reported as not installed.
Every suite schema compiles and its random constrained walks validate, every unsupported keyword is refused by
name, the timings are positive, rollback restores the mask, and the table shows it."""
from __future__ import annotations

import importlib.util
import json
import math

import torch

from tests.utils.scripts import load_script

bench = load_script("engine", "bench_grammar")


def test_llguidance_on_both_vocabularies(tmp_path, monkeypatch, capsys):
    from loraplex.engine.structured.schema_suite import SCHEMAS, UNSUPPORTED

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    threads = torch.get_num_threads()
    try:  # the script pins torch to one thread
        bench.main(["--libs", "llguidance", "xgrammar", "--vocabs", "320", "1100", "--batches", "1", "3",
                    "--steps", "4"])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "out" / "bench_grammar.json").read_text())
    assert sorted(report["vocabs"]) == ["1100", "320"]
    for vocab, results in report["vocabs"].items():
        if importlib.util.find_spec("xgrammar") is None:
            assert results["xgrammar"]["error"].startswith("not installed")
        res = results["llguidance"]
        assert res["coverage"] == {**{name: "3/3 valid" for name in SCHEMAS},
                                   **{f"unsupported:{name}": "refused, names it" for name in UNSUPPORTED}}
        times = [res["tokenizer_ms"], res["compile_ms_median"], res["compile_ms_max"], res["first_mask_ms_median"],
                 res["fork_us_median"], res["rollback4_us_median"]]
        for b in (1, 3):
            times += res[f"batch_{b}"].values()
        assert all(math.isfinite(t) and t > 0 for t in times), res
        assert res["compile_ms_median"] <= res["compile_ms_max"]
        assert res["rollback_restores_mask"] is True
    table = capsys.readouterr().out
    assert "vocabulary 320" in table and "vocabulary 1100" in table
    assert table.count(f"| suite schemas valid (3 walks each) | {len(SCHEMAS)}/{len(SCHEMAS)} |") == 2
    assert table.count(f"| unsupported keywords refused by name | {len(UNSUPPORTED)}/{len(UNSUPPORTED)} |") == 2
    assert table.count('not clean: {"llguidance": {}}') == 2
