"""``loraplex bench combine``: several reports in one table, TP ratios, and the serving workload's targets (n/a
without figures, never a pass)."""
from __future__ import annotations

import json

import pytest

from loraplex.bench.combine import combine_reports, serving_checks


def _scenario(name, tok_s, tpot, ttft=100.0):
    return dict(name=name, num_requests=64, per_request_output_tok_s=tok_s, per_request_decode_tok_s=1e3 / tpot,
                ttft_p50_ms=ttft, ttft_p99_ms=2 * ttft, tpot_mean_ms=tpot, output_throughput_tok_s=16 * tok_s,
                total_throughput_tok_s=50 * tok_s, peak_memory_gib=50.0, truncated=False, extra={})


def _write(tmp_path, name, scenarios, engine, hf=(), workload=None):
    path = tmp_path / name / "bench_serve.json"
    path.parent.mkdir()
    path.write_text(json.dumps(dict(command=f"loraplex bench serve ({name})", env={"device": "NVIDIA H200"},
                                    engine=engine, scenarios=scenarios, hf_baseline=list(hf),
                                    setup_s={"engine_start": 12.0}, workload=workload or {})), encoding="utf-8")
    return str(path)


def _replayed(name, tok_s, tpot):
    s = _scenario(f"{name} [replayed proposals]", tok_s, tpot)
    s["extra"] = {"speculative": {"method": "replay", "acceptance_length": 2.99}}
    return s


def test_mxfp4_targets_and_speculative_goals_from_their_own_runs(tmp_path):
    """A speculative run listed first is not taken for the plain targets; its goal is checked at L = 3 only."""
    spec = dict(speculative_method="replay", speculative_acceptance_length=3.0)
    runs = [
        _write(tmp_path, "spec-bf16-3.0", [_replayed("bf16 8 adapters r32", 179.0, 5.5)],
               {"bf16": {"tensor_parallel_size": 1}}, workload=spec),
        _write(tmp_path, "spec-mxfp4-2.5", [_replayed("mxfp4 8 adapters r32", 350.0, 3.0)],
               {"mxfp4": {"tensor_parallel_size": 1}}, workload={**spec, "speculative_acceptance_length": 2.5}),
        _write(tmp_path, "spec-mxfp4-3.0", [_replayed("mxfp4 8 adapters r32", 305.0, 3.3)],
               {"mxfp4": {"tensor_parallel_size": 1}}, workload=spec),
        _write(tmp_path, "bf16", [_scenario("bf16 base-only", 95.0, 10.4),
                                  _scenario("bf16 8 adapters r32", 87.0, 11.5)], {"bf16": {"tensor_parallel_size": 1}}),
        _write(tmp_path, "mxfp4", [_scenario("mxfp4 base-only", 175.0, 5.7),
                                   _scenario("mxfp4 8 adapters r32", 150.0, 6.6, ttft=40.0)],
               {"mxfp4": {"tensor_parallel_size": 1}}),
    ]
    verdicts = {c["check"]: (c["verdict"], c["value"], c["detail"]) for c in combine_reports(runs)["checks"]}
    assert verdicts["bf16, adapters: output tok/s per request >= 100"] == ("FAIL", 87.0, "bf16")
    assert verdicts["MXFP4 experts, adapters: output tok/s per request >= 180"] == ("FAIL", 150.0, "mxfp4")
    assert verdicts["MXFP4 experts, adapters: TTFT p50 ms <= 100"] == ("PASS", 40.0, "mxfp4")
    assert verdicts["MXFP4 experts: adapter TPOT / base TPOT <= 1.10"][:2] == ("FAIL", pytest.approx(6.6 / 5.7))
    goal = "output tok/s per request >= "
    assert verdicts[f"bf16, adapters, speculative (replayed, acceptance length 3): {goal}200"] == \
        ("FAIL", 179.0, "spec-bf16-3.0")
    assert verdicts[f"MXFP4 experts, adapters, speculative (replayed, acceptance length 3): {goal}300"] == \
        ("PASS", 305.0, "spec-mxfp4-3.0")


def test_combined_table_tp_ratios_and_checks(tmp_path, capsys):
    from loraplex.cli import main

    one = _write(tmp_path, "tp1", [_scenario("bf16 base-only", 110.0, 9.0),
                                   _scenario("bf16 8 adapters r32", 100.0, 10.0, ttft=140.0)],
                 {"bf16": {"tensor_parallel_size": 1, "cuda_graphs": 0}},
                 hf=[dict(name="HF transformers + PEFT (1 adapter)", batch=16, output_len=32, ttft_ms=900.0,
                          per_request_output_tok_s=5.0, per_request_decode_tok_s=6.0, output_throughput_tok_s=80.0,
                          peak_memory_gib=60.0, generate_s=6.4, est_per_request_output_tok_s=5.9)])
    two = _write(tmp_path, "tp2", [_scenario("bf16 8 adapters r32", 150.0, 6.5, ttft=70.0)],
                 {"bf16": {"tensor_parallel_size": 2, "cuda_graphs": 0}})
    rc = main(["bench", "combine", "--out", str(tmp_path / "all"), one, f"TP two={two}",
               str(tmp_path / "gone" / "bench_serve.json")])
    assert rc == 0
    combined = json.loads((tmp_path / "all" / "bench_combined.json").read_text(encoding="utf-8"))
    assert [(r["run"], r["scenario"]) for r in combined["rows"]] == [
        ("tp1", "bf16 base-only"), ("tp1", "bf16 8 adapters r32"),
        ("tp1", "HF transformers + PEFT (1 adapter) (static batch 16, output 32)"), ("TP two", "bf16 8 adapters r32")]
    assert len(combined["missing"]) == 1 and "gone" in combined["missing"][0]
    (tp,) = combined["tp"]
    assert tp["tp_run"] == "TP two" and tp["tp1_run"] == "tp1"
    assert tp["per_request_output"] == pytest.approx(1.5) and tp["ttft_p50"] == pytest.approx(0.5)
    verdicts = {c["check"]: (c["verdict"], c["value"]) for c in combined["checks"]}
    assert verdicts["bf16, adapters: output tok/s per request >= 100"] == ("PASS", 100.0)  # TP=1 run, not TP=2
    assert verdicts["bf16, adapters: TTFT p50 ms <= 150"] == ("PASS", 140.0)
    assert verdicts["bf16: adapter TPOT / base TPOT <= 1.10"][0] == "FAIL"                 # 10 / 9 = 1.11
    assert verdicts["INT8 experts, adapters: output tok/s per request >= 170"] == ("n/a", None)
    assert verdicts["bf16 adapters decode tok/s per request / HF+PEFT >= 15"][1] == pytest.approx(100 / 6)
    md = capsys.readouterr().out
    assert "| TP two | bf16 8 adapters r32 | 2 |" in md and "| INT8 experts" in md


def test_nothing_to_combine_and_no_figures():
    from loraplex.cli import main

    with pytest.raises(SystemExit, match="no report to combine"):
        main(["bench", "combine", "/nonexistent/bench_serve.json"])
    with pytest.raises(ValueError, match="no report to combine"):
        combine_reports(["x=/nonexistent.json"])
    assert {c["verdict"] for c in serving_checks([])} == {"n/a"}
