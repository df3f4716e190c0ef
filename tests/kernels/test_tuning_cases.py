"""The tuner / benchmark / GPU-check glue, exercised on CPU with tiny shapes through the interpreter."""
import json

import pytest
import torch

from loraplex.kernels import tuning
from loraplex.kernels.tuning_cases import ModelShapes, misc_cases, shared_metadata_cases, tunable_cases

TINY = ModelShapes("tiny", hidden=32, num_experts=4, top_k=2, moe_intermediate=16, num_heads=4, num_kv_heads=2,
                   head_dim=16, activation="swiglu_clamp", expert_bias=True)


@pytest.mark.parametrize("m", [1, 7])
def test_cases_run_and_match_references(m):
    cases = tunable_cases(TINY, m, 3, 16, torch.float32, "cpu") + misc_cases(TINY, m, torch.float32, "cpu",
                                                                             context=32)
    labels = {c.label for c in cases}
    assert {"fused_moe", "fused_moe_int8", "lora_shrink[qkv]", "lora_expand[qkv]", "lora_shrink_expand[qkv]",
            "fused_moe_lora[gate_up]",
            "fused_moe_lora[down]", "paged_attention[decode ctx=32]"} <= labels
    for case in cases:
        assert case.check() < 1e-4, case.label
        assert case.nbytes > 0
        if case.default is not None:
            case.run(case.default)
            assert case.space and all(set(case.default) == set(c) for c in case.space), case.label
        for name, cfg in case.variants.items():  # the one-kernel / PDL paths the benchmark and GPU check run
            assert case.check(cfg) < 1e-4, (case.label, name)
    assert {c.label for c in cases if c.variants} == {"lora_expand[qkv]", "fused_moe_lora[gate_up]",
                                                      "fused_moe_lora[down]"}


def test_fused_candidates_only_at_small_m():
    from loraplex.kernels.tuning_cases import FUSED_MAX_M, moe_lora_space

    small, large = moe_lora_space(1), moe_lora_space(FUSED_MAX_M + 1)
    assert any(c["FUSED"] for c in small) and not any(c["FUSED"] for c in large)
    assert any(c["PDL"] and not c["FUSED"] for c in large)  # PDL two-kernel candidates at every M
    assert len({tuple(sorted(c.items())) for c in small}) == len(small)  # no duplicate candidates


def test_time_budget_is_shared_out_over_cases_with_carry_over():
    from loraplex.commands.tune import case_deadline

    assert [case_deadline(100.0, 60.0, i, 6) for i in (1, 2, 6)] == [110.0, 120.0, 160.0]
    assert case_deadline(100.0, 0.0, 1, 6) == float("inf")


def test_tune_skips_candidates_that_fail_and_times_strictly(monkeypatch):
    """A candidate whose timing raises (launch error, or a graph capture the engine could not do either) is
    skipped; every timing asks for strict capture."""
    from loraplex.commands import tune

    case = [c for c in tunable_cases(TINY, 7, 3, 16, torch.float32, "cpu") if c.op == "lora_expand"][0]
    calls = []

    def fake(fn, **kw):
        calls.append(kw)
        if len(calls) == 2:
            raise RuntimeError("capture failed")
        return 2.0 if len(calls) == 3 else 4.0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr("loraplex.kernels.tuning_cases.bench_time_ms", fake)
    best, best_ms, default_ms = tune.tune_case(case, deadline=float("inf"))
    assert (best, best_ms, default_ms) == (case.space[1], 2.0, 4.0)
    assert all(kw.get("strict") for kw in calls)


def test_shared_metadata_cases_run_and_leave_the_tuner_alone():
    """Benchmark-only rows (metadata shared per step / per layer) match the references; op name empty so
    ``loraplex tune`` never writes them; default and tuned runs both launch."""
    cases = {c.label: c for c in shared_metadata_cases(TINY, 7, 3, 16, torch.float32, "cpu")}
    assert set(cases) == {"lora_segments", "lora_shrink[qkv] kernel", "lora_expand[qkv] kernel",
                          "fused_moe_lora[gate_up] kernels", "fused_moe_lora[down] kernels"}
    assert all(c.op == "" and not c.space for c in cases.values())
    for case in cases.values():
        assert case.check() < 1e-4, case.label
        if case.default is not None:
            case.run(case.default)
        for name, cfg in case.variants.items():
            assert case.check(cfg) < 1e-4, (case.label, name)
    assert {label for label, c in cases.items() if c.variants} == {
        "lora_expand[qkv] kernel", "fused_moe_lora[gate_up] kernels", "fused_moe_lora[down] kernels"}


def test_tune_picks_fastest_and_writes_through_naming_function(tmp_path, monkeypatch):
    from loraplex.commands import tune

    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path))
    tuning.clear_cache()
    case = [c for c in tunable_cases(TINY, 7, 3, 16, torch.float32, "cpu") if c.op == "lora_shrink"][0]
    fastest = case.space[3]
    timings = iter([5.0] + [1.0 if c is fastest else 3.0 for c in case.space])
    monkeypatch.setattr("loraplex.kernels.tuning_cases.bench_time_ms", lambda fn, **kw: next(timings))
    best, best_ms, default_ms = tune.tune_case(case, deadline=float("inf"))
    assert (best, best_ms, default_ms) == (fastest, 1.0, 5.0)
    path = tuning.write_configs(case.op, {tuning.shape_key(case.shape): {7: best}}, device_name="Fake GPU")
    assert path == tmp_path / "Fake_GPU" / "lora_shrink.json"
    assert json.loads(path.read_text())[tuning.shape_key(case.shape)]["7"] == fastest
    assert tuning.get_config("lora_shrink", case.shape, 9, {}, device_name="Fake GPU") == fastest
    tuning.clear_cache()


def test_tune_refuses_without_gpu(monkeypatch):
    from loraplex.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["tune", "--model", "gpt-oss-20b"])


def test_tune_rejects_bad_m():
    from loraplex.commands.tune import parse_ms

    with pytest.raises(SystemExit, match="--m must be comma-separated integers"):
        parse_ms("1,x")
    assert parse_ms("64,1,16,16") == [1, 16, 64]


def test_tune_reads_shapes_from_a_checkpoint_config(tmp_path):
    from loraplex.commands.tune import resolve_shapes

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 1000, "num_local_experts": 32,
        "num_experts_per_tok": 4, "intermediate_size": 2880, "sliding_window": 128}))
    shapes = resolve_shapes(str(tmp_path))
    preset = resolve_shapes("GPT-OSS-20B")
    assert (shapes.hidden, shapes.num_experts, shapes.top_k, shapes.moe_intermediate, shapes.qkv_slices,
            shapes.activation, shapes.expert_bias) == (preset.hidden, preset.num_experts, preset.top_k,
                                                        preset.moe_intermediate, preset.qkv_slices,
                                                        preset.activation, preset.expert_bias)
