"""benchmarks/engine/bench_numerical_check.py on a cut-down GPT-OSS shape (one layer of 4 experts at the real
widths; the full 24 x 32 takes ~20 s) and the tests' tiny families (``--tiny``): every row's adapter passes the
upload check, the counts of modules and comparisons are the adapter's, the times are positive, the JSON is written."""
from __future__ import annotations

import json
import math

from tests.utils.scripts import load_script

bench = load_script("engine", "bench_numerical_check")


def test_check_rows_for_gpt_oss_shape_and_tiny_families(tmp_path, monkeypatch, capsys):
    from loraplex.platform.uploads.numerical_check import RTOL
    from tests.utils.tiny_models import FAMILIES

    monkeypatch.setattr(bench, "GPT_OSS_20B", dict(bench.GPT_OSS_20B, num_hidden_layers=1, num_local_experts=4))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.main(["--rank", "2", "--repeat", "2", "--tiny"]) == 0
    report = json.loads((tmp_path / "bench_numerical_check.json").read_text())
    rows = report["rows"]
    assert [r["shape"] for r in rows] == [f"tiny {f}" for f in FAMILIES] + ["gpt-oss-20b attn+experts"]
    for r in rows:
        assert 0 < r["worst_relative_error"] <= RTOL, r
        assert 0 < r["check_s_min"] <= r["check_s_median"] and r["check_cpu_s_min"] > 0, r
        assert math.isfinite(r["scan_sha256_s"]) and r["scan_sha256_s"] > 0 and r["file_bytes"] > 0, r
        assert r["comparisons"] >= r["modules"] > 0, r
    gpt = rows[-1]
    # q/k/v/o, gate_up and down of the one layer; each expert of the two expert targets compared on its own
    assert (gpt["rank"], gpt["modules"], gpt["comparisons"]) == (2, 6, 4 + 2 * 4)
    h, i, e, r = 2880, 2880, 4, 2
    q, kv = 64 * 64, 8 * 64
    params = r * (h + q) + 2 * r * (h + kv) + r * (q + h) + r * e * (h + 2 * i) + r * e * (i + h)
    assert 2 * params < gpt["file_bytes"] < 2 * params + 4096  # bf16 tensors and the safetensors header
    out = capsys.readouterr().out
    assert "built a rank-2 GPT-OSS-20B-shape adapter" in out and "wrote " in out
    assert sum(line.startswith(("tiny ", "gpt-oss-20b ")) for line in out.splitlines()) == len(rows)
