"""The consolidation-envelope scenarios of ``loraplex bench serve`` at tiny scale on the CPU, on an engine as it is
without a memory-bounded adapter pool or tenant-fair scheduling: the concurrency sweep on one engine (C=1,2), the
churn scenario with an adapter slot budget beside the all-resident run, the plot and the results names; the
engine keywords of the adapter budget and the scheduling policy, passed only when asked for."""
from __future__ import annotations

import json

import pytest

from loraplex.bench.config import ServeBenchConfig


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from loraplex.cli import main

    out, results = tmp_path_factory.mktemp("sweep"), tmp_path_factory.mktemp("results")
    rc = main(["bench", "serve", "--scale", "tiny", "--device", "cpu", "--concurrency", "2,1", "--num-requests", "3",
               "--input-len", "12", "--output-len", "4", "--num-adapters", "2", "--mix", "zipf", "--out", str(out),
               "--results-dir", str(results)])
    assert rc == 0
    return json.loads((out / "bench_serve.json").read_text(encoding="utf-8")), out, results


def test_sweep_runs_every_level_on_one_engine(sweep):
    report, _, _ = sweep
    assert report["scenario"] == "load" and report["workload"]["levels"] == [1, 2]
    assert list(report["engine"]) == ["float32"] and report["engine"]["float32"]["max_num_seqs"] == 2
    assert [s["name"] for s in report["scenarios"]] == [
        "float32 base-only C=1", "float32 base-only C=2", "float32 2 adapters r4 C=1", "float32 2 adapters r4 C=2"]
    for s in report["scenarios"]:
        e = s["extra"]
        assert s["num_requests"] == e["planned_requests"] == max(3, 2 * e["level"]) and not s["truncated"]
        assert s["total_output_tokens"] == 4 * s["num_requests"]
        assert 0 < e["kv_usage_peak"] <= 1 and e["requests_running_peak"] <= e["level"]
        assert e["graph_steps"] == 0 and e["eager_steps"] == e["engine_steps"] > 0   # CPU: no CUDA graphs
        assert e["step_ms"]["graph"]["n"] == 0 and 0 < e["step_ms"]["eager"]["n"] <= e["engine_steps"]
        assert e["early_launched_steps"] == 0   # no overlapped decode step on this CPU engine to launch behind
        eager = e["step_ms"]["eager"]  # ms each: the calls' time fits in the run's wall time
        assert eager["p50"] > 0 and 0 < eager["mean"] * eager["n"] / 1e3 <= s["duration_s"]
        assert s["queue_wait_p50_ms"] is not None
        # with one client it is always in flight; at C=2 the ramp (from C=1's figures) may outlast a request here
        steady = s["steady_output_tok_s"]
        assert steady > 0 if e["level"] == 1 else (steady is None or steady > 0)
        assert e["adapters_resident_peak"] == (2 if "adapters" in s["name"] else 0)
    c1, c2 = report["scenarios"][:2]
    assert c1["extra"]["ramp_s"] == 0.0                     # the first level has no estimate to ramp over
    assert c2["extra"]["ramp_s"] == pytest.approx(          # the auto ramp: C=1's TTFT p50 + 4 x its TPOT p50
        (c1["ttft_p50_ms"] + 4 * c1["tpot_p50_ms"]) / 1e3)
    assert set(report["ratios"]) == {"float32 TPOT adapters / base C=1", "float32 TPOT adapters / base C=2"}
    # the in-process engine's config lookups that ran on the built-in defaults are reported (and noted if any)
    untuned = report["untuned_kernels"]
    assert isinstance(untuned, list) and all(isinstance(u, str) for u in untuned)
    assert any(n.startswith("built-in default kernel configs") for n in report["notes"]) == bool(untuned)


def test_untuned_kernels_are_reported_for_an_engine_in_this_process_only(monkeypatch):
    from loraplex.bench import serve
    from loraplex.kernels import tuning

    monkeypatch.setattr(tuning, "untuned", lambda: ["lora_shrink S=1,R=32,K=4096", "fused_moe (no tuning file for x)"])
    assert serve._untuned_kernels("in-process") == ["lora_shrink S=1,R=32,K=4096", "fused_moe (no tuning file for x)"]
    assert serve._untuned_kernels("end-to-end") is None  # the engine behind --url is another process
    assert serve._untuned_note(serve._untuned_kernels("in-process")) == [
        "built-in default kernel configs (no tuned entry for this device) for: lora_shrink S=1,R=32,K=4096; "
        "fused_moe (no tuning file for x)"]
    assert serve._untuned_note([]) == [] and serve._untuned_note(None) == []


