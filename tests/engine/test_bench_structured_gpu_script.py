"""benchmarks/engine/bench_structured_gpu.py's smoke run (``--scale tiny --device cpu``) at its smallest: the three
variants decode every request to its length, the constrained outputs stay in their grammars, only the constrained
variants fill masks, the grammar cache and the suite's compile times are reported, the JSON is written."""
from __future__ import annotations

import json
import math

from tests.utils.scripts import load_script

bench = load_script("engine", "bench_structured_gpu")


def test_tiny_cpu_run(tmp_path, monkeypatch, capsys):
    from loraplex.engine.structured.schema_suite import SCHEMAS

    monkeypatch.setenv("OUT", str(tmp_path))
    bench.main(["--scale", "tiny", "--device", "cpu", "--concurrency", "2", "--adapters", "2", "--rank", "4",
                "--requests", "2", "--warmup", "1", "--input-len", "8", "--output-len", "6", "--fill-threads", "2"])
    report = json.loads((tmp_path / "bench_structured_gpu.json").read_text())
    assert report["llguidance"] and "gpu" not in report and report["tokenizer_build_s"] > 0
    rows = {r["variant"]: r for r in report["variants"]}
    assert list(rows) == ["free", "half", "half_pool"]
    for name, r in rows.items():
        assert r["num_errors"] == 0 and r["errors"] == [], r
        assert r["requests"] == 2 and r["steps"] >= 6, r
        assert 0 < r["tpot_ms_median"] and math.isfinite(r["tpot_ms_mean"]) and r["tpot_ms_mean"] > 0, r
        assert ("fill_ms_per_step" in r) == (name != "free")
    assert rows["free"]["tpot_vs_free"] == 1.0
    for name in ("half", "half_pool"):  # requests 0 and 2 of 3 are constrained: masks on most steps
        assert rows[name]["fill_ms_per_step"] > 0 and rows[name]["advance_ms_per_step"] > 0
        assert 0 < rows[name]["masked_rows_per_step"] <= 2
    cache = report["cache"]
    assert cache["misses"] >= 1 and cache["hits"] + cache["misses"] == 4  # 2 constrained requests x 2 variants
    suite = report["suite_compile"]
    assert suite["suite_schemas"] == len(SCHEMAS)
    assert 0 < suite["compile_ms_median"] <= suite["compile_ms_max"]
    assert 0 < suite["first_mask_ms_median"] <= suite["first_mask_ms_max"]
    out = capsys.readouterr().out
    for name in rows:
        assert f"| {name} | " in out
    assert "ERROR" not in out