def test_sweep_writes_its_results_name_and_a_plot(sweep):
    report, out, results = sweep
    stem = report["name"]
    assert stem == f"sweep-gpt-oss-tiny-fp32-{report['env']['date'][:10]}"
    assert {p.name for p in results.iterdir()} == {f"{stem}.json", f"{stem}.md", f"{stem}.png"}
    assert (results / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (results / f"{stem}.md").read_text(encoding="utf-8")
    assert "concurrency 1,2" in md and "| float32 2 adapters r4 C=2 | 2 |" in md


def test_plot_command_puts_several_reports_on_one_figure(sweep, tmp_path):
    from loraplex.bench.plot import sweep_lines
    from loraplex.cli import main

    report, out, _ = sweep
    lines = sweep_lines(report)
    assert [(ln["label"].split(": ")[1], ln["levels"]) for ln in lines] == [
        ("float32 base-only", [1, 2]), ("float32 2 adapters r4", [1, 2])]
    assert lines[0]["output"] == [s["output_throughput_tok_s"] for s in report["scenarios"][:2]]
    png = tmp_path / "docs" / "sweep.png"
    assert main(["bench", "plot", f"in-process={out / 'bench_serve.json'}", str(out / "bench_serve.json"),
                 "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="no sweep rows"):
        empty = tmp_path / "empty.json"
        empty.write_text(json.dumps({"scenarios": [], "workload": {}}), encoding="utf-8")
        main(["bench", "plot", str(empty), "--out", str(tmp_path / "x.png")])


def test_repeats_measure_each_level_several_times_and_ratio_the_mean(tmp_path):
    """--repeats 2 at one level: samples #1 and #2 of each variant in a row on one engine, both with the level's
    ramp; the ratio is that of the samples' mean TPOTs, each sample's ratio (against the base-only sample of the
    same index) giving the min and max beside it; the Markdown says how many samples."""
    from loraplex.cli import main

    out = tmp_path / "out"
    assert main(["bench", "serve", "--scale", "tiny", "--device", "cpu", "--concurrency", "2", "--num-requests",
                 "2", "--input-len", "12", "--output-len", "4", "--num-adapters", "2", "--repeats", "2", "--out",
                 str(out)]) == 0
    report = json.loads((out / "bench_serve.json").read_text(encoding="utf-8"))
    rows = report["scenarios"]
    assert [s["name"] for s in rows] == ["float32 base-only #1", "float32 base-only #2", "float32 2 adapters r4 #1",
                                         "float32 2 adapters r4 #2"]
    assert [s["extra"]["sample"] for s in rows] == [1, 2, 1, 2] and {s["extra"]["level"] for s in rows} == {2}
    assert all(s["num_requests"] == 2 and not s["truncated"] for s in rows)
    base, lora = [s["tpot_mean_ms"] for s in rows[:2]], [s["tpot_mean_ms"] for s in rows[2:]]
    r = report["ratios"]
    key = "float32 TPOT adapters / base"
    assert r[key] == pytest.approx(sum(lora) / sum(base))
    assert r[key + " sample min"] == pytest.approx(min(a / b for a, b in zip(lora, base)))
    assert r[key + " sample max"] == pytest.approx(max(a / b for a, b in zip(lora, base)))
    assert "each level measured 2 times" in (out / "bench_serve.md").read_text(encoding="utf-8")


def test_plot_lines_average_a_levels_samples():
    from loraplex.bench.plot import sweep_lines

    def row(level, sample, out, p99, truncated=False):
        return {"extra": {"variant": "v", "level": level, "sample": sample, "phase": ""}, "truncated": truncated,
                "output_throughput_tok_s": out, "steady_output_tok_s": out, "ttft_p50_ms": 1.0, "ttft_p99_ms": p99}

    report = {"name": "r", "scenarios": [row(2, 1, 10.0, 5.0), row(1, 1, 4.0, 1.0), row(2, 2, 20.0, 7.0, True)]}
    (line,) = sweep_lines(report)
    assert line["levels"] == [1, 2] and line["output"] == [4.0, 15.0] and line["ttft_p99"] == [1.0, 6.0]
    assert line["truncated"] == [False, True]


def test_churn_with_a_slot_budget_beside_all_resident(tmp_path):
    from loraplex.cli import main

    rc = main(["bench", "serve", "--scale", "tiny", "--device", "cpu", "--scenario", "churn", "--num-adapters", "4",
               "--adapter-files", "2", "--max-loras", "2", "--mix", "uniform", "--concurrency", "2",
               "--num-requests", "6", "--input-len", "12", "--output-len", "3", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "bench_serve.json").read_text(encoding="utf-8"))
    assert list(report["engine"]) == ["float32 all-resident", "float32 2 slots"]
    assert report["engine"]["float32 all-resident"]["max_loras"] == 4 and report["engine"]["float32 2 slots"][
        "max_loras"] == 2
    full, tight = report["scenarios"]
    assert full["name"] == "float32 all-resident 4 adapters r4" and tight["name"] == "float32 2 slots 4 adapters r4"
    assert full["extra"]["adapters_resident_peak"] == 4 and full["extra"]["adapter_counters"]["evictions"] == 0
    assert tight["extra"]["adapters_resident_peak"] == 2
    assert tight["extra"]["adapter_counters"]["evictions"] > 0          # adapters were swapped during the run
    assert tight["extra"]["adapter_wait_ms"]["cold"]["n"] > 0            # some requests found theirs not resident
    for s in (full, tight):
        assert s["num_requests"] == 6 and s["total_output_tokens"] == 18
    assert set(report["ratios"]) == {"churn TTFT p99 float32 2 slots / all-resident",
                                     "churn OTPS per request float32 2 slots / all-resident"}
    assert "4 adapters read from 2 files" in " ".join(report["notes"])


def test_engine_keywords_of_the_budget_and_policy_only_when_asked_for(tmp_path):
    from loraplex.bench.engine_knobs import adapter_nbytes
    from loraplex.bench.engine_setup import engine_kwargs
    from loraplex.bench.scenarios import phases
    from loraplex.bench.workload import GPT_OSS_20B, GPT_OSS_TINY, adapter_tensor_shapes

    # a GPT-OSS-20B r32 adapter on attention and experts: 705 MiB of factors in bf16 (its file: 708 MB)
    assert adapter_nbytes(GPT_OSS_20B, rank=32, dtype="bfloat16") == 2 * sum(
        a * b for a, b in adapter_tensor_shapes(GPT_OSS_20B, 32).values())
    assert round(adapter_nbytes(GPT_OSS_20B, rank=32, dtype="bfloat16") / 2**20) == 705
    one = adapter_nbytes(GPT_OSS_TINY, rank=4, dtype="float32")
    cfg = ServeBenchConfig(scale="tiny", scenario="churn", num_adapters=8, rank=4, adapter_budget=3)
    full, tight = phases(cfg, precision="fp32", adapter_bytes=one)
    assert (full.label, tight.label) == ("fp32 all-resident", "fp32 budget 3")
    assert full.engine_extra == {"adapter_memory_bytes": 8 * one}      # all of them fit
    assert tight.engine_extra == {"adapter_memory_bytes": 3 * one}
    kw = engine_kwargs(cfg, str(tmp_path), device="cpu", dtype="float32", quantization=None,
                       max_loras=tight.max_loras, extra=tight.engine_extra)
    assert kw["adapter_memory_bytes"] == 3 * one and kw["max_loras"] == 8
    gib = ServeBenchConfig(scale="tiny", scenario="churn", num_adapters=8, adapter_memory_gib=0.5)
    assert phases(gib, precision="fp32", adapter_bytes=one)[1].engine_extra == {"adapter_memory_bytes": 2**29}
    fair = ServeBenchConfig(scale="tiny", scenario="fairness", scheduling_policies=("fcfs", "vtc"))
    assert [(p.label, p.engine_extra) for p in phases(fair, precision="fp32", adapter_bytes=one)] == [
        ("fp32 fcfs", {"scheduling_policy": "fcfs"}), ("fp32 vtc", {"scheduling_policy": "vtc"})]
    # without those flags: no new keyword at all (every other scenario builds the EngineConfig it always did)
    for c in (ServeBenchConfig(scale="tiny"), ServeBenchConfig(scale="tiny", scenario="fairness"),
              ServeBenchConfig(scale="tiny", scenario="churn", num_adapters=4, max_loras=2)):
        for p in phases(c, precision="fp32", adapter_bytes=one):
            kw = engine_kwargs(c, str(tmp_path), device="cpu", dtype="float32", quantization=None,
                               max_loras=p.max_loras, extra=p.engine_extra)
            assert not {"adapter_memory_bytes", "scheduling_policy"} & set(kw)
    sized = engine_kwargs(ServeBenchConfig(scale="tiny", kv_sizing="engine"), str(tmp_path), device="cpu",
                          dtype="float32", quantization=None)
    assert "num_kv_blocks" not in sized and "max_num_seqs" not in sized


def test_fairness_runs_light_alone_once_then_beside_each_heavy_n():
    from loraplex.bench.scenarios import RunSequence, phases

    cfg = ServeBenchConfig(scale="tiny", scenario="fairness", num_adapters=2, light_rate=2.0, arrivals="fixed",
                           scenario_time_s=3.0, heavy_n=(1, 64), scheduling_policies=("fcfs", "vtc"))
    names = []
    for p in phases(cfg, precision="fp32", adapter_bytes=1):
        seq = RunSequence(p.runs())
        while (m := seq.next(None)) is not None:
            names.append(m.name)
            light = m.group("light")
            assert light.arrivals == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5] and light.tenant == "light"
            assert {r.adapter for r in light.plan} == {0}
            if len(m.groups) == 2:
                heavy = m.group("heavy")
                assert heavy.background and heavy.tenant == "heavy" and {r.adapter for r in heavy.plan} == {1}
                assert len(heavy.arrivals) == 60              # 10 x the light rate over the window, fixed
                assert m.background_s == 6.0 and m.hard_s == 9.0
    assert names == ["fp32 fcfs light alone", "fp32 fcfs light beside heavy", "fp32 fcfs light beside heavy n=64",
                     "fp32 vtc light beside heavy", "fp32 vtc light beside heavy n=64"]


def test_results_names():
    from loraplex.bench.naming import result_stem

    def stem(mode="in-process", **wl):
        wl = dict(dict(scale="full", dtype="bfloat16", quantization=None, scenario="load", levels=[16]), **wl)
        return result_stem({"mode": mode, "env": {"date": "2026-12-01 10:00 UTC"}, "workload": wl})

    assert stem(levels=[1, 16, 64]) == "sweep-gpt-oss-20b-bf16-2026-12-01"
    assert stem() == "serve-gpt-oss-20b-bf16-2026-12-01"
    assert stem(label="seed") == "seed-gpt-oss-20b-bf16-2026-12-01"
    assert stem(scenario="churn", quantization="mxfp4") == "churn-gpt-oss-20b-mxfp4-2026-12-01"
    assert stem(scenario="fairness", scale="tiny", dtype="float32") == "fairness-gpt-oss-tiny-fp32-2026-12-01"
    assert stem("end-to-end", levels=[1, 2], base_model="GPT-OSS 20B") == "sweep-gpt-oss-20b-e2e-2026-12-01"


def test_envelope_options_are_validated():
    from loraplex.cli import main

    with pytest.raises(ValueError, match="concurrency must be an integer or a comma-separated list"):
        ServeBenchConfig(concurrency="1,x")
    with pytest.raises(ValueError, match="churn scenario needs an adapter budget"):
        ServeBenchConfig(scenario="churn", num_adapters=4)
    with pytest.raises(ValueError, match="must be below num_adapters"):
        ServeBenchConfig(scenario="churn", num_adapters=4, adapter_budget=4)
    with pytest.raises(ValueError, match="either in adapters"):
        ServeBenchConfig(scenario="churn", num_adapters=4, adapter_budget=2, adapter_memory_gib=1.0)
    with pytest.raises(ValueError, match="runs at one concurrency"):
        ServeBenchConfig(scenario="churn", num_adapters=4, max_loras=2, concurrency="1,2")
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        ServeBenchConfig(repeats=0)
    with pytest.raises(ValueError, match="repeats applies to the load scenario"):
        ServeBenchConfig(scenario="churn", num_adapters=4, max_loras=2, repeats=2)
    with pytest.raises(ValueError, match="either stagger"):
        ServeBenchConfig(concurrency="1,2", stagger_s=0.5, ramp=3.0)
    with pytest.raises(ValueError, match="fairness scenario only"):
        ServeBenchConfig(scheduling_policies=("vtc",))
    with pytest.raises(ValueError, match="scheduling policy 'lottery'"):
        ServeBenchConfig(scenario="fairness", scheduling_policies=("lottery",))
    with pytest.raises(ValueError, match="--url needs tenant keys"):
        ServeBenchConfig(url="http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="go with --url"):
        ServeBenchConfig(api_key="k")
    with pytest.raises(ValueError, match="belong to the deployment"):
        ServeBenchConfig(url="http://h/v1", api_key="k", quantization="int8")
    assert ServeBenchConfig(concurrency="64,1,16,16").levels == (1, 16, 64)
    assert ServeBenchConfig(concurrency="1,16").ramp == "auto" and ServeBenchConfig().ramp is None
    assert ServeBenchConfig(concurrency="1,16").requests_at(16) == 64 and ServeBenchConfig().requests_at(16) == 64
    assert ServeBenchConfig(concurrency="1,256").requests_at(256) == 512
    short = ServeBenchConfig(concurrency="128")  # 64 requests: the run never holds 128 in flight, and says so
    assert short.notes == ["64 requests at concurrency 128: never more than 64 in flight (--num-requests or "
                           "--requests-per-client for a run at concurrency 128)"]
    assert ServeBenchConfig(concurrency="128", requests_per_client=2).notes == []
    assert ServeBenchConfig(concurrency="16").notes == [] and ServeBenchConfig(concurrency="1,128").notes == []
    with pytest.raises(SystemExit, match="ramp must be 'auto' or seconds"):
        main(["bench", "serve", "--scale", "tiny", "--ramp", "soon"])
